//! `ds4-bench correctness`: the same prompt through each backend, compared pairwise: max |Δlogit| over every
//! prompt position, argmax agreement per position, and how many greedy-continuation tokens agree before the first
//! divergence. The run fails (non-zero exit) when a pair is beyond tolerance.
//!
//! Each backend gets its own engine on its own copy of the model (the same file, or the same synthetic spec and
//! seed, so the weights are identical). Pair verdict: `pass` when `max_abs_dlogit <= tol`, argmax agreement
//! `>= min_agree` and the leading `min_greedy` (default: all) greedy tokens agree.
//!
//! What to expect on quantized models (the [`TOLERANCES`] text, also the subcommand's `--help`): the CPU backend
//! quantizes activations to Q8_0/Q8_K for its integer dot products while the WGSL kernels multiply the quantized
//! weights by f32 activations. Per matrix that is a relative error of ~1e-4 rms (of Σ|w·x|) on the CPU against
//! ~1e-8 on the GPU (`engine/src/backend/wgpu/matmul.rs` accuracy tests); through the layers it becomes
//! 0.1–1.7 max |Δlogit| on the tiny models, more in the default FP8/FP4-simulation mode, whose rounding
//! amplifies small differences. `--f32-acts` gives the CPU f32 activations too: then cpu and wgpu compute the same
//! products and differ by f32 summation order only (measured ≤ 6e-6), so a quant-decoder bug cannot hide.

use std::io::Write;

use anyhow::{bail, Result};
use ds4_engine::engine::{argmax, Engine};

/// The tolerance guide printed under `ds4-bench correctness --help` (and summarised in the README).
pub const TOLERANCES: &str = "\
Tolerances (what cpu vs wgpu should meet; measured on lavapipe, tiny models, logit std ~1):
  f32/f16 models with --exact: max |Δlogit| <= 1e-3 (--tol 1e-3), every argmax and greedy token identical.
    Both backends use f32 activations; only the f32 summation order differs (measured 3e-6 on tiny-a).
  Quantized models (q8_0/q2/q4 recipes) with --f32-acts --exact: the same 1e-3, argmax and greedy identical
    (measured <= 4e-6). --f32-acts makes the CPU multiply quantized weights by f32 activations, as the WGSL
    kernels do (slower); it is the setting that checks the quant decoders.
  Quantized models without --f32-acts: NOT a kernel check. The CPU quantizes activations to Q8_0 (per 32
    values) or Q8_K (per 256) for its integer dots: ~1e-4 relative error per matrix (of sum |w*x|), which grows
    to 0.1-1.2 max |Δlogit| with --exact and 0.6-1.7 in the default simulation mode, where near-tie argmaxes,
    router/indexer choices and greedy tokens flip. Use --tol/--min-agree/--min-greedy accordingly.
  Without --exact, FP8/FP4 activation simulation rounds every step: a tiny difference can flip one rounding
    and grow (it did not on the tiny models: <= 6e-6 with --f32-acts), so use --exact for tight checks.";

/// The CSV header.
pub const CSV_HEADER: &str =
    "backend_a,backend_b,positions,max_abs_dlogit,argmax_agree,greedy_tokens,greedy_agree,pass";

/// Tolerances.
#[derive(Clone, Copy, Debug)]
pub struct Tolerance {
    /// Largest allowed |Δlogit|.
    pub max_abs: f32,
    /// Smallest allowed fraction of positions whose argmax agrees.
    pub min_agree: f64,
    /// Smallest number of leading greedy tokens that must agree (`None`: the whole continuation).
    pub min_greedy: Option<usize>,
}

/// One backend's outputs.
#[derive(Clone, Debug)]
pub struct Outputs {
    pub backend: String,
    /// `[positions, vocab]` logits of the prompt.
    pub logits: Vec<f32>,
    pub vocab: usize,
    /// Greedy continuation.
    pub greedy: Vec<u32>,
}

/// Runs `tokens` through `engine` (all positions' logits), then `gen` greedy tokens.
pub fn collect(engine: &mut Engine, backend: &str, tokens: &[u32], gen: usize) -> Result<Outputs> {
    if tokens.is_empty() {
        bail!("--tokens: give at least one token");
    }
    let s = engine.create_session();
    engine.set_prefill_logits(s, true)?;
    engine.feed(s, tokens)?;
    engine.run_until_idle()?;
    let logits = engine.take_all_logits(s)?;
    engine.set_prefill_logits(s, false)?;
    let greedy = engine.generate_greedy(s, &[], gen)?;
    engine.free_session(s)?;
    let vocab = engine.config().vocab;
    if logits.len() != tokens.len() * vocab {
        bail!("{backend}: {} logits for {} positions of vocab {vocab}", logits.len(), tokens.len());
    }
    Ok(Outputs { backend: backend.to_string(), logits, vocab, greedy })
}

/// One compared pair.
#[derive(Clone, Debug, PartialEq)]
pub struct Pair {
    pub a: String,
    pub b: String,
    pub positions: usize,
    pub max_abs: f32,
    pub argmax_agree: f64,
    pub greedy_tokens: usize,
    /// Leading greedy tokens that agree.
    pub greedy_agree: usize,
    pub pass: bool,
}

impl Pair {
    /// The CSV line matching [`CSV_HEADER`].
    pub fn csv(&self) -> String {
        format!(
            "{},{},{},{:.6},{:.4},{},{},{}",
            self.a,
            self.b,
            self.positions,
            self.max_abs,
            self.argmax_agree,
            self.greedy_tokens,
            self.greedy_agree,
            self.pass
        )
    }
}

