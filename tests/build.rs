//! Builds the CUDA kernels' host shim (`kernels-native/cuda/host/shim.cpp`: the kernel sources compiled as C++,
//! one OS thread per CUDA thread) into a static library for the `cuda_host_shim` test. Needs a C++17 compiler.

use std::path::PathBuf;

fn main() {
    let cuda = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"))
        .join("../kernels-native/cuda");
    println!("cargo:rerun-if-changed={}", cuda.display());
    cc::Build::new()
        .cpp(true)
        .std("c++17")
        .file(cuda.join("host/shim.cpp"))
        // The kernels' float operations in the order written: nothing fused unless the source says fmaf.
        .flag("-ffp-contract=off")
        .flag_if_supported("-Wno-unknown-pragmas")
        .opt_level(2)
        // Only the search path is announced: the test that uses the library links it (#[link] there), the
        // crate's library and other tests do not.
        .cargo_metadata(false)
        .compile("ds4_cuda_shim");
    println!("cargo:rustc-link-search=native={}", std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
}
