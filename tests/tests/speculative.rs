//! MTP and DSpark speculation on every backend: the drafter runs on the CPU, the target anywhere; on a wgpu target
//! (lavapipe in CI) greedy speculation gives the target's own plain greedy tokens and logits, and the drafter reads the
//! target's final streams (MTP) or tap features (DSpark) from the device. `ds4 generate --speculative mtp|dspark` gives
//! the ids of `--speculative off`, and names the missing drafter when the file has none.

use std::process::Command;

use ds4_engine::convert::{demo_config, demo_dspark_config, random_model_gguf, CheckpointConfig};
use ds4_engine::engine::{BackendKind, Engine, EngineOptions};
use ds4_engine::gguf::GgufFile;
use ds4_engine::sampler::{Sampler, SamplerConfig};
use ds4_engine::speculative::{Drafter, DsparkDrafter, DsparkOptions, MtpDrafter, MtpOptions};
use ds4_tests::{ds4_bin, wgpu_available};

const PROMPT: [u32; 18] = [0, 17, 4242, 99, 1000, 5, 77, 31337, 12, 400, 401, 402, 9, 8, 7, 6, 5, 4];

/// A wgpu engine on `bytes` (`None` without a usable adapter).
fn wgpu_engine(bytes: Vec<u8>) -> Option<Engine> {
    if !wgpu_available() {
        return None;
    }
    let opts = EngineOptions {
        backend: BackendKind::Wgpu,
        threads: 2,
        ctx: 256,
        max_batch_tokens: 64,
        ..EngineOptions::default()
    };
    Some(Engine::from_gguf(GgufFile::from_bytes(bytes).unwrap(), opts).unwrap())
}

/// Greedy speculation with `d` (drafts of `k`) on `e` gives `n` plain greedy tokens and the plain final logits.
fn assert_lossless(e: &mut Engine, d: &mut dyn Drafter, k: usize, n: usize) {
    let s = e.create_session();
    let want = e.generate_greedy(s, &PROMPT, n).unwrap();
    let want_logits = e.logits(s).unwrap().to_vec();
    let t = e.create_session();
    d.attach(e, t).unwrap();
    e.feed(t, &PROMPT).unwrap();
    e.run_until_idle().unwrap();
    let mut sampler = Sampler::new(SamplerConfig::greedy()).unwrap();
    let (got, st) = e.generate_speculative(t, &mut sampler, d, k, n).unwrap();
    assert_eq!(got, want);
    assert_eq!(e.logits(t).unwrap(), &want_logits[..]);
    assert!(st.cycles > 0 && st.drafted > 0, "{st:?}");
}

#[test]
fn mtp_speculation_on_a_wgpu_target_is_lossless() {
    let cfg = CheckpointConfig { n_nextn_layers: 1, ..demo_config() };
    let Some(mut e) = wgpu_engine(random_model_gguf(&cfg, 9, Vec::new()).unwrap()) else { return };
    let mut d = MtpDrafter::new(e.model(), MtpOptions { min_confidence: 0.0, threads: 2 }).unwrap().unwrap();
    assert_lossless(&mut e, &mut d, 3, 24);
    assert_eq!(d.cold_positions, 0, "every input row came from the device");
}

/// A demo-shaped 0731 file with a DSpark drafter (3 target layers tapped, blocks of 4).
fn dspark_file_bytes(seed: u64) -> Vec<u8> {
    random_model_gguf(&demo_dspark_config(), seed, Vec::new()).unwrap()
}

#[test]
fn dspark_speculation_on_a_wgpu_target_is_lossless() {
    let Some(mut e) = wgpu_engine(dspark_file_bytes(5)) else { return };
    let mut d = DsparkDrafter::new(e.model(), DsparkOptions { min_confidence: 0.0, threads: 2 }).unwrap().unwrap();
    assert_lossless(&mut e, &mut d, 4, 12);
}

#[test]
fn ds4_generate_speculates_with_either_drafter_and_names_a_missing_one() {
    let dir = tempfile::tempdir().unwrap();
    let dspark = dir.path().join("dspark.gguf");
    std::fs::write(&dspark, dspark_file_bytes(11)).unwrap();
    let cfg = CheckpointConfig { n_nextn_layers: 1, ..demo_config() };
    let mtp = dir.path().join("mtp.gguf");
    std::fs::write(&mtp, random_model_gguf(&cfg, 12, Vec::new()).unwrap()).unwrap();
    let generate = |file: &std::path::Path, mode: &str| {
        Command::new(ds4_bin())
            .args(["generate", "-m"])
            .arg(file)
            .args(["--tokens", "0,17,4242,99,1000,5,77", "-n", "12", "--temperature", "0", "--threads", "2"])
            .args(["--speculative", mode])
            .output()
            .unwrap()
    };
    for (file, mode, missing) in [(&dspark, "dspark", "mtp"), (&mtp, "mtp", "dspark")] {
        let plain = generate(file, "off");
        assert!(plain.status.success(), "{}", String::from_utf8_lossy(&plain.stderr));
        for m in [mode, "auto"] {
            let spec = generate(file, m);
            assert!(spec.status.success(), "--speculative {m}: {}", String::from_utf8_lossy(&spec.stderr));
            assert_eq!(spec.stdout, plain.stdout, "--speculative {m} on {file:?} changed the ids");
            assert!(!spec.stdout.is_empty());
        }
        let none = generate(file, missing);
        assert!(!none.status.success(), "--speculative {missing} on a file without that drafter must fail");
        let err = String::from_utf8_lossy(&none.stderr).to_lowercase();
        assert!(err.contains(missing), "the error names the missing drafter: {err}");
    }
}
