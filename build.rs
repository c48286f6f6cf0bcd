//! With the `cuda` feature: compiles `kernels/*.cu` to PTX with nvcc, embedded by `src/cuda`.
//! The default (CPU) build runs nothing here and needs no CUDA at all.
//!
//! PTX, not machine code, and for `compute_75` (any GPU from Turing on): the driver compiles it
//! for the card on first load, so one binary runs on an RTX 20xx and on an H200 alike. Built here
//! rather than by NVRTC at run time so that a kernel that does not compile fails the build (and
//! CI), not a user's first call. nvcc comes from `$NVCC`, `$CUDA_HOME/bin`, or `PATH`;
//! `scripts/cuda-toolchain.sh` installs a pinned one without a GPU.

use std::env;
use std::path::PathBuf;
use std::process::Command;

const KERNELS: [&str; 1] = ["ffn"];
/// The virtual architecture of the PTX (override with `POWERINFER_CUDA_ARCH`, e.g. `compute_90`).
const ARCH: &str = "compute_75";

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    for v in ["NVCC", "CUDA_HOME", "POWERINFER_CUDA_ARCH"] {
        println!("cargo:rerun-if-env-changed={v}");
    }
    if env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out_dir = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let nvcc = env::var("NVCC").unwrap_or_else(|_| match env::var("CUDA_HOME") {
        Ok(h) if PathBuf::from(&h).join("bin/nvcc").exists() => format!("{h}/bin/nvcc"),
        _ => "nvcc".into(),
    });
    let arch = env::var("POWERINFER_CUDA_ARCH").unwrap_or_else(|_| ARCH.into());
    for k in KERNELS {
        let src = format!("kernels/{k}.cu");
        println!("cargo:rerun-if-changed={src}");
        let out = out_dir.join(format!("{k}.ptx"));
        let status = Command::new(&nvcc)
            .args(["--ptx", "-O3", "-std=c++17"])
            .arg(format!("--gpu-architecture={arch}"))
            .arg("-o")
            .arg(&out)
            .arg(&src)
            .status()
            .unwrap_or_else(|e| {
                panic!(
                    "the `cuda` feature needs nvcc: cannot run `{nvcc}` ({e}); \
                     `eval \"$(scripts/cuda-toolchain.sh --env)\"` installs one"
                )
            });
        assert!(status.success(), "nvcc failed on {src}");
    }
}
