//! The CUDA compile check (no GPU needed): the whole kernel program (`cuda_kernels::program_source`) compiled by
//! NVRTC to PTX for sm_80, sm_90 and sm_120, then assembled by `ptxas -v --warn-on-spills` for each. Checked:
//! - every kernel of `cuda_kernels::KERNELS` is an entry point of the program, and nothing else is;
//! - no hot kernel spills registers (stores or loads) on any of the three architectures;
//! - registers, shared memory, stack frame and spills of every kernel match `cuda/ptxas-report.txt` (the test
//!   rewrites the file when they differ and fails under `CI=true`, so a change is committed with its numbers).
//!
//! Needs the PyPI wheels `nvidia-cuda-nvrtc==13.0.88` (libnvrtc) and `nvidia-cuda-nvcc==13.0.88` (ptxas), both
//! installed into one folder: `DS4_CUDA_WHEELS` names its `nvidia/cu13` directory (`scripts/test.sh` installs
//! them and sets it). Under `CI=true` a missing folder fails the test; elsewhere the test says so and passes.
//! libnvrtc and its builtins library are loaded by path before the first NVRTC call, so no `LD_LIBRARY_PATH` is
//! needed.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use ds4_kernels_native::cuda_kernels::{program_source, KERNELS};

const ARCHS: [(&str, &str); 3] = [("compute_80", "sm_80"), ("compute_90", "sm_90"), ("compute_120", "sm_120")];

fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
}

/// The wheels' `nvidia/cu13` folder, or `None` (outside CI only) when it is not there.
fn wheels() -> Option<PathBuf> {
    let dir = std::env::var_os("DS4_CUDA_WHEELS").map(PathBuf::from);
    let ok = |d: &Path| d.join("lib/libnvrtc.so.13").is_file() && d.join("bin/ptxas").is_file();
    match dir {
        Some(d) if ok(&d) => Some(d),
        other => {
            let why = match other {
                Some(d) => format!("DS4_CUDA_WHEELS={} lacks lib/libnvrtc.so.13 or bin/ptxas", d.display()),
                None => "DS4_CUDA_WHEELS is not set".to_string(),
            };
            assert!(
                !in_ci(),
                "CUDA compile check: {why}; scripts/test.sh installs nvidia-cuda-nvrtc==13.0.88 and \
                 nvidia-cuda-nvcc==13.0.88 and sets it"
            );
            eprintln!("SKIP cuda compile check: {why} (run scripts/test.sh, or install the wheels and set it)");
            None
        }
    }
}

/// Loads libnvrtc's builtins and libnvrtc by path, process-wide, so cudarc's lookup by soname finds them.
fn preload_nvrtc(dir: &Path) {
    use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};
    for lib in ["lib/libnvrtc-builtins.so.13.0", "lib/libnvrtc.so.13"] {
        let path = dir.join(lib);
        // SAFETY: NVIDIA's NVRTC libraries run no initialisation code with preconditions of ours; the handles
        // are leaked on purpose so the libraries stay loaded for the process.
        let l = unsafe { Library::open(Some(&path), RTLD_NOW | RTLD_GLOBAL) }
            .unwrap_or_else(|e| panic!("loading {}: {e}", path.display()));
        std::mem::forget(l);
    }
}

/// One kernel's ptxas figures.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Figures {
    regs: u32,
    smem: u32,
    stack: u32,
    spill_stores: u32,
    spill_loads: u32,
}

fn number_before(line: &str, unit: &str) -> Option<u32> {
    let at = line.find(unit)?;
    line[..at].split(|c: char| !c.is_ascii_digit()).rfind(|s| !s.is_empty())?.parse().ok()
}

/// Parses `ptxas -v` output into figures per entry function.
fn parse_ptxas(log: &str) -> BTreeMap<String, Figures> {
    let mut out = BTreeMap::new();
    let mut cur: Option<String> = None;
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap_or_default().to_string();
            out.insert(name.clone(), Figures::default());
            cur = Some(name);
            continue;
        }
        let Some(f) = cur.as_ref().and_then(|n| out.get_mut(n)) else { continue };
        if line.contains("bytes stack frame") {
            f.stack = number_before(line, "bytes stack frame").unwrap_or(0);
            f.spill_stores = number_before(line, "bytes spill stores").unwrap_or(0);
            f.spill_loads = number_before(line, "bytes spill loads").unwrap_or(0);
        }
        if line.contains("Used") && line.contains("registers") {
            f.regs = number_before(line, "registers").unwrap_or(0);
            f.smem = number_before(line, "bytes smem").unwrap_or(0);
        }
    }
    out
}

