//! Cross-backend check on the library API: the same tokens through the CPU and the wgpu backend, in the
//! golden-comparison mode (`exact`, f32 activations), every position's logits compared.
//!
//! ```text
//! cargo run -p ds4-engine --example cross_backend                            # the built-in demo model
//! cargo run -p ds4-engine --example cross_backend -- ../shared/golden/tiny-a # an official-layout checkpoint
//! cargo run -p ds4-engine --example cross_backend -- model.gguf
//! ```
//!
//! Exits non-zero when the backends differ by more than 1e-3 in any logit or disagree on any position's argmax,
//! or when no wgpu adapter is available (a check that cannot run is a failure, not a pass). `ds4-bench
//! correctness` is the full runner (greedy continuation, tolerances per mode); this shows what it is built on.

use std::error::Error;
use std::path::{Path, PathBuf};

use ds4_engine::convert::{convert, demo_model_gguf, ConvertOptions, Recipe};
use ds4_engine::engine::{argmax, BackendKind, Engine, EngineOptions};

type Res<T> = Result<T, Box<dyn Error>>;

const TOL: f32 = 1e-3;

/// The model as a GGUF file (the demo model or a converted checkpoint go to a temporary file).
fn model_file(arg: Option<String>) -> Res<(PathBuf, bool)> {
    let tmp = std::env::temp_dir().join(format!("ds4-cross-{}.gguf", std::process::id()));
    match arg {
        None => {
            std::fs::write(&tmp, demo_model_gguf(1)?)?;
            Ok((tmp, true))
        }
        Some(a) if Path::new(&a).is_dir() => {
            convert(&ConvertOptions::new(&a, &tmp, Recipe::F32))?;
            Ok((tmp, true))
        }
        Some(a) => Ok((PathBuf::from(a), false)),
    }
}

/// Logits of every position of `tokens` (`[n, vocab]`) on `backend`.
fn all_logits(path: &Path, backend: BackendKind, tokens: &[u32]) -> Res<Vec<f32>> {
    let opts = EngineOptions {
        backend,
        exact: true,
        f32_acts: true,
        threads: 2,
        ctx: 256,
        max_batch_tokens: 16,
        ..EngineOptions::default()
    };
    let mut e = Engine::open(path, opts)?;
    let s = e.create_session();
    e.set_prefill_logits(s, true)?;
    e.feed(s, tokens)?;
    e.run_until_idle()?;
    Ok(e.take_all_logits(s)?)
}

fn main() -> Res<()> {
    let (path, temporary) = model_file(std::env::args().nth(1))?;
    let result = check(&path);
    if temporary {
        let _ = std::fs::remove_file(&path);
    }
    result
}

fn check(path: &Path) -> Res<()> {
    let vocab = ds4_engine::gguf::GgufFile::open(path)?;
    let vocab = ds4_engine::model::ModelConfig::from_gguf(&vocab)?.vocab;
    let tokens: Vec<u32> = (0..40u32).map(|i| (i * 11 + 1) % vocab as u32).collect();
    let cpu = all_logits(path, BackendKind::Cpu, &tokens)?;
    let gpu = all_logits(path, BackendKind::Wgpu, &tokens)
        .map_err(|e| format!("the wgpu backend could not run ({e}); no cross-backend check"))?;
    if cpu.len() != gpu.len() || cpu.len() != tokens.len() * vocab {
        return Err(format!("logit counts differ: cpu {}, wgpu {}", cpu.len(), gpu.len()).into());
    }
    let (mut worst, mut argmax_same) = (0f32, 0);
    for (c, g) in cpu.chunks(vocab).zip(gpu.chunks(vocab)) {
        worst = c.iter().zip(g).map(|(x, y)| (x - y).abs()).fold(worst, f32::max);
        argmax_same += usize::from(argmax(c) == argmax(g));
    }
    println!("{} positions: max |Δlogit| {worst:.2e}, argmax agrees on {argmax_same}", tokens.len());
    if worst > TOL || argmax_same != tokens.len() {
        return Err(format!("cpu and wgpu differ beyond {TOL} (or in an argmax)").into());
    }
    println!("ok: cpu and wgpu agree within {TOL}");
    Ok(())
}
