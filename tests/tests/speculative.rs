//! MTP and DSpark speculation on every backend: the drafter runs on the CPU, the target anywhere; on a wgpu target
//! (lavapipe in CI) greedy speculation gives the target's own plain greedy tokens and logits, and the drafter reads the
//! target's final streams (MTP) or tap features (DSpark) from the device. `ds4 generate --speculative mtp|dspark` gives
//! the ids of `--speculative off`, and names the missing drafter when the file has none.

use std::process::Command;

use ds4_engine::convert::{demo_config, random_model_gguf, DsparkConfig, Revision};
use ds4_engine::engine::{BackendKind, Engine, EngineOptions};
use ds4_engine::gguf::GgufFile;
use ds4_engine::sampler::{Sampler, SamplerConfig};
use ds4_engine::speculative::{Drafter, DsparkDrafter, DsparkOptions, MtpDrafter, MtpOptions};
use ds4_tests::{ds4_bin, wgpu_available};

#[test]
fn mtp_speculation_on_a_wgpu_target_is_lossless() {
    if !wgpu_available() {
        return;
    }
    let mut cfg = demo_config();
    cfg.n_nextn_layers = 1;
    let bytes = random_model_gguf(&cfg, 9, Vec::new()).unwrap();
    let opts = EngineOptions {
        backend: BackendKind::Wgpu,
        threads: 2,
        ctx: 256,
        max_batch_tokens: 64,
        ..EngineOptions::default()
    };
    let mut e = Engine::from_gguf(GgufFile::from_bytes(bytes).unwrap(), opts).unwrap();
    let prompt = [0u32, 17, 4242, 99, 1000, 5, 77, 31337, 12, 400, 401, 402, 9, 8, 7, 6, 5, 4];
    let s = e.create_session();
    let want = e.generate_greedy(s, &prompt, 24).unwrap();
    let want_logits = e.logits(s).unwrap().to_vec();
    let mut d = MtpDrafter::new(e.model(), MtpOptions { min_confidence: 0.0, threads: 2 }).unwrap().unwrap();
    let t = e.create_session();
    d.attach(&mut e, t).unwrap();
    e.feed(t, &prompt).unwrap();
    e.run_until_idle().unwrap();
    let mut sampler = Sampler::new(SamplerConfig::greedy()).unwrap();
    let (got, st) = e.generate_speculative(t, &mut sampler, &mut d, 3, 24).unwrap();
    assert_eq!(got, want);
    assert_eq!(e.logits(t).unwrap(), &want_logits[..]);
    assert!(st.cycles > 0 && st.drafted > 0, "{st:?}");
    assert_eq!(d.cold_positions, 0, "every input row came from the device");
}

/// A demo-shaped 0731 file with a DSpark drafter (3 target layers tapped, blocks of 4).
fn dspark_file_bytes(seed: u64) -> Vec<u8> {
    let mut cfg = demo_config();
    cfg.revision = Revision::V0731;
    cfg.dspark =
        Some(DsparkConfig { block_size: 4, noise_token_id: 7, target_layer_ids: vec![0, 1, 2], markov_rank: 8 });
    random_model_gguf(&cfg, seed, Vec::new()).unwrap()
}

#[test]
fn dspark_speculation_on_a_wgpu_target_is_lossless() {
    if !wgpu_available() {
        return;
    }
    let opts = EngineOptions {
        backend: BackendKind::Wgpu,
        threads: 2,
        ctx: 256,
        max_batch_tokens: 64,
        ..EngineOptions::default()
    };
    let mut e = Engine::from_gguf(GgufFile::from_bytes(dspark_file_bytes(5)).unwrap(), opts).unwrap();
    let prompt = [0u32, 17, 4242, 99, 1000, 5, 77, 31337, 12, 400, 401, 402, 9, 8, 7, 6, 5, 4];
    let s = e.create_session();
    let want = e.generate_greedy(s, &prompt, 12).unwrap();
    let want_logits = e.logits(s).unwrap().to_vec();
    let mut d = DsparkDrafter::new(e.model(), DsparkOptions { min_confidence: 0.0, threads: 2 }).unwrap().unwrap();
    let t = e.create_session();
    d.attach(&mut e, t).unwrap();
    e.feed(t, &prompt).unwrap();
    e.run_until_idle().unwrap();
    let mut sampler = Sampler::new(SamplerConfig::greedy()).unwrap();
    let (got, st) = e.generate_speculative(t, &mut sampler, &mut d, 4, 12).unwrap();
    assert_eq!(got, want);
    assert_eq!(e.logits(t).unwrap(), &want_logits[..]);
    assert!(st.cycles > 0 && st.drafted > 0, "{st:?}");
}

#[test]
fn ds4_generate_speculates_with_either_drafter_and_names_a_missing_one() {
    let dir = tempfile::tempdir().unwrap();
    let dspark = dir.path().join("dspark.gguf");
    std::fs::write(&dspark, dspark_file_bytes(11)).unwrap();
    let mut cfg = demo_config();
    cfg.n_nextn_layers = 1;
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