#[test]
fn ptxas_parser_reads_the_figures() {
    let log = "ptxas info    : Compiling entry function 'k1' for 'sm_90'\n\
               ptxas info    : Function properties for k1\n    \
               8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n\
               ptxas info    : Used 40 registers, used 1 barriers, 264 bytes smem\n\
               ptxas info    : Compiling entry function 'k2' for 'sm_90'\n\
               ptxas info    : Function properties for k2\n    \
               0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
               ptxas info    : Used 31 registers, used 0 barriers\n";
    let f = parse_ptxas(log);
    assert_eq!(f["k1"], Figures { regs: 40, smem: 264, stack: 8, spill_stores: 4, spill_loads: 12 });
    assert_eq!(f["k2"], Figures { regs: 31, ..Figures::default() });
}

#[test]
fn kernels_compile_for_three_archs_without_hot_spills() {
    let Some(dir) = wheels() else { return };
    preload_nvrtc(&dir);
    let src = program_source();
    let tmp = tempfile::tempdir().expect("temp dir");
    let ptxas = dir.join("bin/ptxas");
    let version = Command::new(&ptxas).arg("--version").output().expect("running ptxas --version");
    let version = String::from_utf8_lossy(&version.stdout).lines().last().unwrap_or_default().trim().to_string();

    let expected: BTreeSet<&str> = KERNELS.iter().map(|k| k.name).collect();
    let mut report = String::from(
        "# ptxas -v figures of every ds4 CUDA kernel (kernels-native/cuda), written by the compile check\n\
         # (cargo test -p ds4-kernels-native --test cuda_compile). Columns: arch, kernel, registers, shared\n\
         # memory bytes, stack frame bytes, spill store/load bytes, hot (a spill in a hot kernel fails the test).\n",
    );
    report.push_str(&format!("# {version}\n"));
    let mut failures = Vec::new();
    for (compute, sm) in ARCHS {
        let opts = cudarc::nvrtc::CompileOptions {
            arch: Some(compute),
            options: vec!["--std=c++17".into()],
            name: Some("ds4.cu".into()),
            ..Default::default()
        };
        let ptx = match cudarc::nvrtc::compile_ptx_with_opts(&src, opts) {
            Ok(p) => p,
            Err(e) => panic!("NVRTC failed for {compute}: {e:?}"),
        };
        let text = ptx.to_src();
        let path = tmp.path().join(format!("ds4_{sm}.ptx"));
        std::fs::write(&path, text.trim_end_matches('\0')).expect("writing PTX");
        let out = Command::new(&ptxas)
            .args([&format!("-arch={sm}"), "-v", "--warn-on-spills", "-o", "/dev/null"])
            .arg(&path)
            .output()
            .expect("running ptxas");
        let log = String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "ptxas failed for {sm}:\n{log}");
        let figs = parse_ptxas(&log);
        let got: BTreeSet<&str> = figs.keys().map(|s| s.as_str()).collect();
        assert_eq!(got, expected, "{sm}: ptxas's entry points differ from cuda_kernels::KERNELS");
        for k in KERNELS {
            let f = &figs[k.name];
            if k.hot && (f.spill_stores > 0 || f.spill_loads > 0) {
                failures
                    .push(format!("{sm} {}: spills {} / {} bytes (hot kernel)", k.name, f.spill_stores, f.spill_loads));
            }
            report.push_str(&format!(
                "{sm:<7} {:<26} regs {:>3}  smem {:>5}  stack {:>4}  spill {}/{}{}\n",
                k.name,
                f.regs,
                f.smem,
                f.stack,
                f.spill_stores,
                f.spill_loads,
                if k.hot { "  hot" } else { "" }
            ));
        }
    }
    assert!(failures.is_empty(), "register spills in hot kernels:\n{}", failures.join("\n"));

    let committed = Path::new(env!("CARGO_MANIFEST_DIR")).join("cuda/ptxas-report.txt");
    let old = std::fs::read_to_string(&committed).unwrap_or_default();
    if old != report {
        std::fs::write(&committed, &report).expect("writing cuda/ptxas-report.txt");
        assert!(!in_ci(), "cuda/ptxas-report.txt is out of date (rewritten here; commit it). Now:\n{report}");
        eprintln!("NOTE: rewrote {} with new ptxas figures; commit it", committed.display());
    }
}
