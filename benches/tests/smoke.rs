//! Smoke tests of every `ds4-bench` subcommand on tiny sizes (`--quick`): they run the real binary and check the
//! shape of its report (machine summary, CSV header, every field parses). No timing is asserted.

use std::process::Command;

fn run(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_ds4-bench")).args(args).output().expect("run ds4-bench");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "ds4-bench {args:?} failed: {stderr}");
    String::from_utf8(out.stdout).expect("utf-8 report")
}

/// Splits a report into its `#` summary lines and CSV lines; checks the summary names cpu, cores, simd, backend.
fn split(report: &str) -> (Vec<&str>, Vec<&str>) {
    let (comments, csv): (Vec<&str>, Vec<&str>) = report.lines().partition(|l| l.starts_with('#'));
    for key in ["# cpu: ", "# cores: ", "# simd: ", "# backend: "] {
        assert!(comments.iter().any(|l| l.starts_with(key)), "summary lacks {key:?}:\n{report}");
    }
    (comments, csv)
}

/// Parses CSV rows against the expected header; returns rows as field vectors.
fn rows<'a>(csv: &[&'a str], header: &str) -> Vec<Vec<&'a str>> {
    assert_eq!(csv.first().copied(), Some(header));
    let n = header.split(',').count();
    let rows: Vec<Vec<&str>> = csv[1..].iter().map(|l| l.split(',').collect()).collect();
    for r in &rows {
        assert_eq!(r.len(), n, "{r:?}");
    }
    rows
}

fn num(s: &str) -> f64 {
    s.parse::<f64>().unwrap_or_else(|_| panic!("{s:?} is not a number"))
}

#[test]
fn kernels_quick() {
    let report = run(&["kernels", "--quick", "--quiet", "--types", "q8_0,iq2_xxs"]);
    let (_, csv) = split(&report);
    let header =
        "case,type,rows,cols,matrices,bytes,threads,kernel,batch,weights_gbs,gflops,mem_gbs,fraction,target,verdict";
    let rows = rows(&csv, header);
    // Default shapes: iq2_xxs expert.gate_up, q8_0 attn.q_b and attn.out_b; matvec, engine-matvec, matmul,
    // engine-matmul each.
    assert_eq!(rows.len(), 12, "{report}");
    for kernel in ["matvec", "engine-matvec", "matmul", "engine-matmul"] {
        assert_eq!(rows.iter().filter(|r| r[7] == kernel).count(), 3, "{kernel}: {report}");
    }
    for r in &rows {
        assert!(["q8_0", "iq2_xxs"].contains(&r[1]), "{r:?}");
        assert!(["matvec", "engine-matvec", "matmul", "engine-matmul"].contains(&r[7]));
        for i in [2, 3, 4, 5, 6, 8] {
            assert!(num(r[i]) >= 1.0, "{r:?}");
        }
        for i in [9, 10, 11, 12] {
            assert!(num(r[i]) > 0.0, "{r:?}");
        }
        assert!(["ok", "short", "-"].contains(&r[14]));
    }
}

#[test]
fn kernels_rejects_unknown_type() {
    let out = Command::new(env!("CARGO_BIN_EXE_ds4-bench"))
        .args(["kernels", "--quick", "--quiet", "--types", "q5_k"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("q5_k"));
}

#[test]
fn membw_quick() {
    let report = run(&["membw", "--quick", "--quiet", "--threads", "2"]);
    let (_, csv) = split(&report);
    let rows = rows(&csv, "bytes,threads,passes,gbs");
    assert_eq!(rows.len(), 4);
    for r in rows {
        assert!(num(r[0]) >= (1 << 20) as f64 && num(r[3]) > 0.0);
    }
}

fn check_throughput(report: &str, frontiers: &[u64], gen_tokens: u64) {
    let (comments, csv) = split(report);
    assert!(comments.iter().any(|l| l.starts_with("# decode roofline: ")), "{report}");
    assert!(comments.iter().any(|l| l.starts_with("# memory bandwidth: ")), "{report}");
    let rows = rows(&csv, "ctx_tokens,prefill_tokens,prefill_tps,gen_tokens,gen_tps,kvcache_bytes");
    assert_eq!(rows.len(), frontiers.len(), "{report}");
    let mut prev = 0u64;
    for (r, &f) in rows.iter().zip(frontiers) {
        assert_eq!(r[0].parse::<u64>().unwrap(), f);
        assert_eq!(r[1].parse::<u64>().unwrap(), f - prev);
        assert_eq!(r[3].parse::<u64>().unwrap(), gen_tokens);
        assert!(num(r[2]) > 0.0 && num(r[4]) > 0.0);
        assert!(r[5].parse::<u64>().unwrap() > 0);
        prev = f;
    }
}

#[test]
fn throughput_quick_on_a_tiny_synthetic_model() {
    let report = run(&["--synthetic", "tiny:recipe=f16", "--quick", "--quiet"]);
    check_throughput(&report, &[8, 16], 2);
}

#[test]
fn throughput_with_concurrent_sessions() {
    let one = run(&["--synthetic", "tiny:recipe=f16", "--quick", "--quiet", "--sessions", "1"]);
    let three = run(&["--synthetic", "tiny:recipe=f16", "--quick", "--quiet", "--sessions", "3"]);
    check_throughput(&three, &[8, 16], 2);
    assert!(three.contains("aggregate over 3 concurrent sessions"));
    // kvcache_bytes is summed over the decoding sessions.
    let kv = |r: &str| -> Vec<u64> {
        r.lines()
            .filter(|l| !l.starts_with('#'))
            .skip(1)
            .map(|l| l.rsplit(',').next().unwrap().parse().unwrap())
            .collect()
    };
    let (k1, k3) = (kv(&one), kv(&three));
    assert_eq!(k1.iter().map(|k| k * 3).collect::<Vec<_>>(), k3);
}

#[test]
fn throughput_needs_a_model_and_valid_specs() {
    for args in [
        vec!["--quick", "--quiet"],
        vec!["--synthetic", "llama", "--quick", "--quiet"],
        vec!["--synthetic", "tiny", "--ctx-start", "64", "--ctx-max", "32", "--quiet"],
        vec!["-m", "/nonexistent/model.gguf", "--quick", "--quiet"],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_ds4-bench")).args(&args).output().unwrap();
        assert!(!out.status.success(), "{args:?} succeeded");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.starts_with("ds4-bench: "), "{args:?}: {err}");
    }
}

