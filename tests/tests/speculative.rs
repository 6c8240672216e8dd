//! MTP speculation on every backend: the drafter runs on the CPU, the target anywhere; on a wgpu target (lavapipe in
//! CI) greedy speculation gives the target's own plain greedy tokens and logits, and the drafter reads the target's
//! final streams from the device.

use ds4_engine::convert::{demo_config, random_model_gguf};
use ds4_engine::engine::{BackendKind, Engine, EngineOptions};
use ds4_engine::gguf::GgufFile;
use ds4_engine::sampler::{Sampler, SamplerConfig};
use ds4_engine::speculative::{Drafter, MtpDrafter, MtpOptions};
use ds4_tests::wgpu_available;

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
