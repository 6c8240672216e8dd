//! Helpers shared by the engine's integration tests.
#![allow(dead_code)]

/// Official per-layer tensor suffix (`layers.N.<x>`) → GGUF suffix (`blk.N.<y>`), written from
/// `shared/spec/gguf-ds4.md` independently of the converter's tables (the routed experts are stacked and mapped
/// separately).
pub const LAYER_NAMES: &[(&str, &str)] = &[
    ("hc_attn_fn", "hc_attn_fn.weight"),
    ("hc_attn_base", "hc_attn_base.weight"),
    ("hc_attn_scale", "hc_attn_scale.weight"),
    ("hc_ffn_fn", "hc_ffn_fn.weight"),
    ("hc_ffn_base", "hc_ffn_base.weight"),
    ("hc_ffn_scale", "hc_ffn_scale.weight"),
    ("attn_norm.weight", "attn_norm.weight"),
    ("attn.wq_a.weight", "attn_q_a.weight"),
    ("attn.q_norm.weight", "attn_q_a_norm.weight"),
    ("attn.wq_b.weight", "attn_q_b.weight"),
    ("attn.wkv.weight", "attn_kv.weight"),
    ("attn.kv_norm.weight", "attn_kv_a_norm.weight"),
    ("attn.attn_sink", "attn_sinks.weight"),
    ("attn.wo_a.weight", "attn_output_a.weight"),
    ("attn.wo_b.weight", "attn_output_b.weight"),
    ("attn.compressor.ape", "attn_compressor_ape.weight"),
    ("attn.compressor.wkv.weight", "attn_compressor_kv.weight"),
    ("attn.compressor.wgate.weight", "attn_compressor_gate.weight"),
    ("attn.compressor.norm.weight", "attn_compressor_norm.weight"),
    ("attn.indexer.wq_b.weight", "indexer.attn_q_b.weight"),
    ("attn.indexer.weights_proj.weight", "indexer.proj.weight"),
    ("attn.indexer.compressor.ape", "indexer_compressor_ape.weight"),
    ("attn.indexer.compressor.wkv.weight", "indexer_compressor_kv.weight"),
    ("attn.indexer.compressor.wgate.weight", "indexer_compressor_gate.weight"),
    ("attn.indexer.compressor.norm.weight", "indexer_compressor_norm.weight"),
    ("ffn_norm.weight", "ffn_norm.weight"),
    ("ffn.gate.weight", "ffn_gate_inp.weight"),
    ("ffn.gate.bias", "exp_probs_b.bias"),
    ("ffn.gate.tid2eid", "ffn_gate_tid2eid.weight"),
    ("ffn.shared_experts.w1.weight", "ffn_gate_shexp.weight"),
    ("ffn.shared_experts.w3.weight", "ffn_up_shexp.weight"),
    ("ffn.shared_experts.w2.weight", "ffn_down_shexp.weight"),
];

/// Exact sampling with speculation: tokens drawn with `d`'s drafts (verified by rejection sampling) have the
/// distribution plain sampling gives, on `e` after `prompt`, sampling at `(temperature, top_k)`. Two-sample
/// chi-square over the histograms of the second and third generated tokens (the ones verification decides) from
/// 3000 runs each, independent fixed seeds; bins with fewer than 10 draws in both runs merged. Bound: the 0.999
/// quantile of chi-square with `df` degrees of freedom (Wilson–Hilferty), so a correct implementation fails one run
/// in a thousand at most — and the seeds are fixed, so the result is repeatable. `accepted_bounds`: at least this
/// many drafts stood, and less than this share of them (both paths of the verification carry weight).
pub fn chi_square_check(
    mut e: ds4_engine::Engine,
    d: &mut dyn ds4_engine::speculative::Drafter,
    prompt: &[u32],
    sampling: (f32, usize),
    accepted_bounds: (usize, f64),
) {
    use ds4_engine::sampler::{Sampler, SamplerConfig};
    let cfg = |seed| SamplerConfig { temperature: sampling.0, top_k: sampling.1, seed, ..SamplerConfig::default() };
    let vocab = e.config().vocab;
    let runs = 3000;
    let mut plain = vec![vec![0usize; vocab]; 2];
    let mut spec = vec![vec![0usize; vocab]; 2];
    let base = e.create_session();
    e.feed(base, prompt).unwrap();
    e.run_until_idle().unwrap();
    for i in 0..runs {
        let s = e.fork(base).unwrap();
        let mut smp = Sampler::new(cfg(i as u64)).unwrap();
        let mut toks = Vec::new();
        for j in 0..3 {
            let t = smp.sample(e.logits(s).unwrap()).unwrap();
            smp.accept(t);
            toks.push(t);
            if j < 2 {
                e.feed(s, &[t]).unwrap();
                e.run_until_idle().unwrap();
            }
        }
        plain[0][toks[1] as usize] += 1;
        plain[1][toks[2] as usize] += 1;
        e.free_session(s).unwrap();
    }
    let (mut drafted, mut accepted) = (0, 0);
    for i in 0..runs {
        let s = e.create_session();
        d.attach(&mut e, s).unwrap();
        e.feed(s, prompt).unwrap();
        e.run_until_idle().unwrap();
        let mut smp = Sampler::new(cfg(1_000_000 + i as u64)).unwrap();
        let (toks, st) = e.generate_speculative(s, &mut smp, d, 2, 4).unwrap();
        drafted += st.drafted;
        accepted += st.accepted;
        spec[0][toks[1] as usize] += 1;
        spec[1][toks[2] as usize] += 1;
        d.detach(&mut e, s);
        e.free_session(s).unwrap();
    }
    assert!(drafted >= 2 * runs, "{drafted} drafts");
    assert!(
        accepted >= accepted_bounds.0 && (accepted as f64) < accepted_bounds.1 * drafted as f64,
        "drafts stood: {accepted}/{drafted}"
    );
    eprintln!("drafts stood: {accepted}/{drafted}");
    for pos in 0..2 {
        let (mut chi2, mut df, mut rest) = (0.0f64, 0usize, (0usize, 0usize));
        for (a, b) in plain[pos].iter().zip(&spec[pos]) {
            if a + b < 10 {
                rest = (rest.0 + a, rest.1 + b);
                continue;
            }
            chi2 += ((*a as f64) - (*b as f64)).powi(2) / (a + b) as f64;
            df += 1;
        }
        if rest.0 + rest.1 > 0 {
            chi2 += ((rest.0 as f64) - (rest.1 as f64)).powi(2) / (rest.0 + rest.1) as f64;
            df += 1;
        }
        let k = (df - 1) as f64;
        let z = 3.09; // the 0.999 normal quantile
        let bound = k * (1.0 - 2.0 / (9.0 * k) + z * (2.0 / (9.0 * k)).sqrt()).powi(3);
        eprintln!("token {}: chi2 {chi2:.1}, df {}, bound {bound:.1}", pos + 2, df - 1);
        assert!(df >= 5, "the histogram has enough bins ({df})");
        assert!(chi2 <= bound, "token {}: chi-square {chi2:.1} > {bound:.1} (df {})", pos + 2, df - 1);
    }
}
