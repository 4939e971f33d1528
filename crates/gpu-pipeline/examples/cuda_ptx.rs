//! Compiles the CUDA kernels with NVRTC (no GPU needed) and writes their PTX for the given
//! architectures into a directory, for `CudaOptions::ptx_dir` on machines without NVRTC:
//! `cargo run -p zerolayer-gpu-pipeline --features cuda --example cuda_ptx -- DIR [sm_90 ...]`
//! (default sm_80 and sm_90). `scripts/gpu-check prepare` runs it.

use gpu_pipeline::executor::cuda::kernels;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let dir = std::path::PathBuf::from(args.next().ok_or("usage: cuda_ptx DIR [ARCH...]")?);
    let mut archs: Vec<String> = args.collect();
    if archs.is_empty() {
        archs = vec!["sm_80".into(), "sm_90".into()];
    }
    std::fs::create_dir_all(&dir)?;
    for arch in &archs {
        let ptx = kernels::compile(arch)?;
        let path = dir.join(kernels::ptx_file_name(arch));
        std::fs::write(&path, ptx.to_src())?;
        println!("{}", path.display());
    }
    Ok(())
}
