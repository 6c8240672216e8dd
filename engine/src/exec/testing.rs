//! Test helpers shared by the backends' executor tests: the demo model and a driver that runs a prefill and
//! decode ticks of one session through the recipe and the executor.

use crate::backend::{Activations, Backend, RopeSet, StepCtx};
use crate::exec::Executor;
use crate::gguf::GgufFile;
use crate::graph::{Batch, Graph};
use crate::model::Model;
use crate::tables::SessionKv;

/// The demo model (seed 7).
pub fn demo() -> Model {
    Model::load(GgufFile::from_bytes(crate::convert::demo::demo_model_gguf(7).unwrap()).unwrap()).unwrap()
}

fn tok(i: usize, vocab: usize) -> u32 {
    ((i as u32).wrapping_mul(2654435761) >> 5) % vocab as u32
}

/// A prefill of `n` tokens then `decode` one-token ticks of one session, each tick built by the recipe and run by
/// `ex` on `be` (with `fallback`); `each(graph, executor)` sees every tick after it ran. Returns every tick's
/// logits.
pub fn ticks(
    model: &Model,
    be: &dyn Backend,
    fallback: Option<&dyn Backend>,
    ex: &mut Executor,
    n: usize,
    decode: usize,
    mut each: impl FnMut(&Graph, &mut Executor),
) -> crate::Result<Vec<Vec<f32>>> {
    let rope = RopeSet::new(model);
    let vocab = model.config.vocab;
    let mut kv = vec![SessionKv::new(&model.config, 64)];
    let mut g = Graph::default();
    let mut out = Vec::new();
    for t in 0..=decode {
        let mut batch = Batch::default();
        if t == 0 {
            batch.push_run(0, 0, (0..n).map(|i| tok(i, vocab)), true);
        } else {
            batch.push_run(0, n + t - 1, [tok(100 + t, vocab)], false);
        }
        let mut act = Activations::default();
        act.ensure(model, batch.rows.len(), batch.logit_rows.len());
        crate::model::recipe::build(&mut g, model, &batch, true);
        let mut cx = StepCtx { model, rope: &rope, batch: &batch, kv: &mut kv, act: &mut act, sim: true };
        ex.run_on(&g, be, fallback, &mut cx)?;
        each(&g, ex);
        out.push(act.logits[..batch.logit_rows.len() * vocab].to_vec());
    }
    Ok(out)
}
