//! The default context size: the largest that fits this machine's memory, capped at the model's trained context.
//!
//! The arithmetic (logged at `INFO` when the server starts without `--ctx`):
//! - **KV bytes per token** come from the model's shapes, as the engine stores them (f32, see
//!   `ds4_engine::tables::kv`): a CSA layer (ratio 4) keeps one `head_dim` row and one `idx_head_dim` indexer row per
//!   4 tokens, an HCA layer (ratio 128) one `head_dim` row per 128 tokens, a window layer nothing that grows.
//!   DeepSeek V4 Flash: 21 × (512 + 128) / 4 + 20 × 512 / 128 = 3440 values = 13,760 bytes per token (1M tokens ≈
//!   13.8 GB).
//! - **Per-session buffers** that do not grow with the context: the roll-back log
//!   ([`rollback_log_bytes`]: per layer `R + max(window, 2·ratio)` tokens of raw KV row, compressor and indexer
//!   inputs; DeepSeek V4 Flash at R = 1024: ≈ 0.5 GB per session). Every decoding session (`--max-active`) may
//!   hold one.
//! - **Usable memory**: available memory − the weight file. Available memory is `MemAvailable` of
//!   `/proc/meminfo` (without it the context falls back to [`FALLBACK_CTX`]).
//! - **Budget** of one session's KV: half of the usable memory − `max_active` roll-back logs. The other half holds
//!   the RAM KV tier (parked sessions, a quarter: [`ram_tier_default`]), activations and the rest of the machine.
//! - **Context** = budget / bytes per token, rounded down to a multiple of 1024, at least [`MIN_CTX`], at most the
//!   model's `context_length`.
//!
//! Sessions allocate KV as they grow, so the context is a per-session ceiling, not memory taken up front.

use ds4_engine::model::{LayerKind, ModelConfig};

/// Used when the available memory cannot be read.
pub const FALLBACK_CTX: usize = 32768;
/// Never default below this (still capped at the model's context).
pub const MIN_CTX: usize = 4096;

/// KV bytes one more token adds to a session (f32 rows; see the module doc).
pub fn kv_bytes_per_token(cfg: &ModelConfig) -> f64 {
    (0..cfg.n_layers)
        .map(|l| {
            let ratio = cfg.compress_ratios[l] as f64;
            match cfg.layer_kind(l) {
                LayerKind::Window => 0.0,
                LayerKind::Hca => cfg.head_dim as f64 / ratio,
                LayerKind::Csa => (cfg.head_dim + cfg.idx_head_dim) as f64 / ratio,
            }
        })
        .sum::<f64>()
        * 4.0
}

/// Bytes of one session's roll-back log reaching `rollback` tokens back (0: none), in a context of `ctx` tokens:
/// per layer `min(rollback + max(window, 2·ratio), ctx)` logged tokens of `head_dim + 2·coff·head_dim +
/// 2·coff·idx_head_dim` f32 (the raw KV row; main compressor features and gates; indexer features and gates on CSA
/// layers), as `ds4_engine::tables::kv::TokenLog` holds them.
pub fn rollback_log_bytes(cfg: &ModelConfig, rollback: usize, ctx: usize) -> u64 {
    if rollback == 0 {
        return 0;
    }
    (0..cfg.n_layers)
        .map(|l| {
            let ratio = cfg.compress_ratios[l];
            let cap = (rollback + cfg.window.max(2 * ratio)).min(ctx.max(1)) as u64;
            let width = match cfg.layer_kind(l) {
                LayerKind::Window => cfg.head_dim,
                LayerKind::Hca => cfg.head_dim + 2 * cfg.head_dim,
                LayerKind::Csa => cfg.head_dim + 2 * 2 * cfg.head_dim + 2 * 2 * cfg.idx_head_dim,
            } as u64;
            cap * width * 4
        })
        .sum()
}

/// The default context and a one-line account of how it was chosen; `session_fixed_bytes` is what each of
/// `sessions` decoding sessions holds whatever its length (its roll-back log, [`rollback_log_bytes`]).
pub fn auto_context(
    cfg: &ModelConfig,
    weight_bytes: u64,
    mem_available: Option<u64>,
    sessions: usize,
    session_fixed_bytes: u64,
) -> (usize, String) {
    let model_max = cfg.ctx_len.max(1);
    let per_token = kv_bytes_per_token(cfg);
    let Some(avail) = mem_available else {
        let ctx = FALLBACK_CTX.min(model_max);
        return (ctx, format!("available memory unknown: ctx = min({FALLBACK_CTX}, model {model_max}) = {ctx}"));
    };
    let fixed = (sessions as u64).saturating_mul(session_fixed_bytes);
    let budget = (avail.saturating_sub(weight_bytes) / 2).saturating_sub(fixed);
    let fits = if per_token > 0.0 { (budget as f64 / per_token) as usize } else { usize::MAX };
    let ctx = (fits / 1024 * 1024).max(MIN_CTX).min(model_max);
    let mib = |b: u64| b >> 20;
    let why = format!(
        "ctx = min(model {model_max}, ((available {} MiB - weights {} MiB) / 2 - {sessions} sessions x {} MiB \
         roll-back log) / {per_token:.0} B per token = {fits}) = {ctx}",
        mib(avail),
        mib(weight_bytes),
        mib(session_fixed_bytes)
    );
    (ctx, why)
}

