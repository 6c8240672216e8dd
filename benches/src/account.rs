//! Device accounting (`ds4-bench --backend wgpu`): what one prefill chunk and one decode tick cost a device
//! backend in dispatches, host syncs, bytes across the bus and weight bytes fetched against the least possible
//! (each weight row a product touches read once). Counted by the backend, not timed, so the figures are the same
//! on lavapipe as on a GPU.

use anyhow::Result;
use ds4_engine::backend::device::DeviceCounters;
use ds4_engine::Engine;

/// One measured tick.
#[derive(Clone, Debug)]
pub struct DeviceTick {
    /// Tokens (rows) in the tick.
    pub tokens: usize,
    pub cost: DeviceCounters,
    /// GPU seconds per kernel (`kernel`, seconds, dispatches; largest first) where the device has timestamp
    /// queries (of the next tick, timed apart: timing changes the pass count).
    pub kernels: Option<Vec<(String, f64, usize)>>,
}

/// The measured ticks of [`prefill_and_decode`].
pub struct Ticks {
    pub prefill: DeviceTick,
    /// A steady decode tick that reads back the whole logits row.
    pub decode_whole: DeviceTick,
    /// A steady decode tick of a greedy sampler, which reads back only the best logit
    /// (`Engine::set_logit_candidates`): what a decode loop costs.
    pub decode: DeviceTick,
}

/// Runs a fresh session's prefill of `chunk` tokens as one tick, then decode ticks, on a warmed engine (weights
/// already uploaded, so the uploads counted are the ticks' own): two reading back whole logits rows, then (the
/// session asking for one candidate, as a greedy sampler does) three reading back the best logit only; the last
/// of each is reported (one of a steady decode loop). `None` on a host backend.
pub fn prefill_and_decode(engine: &mut Engine, chunk: usize) -> Result<Option<Ticks>> {
    let Some(_) = engine.device_counters() else { return Ok(None) };
    let chunk = chunk.min(engine.options().max_batch_tokens).min(engine.ctx().saturating_sub(7)).max(1);
    let prompt = crate::throughput::prompt(chunk + 6, engine.config().vocab);
    let s = engine.create_session();
    let run = |engine: &mut Engine| -> Result<Ticks> {
        // Counted untimed (a timed dispatch is a compute pass of its own); `timed` ticks only read GPU times.
        let tick = |engine: &mut Engine, tokens: &[u32], timed: bool| -> Result<DeviceTick> {
            engine.feed(s, tokens)?;
            let timed = timed && engine.start_kernel_timing();
            let before = engine.device_counters().unwrap_or_default();
            engine.step()?;
            let after = engine.device_counters().unwrap_or_default();
            let times = engine.kernel_times()?.filter(|_| timed);
            let kernels = times.map(|t| ds4_engine::backend::wgpu::timing::by_label(&t));
            Ok(DeviceTick { tokens: tokens.len(), cost: after - before, kernels })
        };
        let prefill = tick(engine, &prompt[..chunk], false)?;
        tick(engine, &prompt[chunk..chunk + 1], false)?;
        let decode_whole = tick(engine, &prompt[chunk + 1..chunk + 2], false)?;
        engine.set_logit_candidates(s, 1)?;
        // Two warm-up ticks: the first makes the candidates' buffer, which drops the bind groups made before it.
        tick(engine, &prompt[chunk + 2..chunk + 3], false)?;
        tick(engine, &prompt[chunk + 3..chunk + 4], false)?;
        let mut decode = tick(engine, &prompt[chunk + 4..chunk + 5], false)?;
        decode.kernels = tick(engine, &prompt[chunk + 5..chunk + 6], true)?.kernels;
        Ok(Ticks { prefill, decode_whole, decode })
    };
    let ticks = run(engine);
    engine.free_session(s)?;
    Ok(Some(ticks?))
}

/// The `#` line of a tick's GPU time by kernel (the `top` largest), or why there is none.
pub fn kernel_line(what: &str, t: &DeviceTick, top: usize) -> String {
    let Some(k) = &t.kernels else {
        return format!("# device {what}: no GPU times (the adapter has no timestamp queries)");
    };
    let total: f64 = k.iter().map(|x| x.1).sum();
    let n: usize = k.iter().map(|x| x.2).sum();
    let each: Vec<String> = k.iter().take(top).map(|(name, s, c)| format!("{name} {:.1} us ({c})", s * 1e6)).collect();
    format!(
        "# device {what}: {:.1} us of GPU time over {n} timed dispatches; by kernel: {}",
        total * 1e6,
        each.join(", ")
    )
}

/// The `#` line comparing a greedy decode tick's readback (the best logit) with a whole-row tick's, side by side.
pub fn readback_line(t: &Ticks) -> String {
    let (c, w) = (&t.decode.cost, &t.decode_whole.cost);
    format!(
        "# device decode tick readback: {} B (the sampled row's best logit: id and value) vs {} B reading back the \
         whole logits row ({:.0}x less); {} vs {} dispatches",
        c.device_to_host,
        w.device_to_host,
        w.device_to_host as f64 / c.device_to_host.max(1) as f64,
        c.dispatches,
        w.dispatches
    )
}

/// The `#` line of one measured tick.
pub fn line(what: &str, t: &DeviceTick, layers: usize) -> String {
    let c = &t.cost;
    let mb = |b: u64| b as f64 / 1e6;
    format!(
        "# device {what} ({} tokens): {} dispatches ({:.1} per layer; {} of them copies and clears, so {:.1} compute \
         kernels per layer; {} over further chunks of weights split at this adapter's binding limit), {} compute \
         passes, {} bind groups, {} submissions, {} readbacks; \
         host to device {:.1} KB, device to host {} B; weights fetched {:.2} MB = {:.2}x the least ({:.2} MB, \
         each weight row once)",
        t.tokens,
        c.dispatches,
        c.dispatches as f64 / layers.max(1) as f64,
        c.copy_kernels,
        (c.dispatches - c.copy_kernels) as f64 / layers.max(1) as f64,
        c.split_dispatches,
        c.passes,
        c.bind_groups,
        c.submits,
        c.readbacks,
        c.host_to_device as f64 / 1e3,
        c.device_to_host,
        mb(c.weights_fetched),
        c.weights_fetched as f64 / c.weights_min.max(1) as f64,
        mb(c.weights_min)
    )
}
