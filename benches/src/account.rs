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
    /// queries.
    pub kernels: Option<Vec<(String, f64, usize)>>,
}

/// Runs a fresh session's prefill of `chunk` tokens as one tick, then two decode ticks, on a warmed engine
/// (weights already uploaded, so the uploads counted are the ticks' own), and returns `[prefill, decode]` with the
/// second decode tick (one of a steady decode loop); `None` on a host backend.
pub fn prefill_and_decode(engine: &mut Engine, chunk: usize) -> Result<Option<[DeviceTick; 2]>> {
    let Some(_) = engine.device_counters() else { return Ok(None) };
    let chunk = chunk.min(engine.options().max_batch_tokens).min(engine.ctx().saturating_sub(3)).max(1);
    let prompt = crate::throughput::prompt(chunk + 2, engine.config().vocab);
    let s = engine.create_session();
    let mut tick = |tokens: &[u32]| -> Result<DeviceTick> {
        engine.feed(s, tokens)?;
        let timed = engine.start_kernel_timing();
        let before = engine.device_counters().unwrap_or_default();
        engine.step()?;
        let after = engine.device_counters().unwrap_or_default();
        let times = engine.kernel_times()?.filter(|_| timed);
        let kernels = times.map(|t| ds4_engine::backend::wgpu::timing::by_label(&t));
        Ok(DeviceTick { tokens: tokens.len(), cost: after - before, kernels })
    };
    let prefill = tick(&prompt[..chunk]);
    let warm = prefill.is_ok().then(|| tick(&prompt[chunk..chunk + 1]));
    let decode = matches!(warm, Some(Ok(_))).then(|| tick(&prompt[chunk + 1..]));
    if let Some(Err(e)) = warm {
        engine.free_session(s)?;
        return Err(e);
    }
    engine.free_session(s)?;
    Ok(Some([prefill?, decode.expect("run after a prefill")?]))
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

/// The `#` line of one measured tick.
pub fn line(what: &str, t: &DeviceTick, layers: usize) -> String {
    let c = &t.cost;
    let mb = |b: u64| b as f64 / 1e6;
    format!(
        "# device {what} ({} tokens): {} dispatches ({:.1} per layer; {} of them over further chunks of weights split at \
         this adapter's binding limit), {} bind groups, {} submissions, {} readbacks; \
         host to device {:.1} KB, device to host {:.1} KB; weights fetched {:.2} MB = {:.2}x the least ({:.2} MB, \
         each weight row once)",
        t.tokens,
        c.dispatches,
        c.dispatches as f64 / layers.max(1) as f64,
        c.split_dispatches,
        c.bind_groups,
        c.submits,
        c.readbacks,
        c.host_to_device as f64 / 1e3,
        c.device_to_host as f64 / 1e3,
        mb(c.weights_fetched),
        c.weights_fetched as f64 / c.weights_min.max(1) as f64,
        mb(c.weights_min)
    )
}
