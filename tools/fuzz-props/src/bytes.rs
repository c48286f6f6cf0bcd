//! Reading structured choices out of the fuzzer's bytes.

/// Takes values from the front of the input; past its end every value is zero.
pub(crate) struct Bytes<'a> {
    b: &'a [u8],
}

impl<'a> Bytes<'a> {
    pub(crate) fn new(b: &'a [u8]) -> Self {
        Bytes { b }
    }

    pub(crate) fn u8(&mut self) -> u8 {
        match self.b.split_first() {
            Some((&v, rest)) => {
                self.b = rest;
                v
            }
            None => 0,
        }
    }

    pub(crate) fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }

    pub(crate) fn u64(&mut self) -> u64 {
        let mut v = [0u8; 8];
        v.iter_mut().for_each(|b| *b = self.u8());
        u64::from_le_bytes(v)
    }

    /// A value in `0..n` (`n` > 0).
    pub(crate) fn below(&mut self, n: usize) -> usize {
        self.u16() as usize % n
    }

    /// The rest of the input.
    pub(crate) fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.b)
    }
}

/// A file of its own per thread under the temp directory, for readers that take a path.
pub(crate) fn scratch_path(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("powerinfer-fuzz-{}", std::process::id()));
    let _ = std::fs::create_dir_all(&dir);
    dir.join(format!("{:?}-{name}", std::thread::current().id()).replace(['(', ')'], ""))
}