/// The default byte bound of the RAM KV tier (parked sessions, `--kv-ram-mb`): a quarter of (available memory −
/// weights), at least 256 MiB; 1 GiB when the available memory is unknown.
pub fn ram_tier_default(weight_bytes: u64, mem_available: Option<u64>) -> u64 {
    match mem_available {
        Some(avail) => (avail.saturating_sub(weight_bytes) / 4).max(256 << 20),
        None => 1 << 30,
    }
}

/// `MemAvailable` of `/proc/meminfo`, in bytes.
pub fn mem_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flash_like() -> ModelConfig {
        let mut ratios = vec![0, 0];
        for i in 0..41 {
            ratios.push(if i % 2 == 0 { 4 } else { 128 });
        }
        let file = ds4_engine::gguf::GgufFile::from_bytes(ds4_engine::convert::demo_model_gguf(1).unwrap()).unwrap();
        let mut cfg = ModelConfig::from_gguf(&file).unwrap();
        cfg.n_layers = 43;
        cfg.head_dim = 512;
        cfg.idx_head_dim = 128;
        cfg.compress_ratios = ratios;
        cfg.ctx_len = 1 << 20;
        cfg.window = 128;
        cfg
    }

    #[test]
    fn flash_kv_arithmetic() {
        // 21 CSA layers × 640 / 4 + 20 HCA layers × 512 / 128 = 3440 f32 values.
        assert_eq!(kv_bytes_per_token(&flash_like()), 13760.0);
    }

    #[test]
    fn context_follows_memory_and_caps() {
        let cfg = flash_like();
        let gib = 1u64 << 30;
        // 100 GiB free after 80 GiB of weights: 10 GiB budget / 13760 B = 780,335 → 780,288.
        let (ctx, why) = auto_context(&cfg, 80 * gib, Some(100 * gib), 0, 0);
        assert_eq!(ctx, 780_288, "{why}");
        assert!(why.contains("13760 B per token"), "{why}");
        // Plenty of memory: the model's context.
        assert_eq!(auto_context(&cfg, 0, Some(1024 * gib), 0, 0).0, 1 << 20);
        // Too little: the floor; unknown: the fallback.
        assert_eq!(auto_context(&cfg, 90 * gib, Some(10 * gib), 0, 0).0, MIN_CTX);
        assert_eq!(auto_context(&cfg, 0, None, 0, 0).0, FALLBACK_CTX);
    }

    #[test]
    fn rollback_logs_count_against_the_context() {
        let cfg = flash_like();
        let log = rollback_log_bytes(&cfg, 1024, 1 << 20);
        // 21 CSA layers × 1152 × 3072 + 20 HCA layers × 1280 × 1536 + 2 window layers × 1152 × 512 f32 values:
        // 74.3 M + 39.3 M + 1.2 M = 114.8 M values ≈ 0.46 GB per session.
        assert_eq!(log, (21 * 1152 * 3072 + 20 * 1280 * 1536 + 2 * 1152 * 512) * 4);
        assert!(log > 400_000_000 && log < 500_000_000, "{log}");
        assert_eq!(rollback_log_bytes(&cfg, 0, 1 << 20), 0);
        // Capped at the context: a 512-token context logs at most 512 tokens per layer.
        assert_eq!(rollback_log_bytes(&cfg, 1024, 512), (21 * 3072 + 20 * 1536 + 2 * 512) * 512 * 4);
        let gib = 1u64 << 30;
        // 10 GiB budget − 8 sessions × 0.46 GB = 6.3 GB / 13760 B.
        let (ctx, why) = auto_context(&cfg, 80 * gib, Some(100 * gib), 8, log);
        let expect = ((10 * gib - 8 * log) as f64 / 13760.0) as usize / 1024 * 1024;
        assert_eq!(ctx, expect, "{why}");
        assert!(ctx < 780_288 && why.contains("8 sessions"), "{why}");
        // Logs that eat the whole budget leave the floor.
        assert_eq!(auto_context(&cfg, 80 * gib, Some(100 * gib), 32, log).0, MIN_CTX);
        assert_eq!(ram_tier_default(80 * gib, Some(100 * gib)), 5 * gib);
        assert_eq!(ram_tier_default(80 * gib, Some(80 * gib)), 256 << 20);
    }
}