/// Compares two backends' outputs.
pub fn compare(x: &Outputs, y: &Outputs, tol: Tolerance) -> Pair {
    let positions = x.logits.len() / x.vocab.max(1);
    let max_abs = x
        .logits
        .iter()
        .zip(&y.logits)
        .map(|(a, b)| if a.is_finite() && b.is_finite() { (a - b).abs() } else { f32::INFINITY })
        .fold(0f32, f32::max);
    let agree = x
        .logits
        .chunks_exact(x.vocab)
        .zip(y.logits.chunks_exact(y.vocab))
        .filter(|(a, b)| argmax(a) == argmax(b))
        .count();
    let argmax_agree = if positions == 0 { 1.0 } else { agree as f64 / positions as f64 };
    let greedy_agree = x.greedy.iter().zip(&y.greedy).take_while(|(a, b)| a == b).count();
    let same_shape = x.logits.len() == y.logits.len() && x.greedy.len() == y.greedy.len();
    let greedy_ok = greedy_agree >= tol.min_greedy.unwrap_or(x.greedy.len()).min(x.greedy.len());
    let pass = same_shape && max_abs <= tol.max_abs && argmax_agree >= tol.min_agree && greedy_ok;
    Pair {
        a: x.backend.clone(),
        b: y.backend.clone(),
        positions,
        max_abs,
        argmax_agree,
        greedy_tokens: x.greedy.len(),
        greedy_agree,
        pass,
    }
}

/// Compares every pair of `outs`, writing the CSV; returns the pairs.
pub fn report(outs: &[Outputs], tol: Tolerance, out: &mut dyn Write) -> Result<Vec<Pair>> {
    writeln!(out, "{CSV_HEADER}")?;
    let mut pairs = Vec::new();
    for i in 0..outs.len() {
        for j in i + 1..outs.len() {
            let p = compare(&outs[i], &outs[j], tol);
            writeln!(out, "{}", p.csv())?;
            pairs.push(p);
        }
    }
    Ok(pairs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outs(name: &str, logits: Vec<f32>, greedy: Vec<u32>) -> Outputs {
        Outputs { backend: name.into(), logits, vocab: 3, greedy }
    }

    const TOL: Tolerance = Tolerance { max_abs: 0.1, min_agree: 1.0, min_greedy: None };

    #[test]
    fn identical_outputs_pass() {
        let a = outs("cpu", vec![1.0, 2.0, 0.0, 3.0, 1.0, 0.0], vec![1, 2]);
        let p = compare(&a, &a.clone(), TOL);
        assert!(p.pass);
        assert_eq!((p.positions, p.max_abs, p.argmax_agree, p.greedy_agree), (2, 0.0, 1.0, 2));
    }

    #[test]
    fn differences_beyond_tolerance_fail() {
        let a = outs("a", vec![1.0, 2.0, 0.0, 3.0, 1.0, 0.0], vec![1, 2]);
        let small = outs("b", vec![1.05, 2.0, 0.0, 3.0, 1.0, 0.0], vec![1, 2]);
        assert!(compare(&a, &small, TOL).pass);
        let flipped = outs("b", vec![1.0, 2.0, 0.0, 3.0, 3.5, 0.0], vec![1, 2]);
        let p = compare(&a, &flipped, TOL);
        assert!(!p.pass);
        assert_eq!(p.argmax_agree, 0.5);
        assert!((p.max_abs - 2.5).abs() < 1e-6);
        let diverged = outs("b", a.logits.clone(), vec![1, 0]);
        let p = compare(&a, &diverged, TOL);
        assert!(!p.pass && p.greedy_agree == 1);
        // A relaxed greedy requirement accepts the divergence after the first token, not before it.
        assert!(compare(&a, &diverged, Tolerance { min_greedy: Some(1), ..TOL }).pass);
        let early = outs("b", a.logits.clone(), vec![0, 2]);
        assert!(!compare(&a, &early, Tolerance { min_greedy: Some(1), ..TOL }).pass);
        let nan = outs("b", vec![f32::NAN, 2.0, 0.0, 3.0, 1.0, 0.0], vec![1, 2]);
        assert!(!compare(&a, &nan, TOL).pass);
    }

    #[test]
    fn report_writes_every_pair() {
        let a = outs("x", vec![0.0; 3], vec![]);
        let mut out = Vec::new();
        let pairs = report(&[a.clone(), a.clone(), a], TOL, &mut out).unwrap();
        assert_eq!(pairs.len(), 3);
        assert_eq!(String::from_utf8(out).unwrap().lines().count(), 4);
    }

    #[test]
    fn the_cpu_backend_agrees_with_itself_across_thread_counts() {
        let spec = crate::synth::Spec::parse("tiny:layers=3:recipe=f16").unwrap();
        let mut o = Vec::new();
        for threads in [1, 2] {
            let file = crate::synth::build(&spec, 2, &indicatif::ProgressBar::hidden()).unwrap().file;
            let cfg = crate::engine_api::EngineConfig {
                threads,
                ctx: 64,
                batch_tokens: 5,
                backend: "cpu".into(),
                exact: false,
                placement: Default::default(),
            };
            let mut e = crate::engine_api::engine_for(file, &cfg).unwrap();
            let toks = crate::throughput::prompt(12, e.config().vocab);
            o.push(collect(&mut e, &format!("cpu{threads}"), &toks, 4).unwrap());
        }
        let p = compare(&o[0], &o[1], Tolerance { max_abs: 0.0, min_agree: 1.0, min_greedy: None });
        assert!(p.pass, "{p:?}");
        assert_eq!(p.positions, 12);
    }
}