#[test]
fn kv_quick() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_str().unwrap();
    let report = run(&["kv", "--quick", "--quiet", "--dir", dir]);
    let (comments, csv) = split(&report);
    assert!(comments.iter().any(|l| l.starts_with("# store: ")), "{report}");
    let header =
        "prefix_tokens,kv_file_bytes,recompute_s,restore_s,speedup,cache_write_gbs,raw_write_gbs,write_fraction,exact";
    let rows = rows(&csv, header);
    assert_eq!(rows.iter().map(|r| r[0]).collect::<Vec<_>>(), vec!["5", "16", "27"]);
    for r in &rows {
        assert!(r[1].parse::<u64>().unwrap() > 0);
        for i in 2..8 {
            assert!(num(r[i]) >= 0.0, "{r:?}");
        }
        assert_eq!(r[8], "true", "restore must be exact: {r:?}");
    }
}

#[test]
fn correctness_quick_cpu_pair() {
    let report = run(&["correctness", "--quick", "--quiet", "--backends", "cpu,cpu"]);
    let (_, csv) = split(&report);
    let rows = rows(&csv, "backend_a,backend_b,positions,max_abs_dlogit,argmax_agree,greedy_tokens,greedy_agree,pass");
    assert_eq!(rows.len(), 1);
    let r = &rows[0];
    assert_eq!((r[0], r[1], r[2]), ("cpu", "cpu", "16"));
    assert_eq!(num(r[3]), 0.0, "the CPU backend is deterministic");
    assert_eq!((num(r[4]), r[7]), (1.0, "true"));
}

#[test]
fn correctness_exits_non_zero_beyond_tolerance() {
    // A negative tolerance cannot be met: the run must report the pair and fail.
    let out = Command::new(env!("CARGO_BIN_EXE_ds4-bench"))
        .args(["correctness", "--quick", "--quiet", "--backends", "cpu,cpu", "--tol=-1"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("cpu,cpu,16,"));
    assert!(String::from_utf8_lossy(&out.stderr).contains("beyond tolerance"));
    let out = Command::new(env!("CARGO_BIN_EXE_ds4-bench"))
        .args(["correctness", "--quick", "--quiet", "--backends", "cpu"])
        .output()
        .unwrap();
    assert!(!out.status.success());
}

#[test]
fn mask_quick_with_a_decode_tick() {
    let report = run(&["mask", "--quick", "--quiet", "--synthetic", "tiny:recipe=f16"]);
    let (comments, csv) = split(&report);
    let header =
        "grammar,tokens,restarts,mask_mean_us,mask_p50_us,mask_p99_us,mask_max_us,consume_mean_us,consume_p99_us";
    let rows = rows(&csv, header);
    let names: Vec<&str> = rows.iter().map(|r| r[0]).collect();
    assert_eq!(names, ["json_schema", "lark_patch", "regex"], "{report}");
    for r in &rows {
        assert_eq!(r[1], "50");
        let (mean, p50, p99, max) = (num(r[3]), num(r[4]), num(r[5]), num(r[6]));
        assert!(mean > 0.0 && p50 <= p99 && p99 <= max, "{r:?}");
    }
    assert!(comments.iter().any(|l| l.starts_with("# decode tick (one session")), "{report}");
    for name in names {
        assert!(comments.iter().any(|l| l.starts_with(&format!("# {name}: mask mean "))), "{report}");
    }
}
