//! Hostile neuron indices, batch sizes, thresholds and inputs (NaN, infinities) against the
//! placement, the predictors and the FFN: every outcome must be a value or a typed error, never a
//! panic or an out-of-bounds access.
#![no_main]

use std::sync::OnceLock;

use candle_core::{Device, Tensor};
use libfuzzer_sys::fuzz_target;
use powerinfer::{
    plan_placement, Activation, FfnSpec, FfnWeights, GateFirst, HybridFfn, HybridOptions,
    LayerPlacement, Oracle, WeightDType,
};

const H: usize = 17;
const N: usize = 33;

fn weights() -> &'static (Tensor, Tensor, Tensor) {
    static W: OnceLock<(Tensor, Tensor, Tensor)> = OnceLock::new();
    W.get_or_init(|| {
        let d = Device::Cpu;
        let v = |n: usize| (0..n).map(|i| ((i * 31 % 17) as f32 - 8.0) / 16.0).collect::<Vec<_>>();
        (
            Tensor::from_vec(v(N * H), (N, H), &d).unwrap(),
            Tensor::from_vec(v(N * H), (N, H), &d).unwrap(),
            Tensor::from_vec(v(H * N), (H, N), &d).unwrap(),
        )
    })
}

fuzz_target!(|data: &[u8]| {
    if data.len() < 4 {
        return;
    }
    let (head, rest) = data.split_at(4);
    let rows = (head[0] % 5) as usize;
    let act = [Activation::Relu, Activation::DRelu, Activation::Silu, Activation::Gelu][head[1] as usize % 4];
    let dtype = [WeightDType::F32, WeightDType::F16, WeightDType::BF16][head[2] as usize % 3];
    let ids: Vec<u32> = rest.chunks(2).map(|c| c[0] as u32 % 64).collect();
    let _ = LayerPlacement::new(N, ids.clone(), Some(1));
    let freqs: Vec<f64> = rest.iter().map(|&b| if b == 255 { f64::NAN } else { b as f64 - 10.0 }).collect();
    let _ = plan_placement(&[freqs], &[head[3] as u64], head[3] as u64 * 3);

    let (g, u, d) = weights();
    let spec = FfnSpec::gated(H, N, act).unwrap();
    let opts = HybridOptions { threads: 1 + head[3] as usize % 3, ..Default::default() };
    let Ok(ffn) = HybridFfn::from_weights(spec, FfnWeights::gated(g, u, d), dtype, opts) else { return };
    let ffn = match LayerPlacement::new(N, ids.clone(), None) {
        Ok(p) => ffn.with_placement(p).unwrap(),
        Err(_) => ffn,
    };
    let x: Vec<f32> = (0..rows * H)
        .map(|i| {
            let b = rest.get(i % rest.len().max(1)).copied().unwrap_or(0);
            match b {
                254 => f32::NAN,
                253 => f32::INFINITY,
                b => b as f32 / 64.0 - 2.0,
            }
        })
        .collect();
    let mut out = vec![0f32; rows * H];
    let ffn = if head[0] & 0x80 != 0 {
        ffn.with_predictor(GateFirst::new(head[1] as f32 / 128.0).unwrap())
    } else {
        let sets = ids.chunks(3).map(|c| c.to_vec()).collect::<Vec<_>>();
        ffn.with_predictor(Oracle::new(sets))
    };
    let _ = ffn.forward_f32(&x, rows, &mut out);
    if let Ok(t) = Tensor::from_vec(x, (rows, H), &Device::Cpu) {
        let _ = ffn.forward_tensor(&t);
    }
});
