//! A minimal custom scheduler on the `Engine` library API: two sessions in one tick loop, each with its own
//! sampler, then a fork and an exact roll back.
//!
//! ```text
//! cargo run -p ds4-engine --example scheduler                            # the built-in demo model
//! cargo run -p ds4-engine --example scheduler -- ../shared/golden/tiny-a # an official-layout checkpoint (converted)
//! cargo run -p ds4-engine --example scheduler -- model.gguf
//! ```
//!
//! The loop is the whole contract: `feed` queues tokens, `step` runs one tick (decode rows first, then prefill
//! chunks up to `max_batch_tokens`), and a session whose queue is empty has the logits of its last position, ready
//! to sample. A scheduler decides who is fed what between ticks; the engine batches whatever is queued.

use std::error::Error;
use std::path::Path;

use ds4_engine::convert::{convert, demo_model_gguf, ConvertOptions, Recipe};
use ds4_engine::engine::{Engine, EngineOptions};
use ds4_engine::gguf::GgufFile;
use ds4_engine::sampler::{Sampler, SamplerConfig};
use ds4_engine::tables::SessionId;

type Res<T> = Result<T, Box<dyn Error>>;

/// One request the scheduler serves: a session, its sampler and how many tokens it still may generate.
struct Job {
    name: &'static str,
    session: SessionId,
    sampler: Sampler,
    left: usize,
    out: Vec<u32>,
}

fn open(arg: Option<String>) -> Res<Engine> {
    let opts = EngineOptions { threads: 2, ctx: 1024, max_batch_tokens: 64, ..EngineOptions::default() };
    let Some(arg) = arg else {
        return Ok(Engine::from_gguf(GgufFile::from_bytes(demo_model_gguf(1)?)?, opts)?);
    };
    let path = Path::new(&arg);
    if path.is_dir() {
        // An official-layout checkpoint folder (config.json + safetensors): convert it once to a GGUF file.
        let out = std::env::temp_dir().join(format!("ds4-example-{}.gguf", std::process::id()));
        convert(&ConvertOptions::new(path, &out, Recipe::F32))?;
        let engine = Engine::open(&out, opts);
        let _ = std::fs::remove_file(&out);
        return Ok(engine?);
    }
    Ok(Engine::open(path, opts)?)
}

/// Runs ticks until every job has generated its tokens; prints what each tick did.
fn run(engine: &mut Engine, jobs: &mut [Job]) -> Res<()> {
    let mut tick = 0;
    loop {
        // Between ticks: every job whose queue is empty samples its next token from its logits and is fed it.
        for j in jobs.iter_mut() {
            if j.left > 0 && engine.pending(j.session)? == 0 {
                let t = j.sampler.sample(engine.logits(j.session)?)?;
                j.sampler.accept(t);
                j.out.push(t);
                j.left -= 1;
                if j.left > 0 {
                    engine.feed(j.session, &[t])?;
                }
            }
        }
        let queued: Vec<String> = jobs
            .iter()
            .filter_map(|j| engine.pending(j.session).ok().filter(|&n| n > 0).map(|n| format!("{} {n}", j.name)))
            .collect();
        if !engine.step()? {
            return Ok(());
        }
        tick += 1;
        println!("tick {tick:2}: queued before it: {}", queued.join(", "));
    }
}

fn main() -> Res<()> {
    let mut engine = open(std::env::args().nth(1))?;
    let vocab = engine.config().vocab as u32;
    let prompt_a: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % vocab).collect();
    let prompt_b: Vec<u32> = (0..90).map(|i| (i * 13 + 5) % vocab).collect();

    // Two sessions: A decodes greedily, B samples at temperature 0.8; B's longer prompt is prefilled in chunks
    // while A already decodes (decode rows go first in every tick).
    let a = engine.create_session();
    let b = engine.create_session();
    engine.feed(a, &prompt_a)?;
    engine.feed(b, &prompt_b)?;
    let sampled = SamplerConfig { temperature: 0.8, top_p: 0.95, seed: 7, ..SamplerConfig::default() };
    let mut jobs = vec![
        Job { name: "A", session: a, sampler: Sampler::new(SamplerConfig::greedy())?, left: 8, out: vec![] },
        Job { name: "B", session: b, sampler: Sampler::new(sampled.clone())?, left: 8, out: vec![] },
    ];
    run(&mut engine, &mut jobs)?;
    for j in &jobs {
        println!("{}: {:?}", j.name, j.out);
    }
    let first_a = jobs[0].out.clone();

    // A fork shares A's KV pages and copies only its private tail; the copy continues on its own.
    let c = engine.fork(a)?;
    engine.feed(c, &[first_a[first_a.len() - 1]])?;
    let mut forked = vec![Job { name: "C", session: c, sampler: Sampler::new(sampled)?, left: 4, out: vec![] }];
    engine.run_until_idle()?;
    run(&mut engine, &mut forked)?;
    println!("C (fork of A): {:?}; {} KV bytes copied by forks so far", forked[0].out, engine.kv_bytes_copied());

    // Roll A back to its prompt minus one token, exactly (no recompute), then re-feed that token: greedy decoding
    // must produce the same tokens as the first time.
    let len = prompt_a.len() - 1;
    println!("A: position {}, can roll back to {}", engine.position(a)?, engine.rollback_floor(a)?);
    engine.rollback(a, len)?;
    engine.feed(a, &prompt_a[len..])?;
    let mut again =
        vec![Job { name: "A", session: a, sampler: Sampler::new(SamplerConfig::greedy())?, left: 8, out: vec![] }];
    run(&mut engine, &mut again)?;
    println!("A after roll back: {:?}", again[0].out);
    if again[0].out != first_a {
        return Err(format!("roll back changed greedy decoding: {first_a:?} then {:?}", again[0].out).into());
    }
    for s in [a, b, c] {
        engine.free_session(s)?;
    }
    println!("ok: two sessions, one tick loop, a fork and an exact roll back");
    Ok(())
}
