//! How fast one or more cores of this machine read memory: the floor under every product, which
//! must read each weight byte once per token.

use std::time::Instant;

/// Read bandwidth in GB/s, measured two ways over a buffer larger than the caches; the floor is
/// the better of the two.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ReadBandwidth {
    /// A plain sum: the hardware prefetchers alone.
    pub plain: f64,
    /// The same sum asking for each line 16 KiB ahead into L2, as the packed products do. On one
    /// core of a busy server this reads up to a quarter faster than the plain sum.
    pub prefetching: f64,
}

impl ReadBandwidth {
    /// The faster of the two reads, GB/s.
    pub fn best(&self) -> f64 {
        self.plain.max(self.prefetching)
    }
}

/// Bytes read per pass: 1 GiB, beyond the largest last-level caches of current servers (480 MB
/// on the machines this project is measured on), so the passes read DRAM.
const BUFFER_BYTES: usize = 1 << 30;

/// How far ahead the prefetching sum asks for lines.
const AHEAD_WORDS: usize = 16384 / 8;

/// Measures the read bandwidth with `threads` threads (each sums its own share of the buffer):
/// the best of 3 passes of each kind, interleaved.
pub fn read_bandwidth(threads: usize) -> ReadBandwidth {
    let words = BUFFER_BYTES / 8;
    let v: Vec<u64> = (0..words as u64).collect();
    let pass = |prefetch: bool| {
        let t = Instant::now();
        std::thread::scope(|s| {
            let hs: Vec<_> = v
                .chunks(words.div_ceil(threads.max(1)))
                .map(|part| s.spawn(move || sum(part, prefetch)))
                .collect();
            for h in hs {
                std::hint::black_box(h.join().ok());
            }
        });
        BUFFER_BYTES as f64 / t.elapsed().as_secs_f64() / 1e9
    };
    let mut best = ReadBandwidth {
        plain: 0.0,
        prefetching: 0.0,
    };
    for _ in 0..3 {
        best.plain = best.plain.max(pass(false));
        best.prefetching = best.prefetching.max(pass(true));
    }
    best
}

/// A wrapping sum over eight independent lanes (no dependency chain limits it).
fn sum(s: &[u64], prefetch: bool) -> u64 {
    let mut a = [0u64; 8];
    for (i, c) in s.chunks_exact(8).enumerate() {
        if prefetch {
            if let Some(ahead) = s.get(i * 8 + AHEAD_WORDS..i * 8 + AHEAD_WORDS + 8) {
                super::prefetch_l2(ahead);
            }
        }
        for (x, y) in a.iter_mut().zip(c) {
            *x = x.wrapping_add(*y);
        }
    }
    a.iter().fold(0, |x, y| x.wrapping_add(*y))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_are_the_same_with_and_without_prefetching() {
        let v: Vec<u64> = (0..1003).collect();
        assert_eq!(sum(&v, true), sum(&v, false));
        assert_eq!(sum(&v, false), (0..1000).sum::<u64>());
    }
}
