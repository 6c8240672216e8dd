//! Per-session KV state, as plain data: per layer the raw sliding-window ring, the compressed rows, the indexer
//! key rows, and the compressor frontiers.
//!
//! Layout and invariants (for a session that has processed `pos` tokens):
//! - `ring`: `window` rows of `head_dim`; the row of position `p` lives in slot `p % window` and is valid for
//!   `p >= pos - window`.
//! - `comp_rows`: `pos / ratio` rows of `head_dim`, in order; row `w` is a pure function of the token prefix
//!   `..(w + 1) * ratio`, so a token span aligned to the ratio maps to a contiguous row range (what the kv crate
//!   pages and shares by prefix).
//! - `idx_rows`: the same count of `idx_head_dim` rows (CSA layers only).
//! - [`Frontier`]: the partially filled block (`pos % ratio` pending rows of projected features and gate logits,
//!   `ape` already added) and, for CSA, the previous complete block's first-half (`Ca`) features and gates.
//!
//! Everything is f32 and owned, so a clone is a complete snapshot and restoring it gives bit-identical results.
//! In simulation mode the stored rows are already rounded (KV rows: FP8 on the non-rope dims; indexer rows:
//! Hadamard-rotated, then FP4), exactly as attention reads them; a snapshot taken in one mode must be restored
//! into an engine running the same mode.

use crate::model::config::{LayerKind, ModelConfig};

/// The carried state of one compressor (main or indexer). See the module docs.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Frontier {
    /// Tokens per compressed row.
    pub ratio: usize,
    /// Output row width.
    pub dim: usize,
    /// Feature groups per token: 2 for CSA (`Ca | Cb`), 1 for HCA.
    pub coff: usize,
    /// `ratio × coff·dim` projected features of the pending block (first `n_pending` rows valid).
    pub pending_kv: Vec<f32>,
    /// `ratio × coff·dim` gate logits (+ ape) of the pending block.
    pub pending_gate: Vec<f32>,
    pub n_pending: usize,
    /// CSA: `ratio × dim` `Ca` features of the previous complete block.
    pub prev_kv: Vec<f32>,
    /// CSA: `ratio × dim` `Ca` gate logits (+ ape) of the previous complete block.
    pub prev_gate: Vec<f32>,
    /// CSA: whether `prev_*` hold a block (false before the first block completes).
    pub has_prev: bool,
}

impl Frontier {
    /// An empty frontier.
    pub fn new(ratio: usize, dim: usize, coff: usize) -> Frontier {
        let w = coff * dim;
        let prev = if coff == 2 { ratio * dim } else { 0 };
        Frontier {
            ratio,
            dim,
            coff,
            pending_kv: vec![0.0; ratio * w],
            pending_gate: vec![0.0; ratio * w],
            n_pending: 0,
            prev_kv: vec![0.0; prev],
            prev_gate: vec![0.0; prev],
            has_prev: false,
        }
    }
}

/// The state of one layer. See the module docs.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LayerKv {
    pub ring: Vec<f32>,
    pub comp_rows: Vec<f32>,
    pub idx_rows: Vec<f32>,
    pub comp: Option<Frontier>,
    pub idx: Option<Frontier>,
}

/// Bookkeeping for backends that keep a device copy of a session's KV (see
/// [`crate::backend::Backend::sync_kv`]). Not part of the state: two tags always compare equal.
///
/// A backend that advances its device copy gives it a fresh, process-unique `epoch`, stores the same epoch here and
/// sets `host_stale`; the host arrays of [`SessionKv`] are then out of date until the backend's `sync_kv` copies the
/// device state back (which clears `host_stale`). Anything that writes the host arrays must reset the tag
/// ([`SessionKv::clear`] and [`SessionKv::new`] do), so the backend uploads them instead of using its copy.
#[derive(Clone, Copy, Debug, Default)]
pub struct KvSync {
    /// Epoch of the device copy these arrays correspond to (0: host only, never on a device).
    pub epoch: u64,
    /// The device copy is newer than the host arrays.
    pub host_stale: bool,
    /// [`SessionKv::bytes`] of the device copy (what `bytes` reports while `host_stale`).
    pub device_bytes: u64,
}

impl PartialEq for KvSync {
    fn eq(&self, _: &KvSync) -> bool {
        true
    }
}

/// The complete KV state of a session.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SessionKv {
    pub layers: Vec<LayerKv>,
    /// Device-copy bookkeeping (see [`KvSync`]); ignored by `==`.
    pub sync: KvSync,
}

impl SessionKv {
    /// Bytes of KV state the session holds now (rows in use and frontiers; not spare capacity): the device copy's
    /// while the host arrays are stale, else the host arrays'.
    pub fn bytes(&self) -> u64 {
        if self.sync.host_stale {
            return self.sync.device_bytes;
        }
        self.host_bytes()
    }

    /// Bytes of the session's device copy (0 when no backend made one): the device tier of the KV metrics.
    pub fn device_bytes(&self) -> u64 {
        if self.sync.epoch != 0 {
            self.sync.device_bytes
        } else {
            0
        }
    }

    /// Bytes held by the host arrays (rows in use and frontiers; possibly an older copy while `sync.host_stale`):
    /// the host tier of the KV metrics.
    pub fn host_bytes(&self) -> u64 {
        let f = |fr: &Option<Frontier>| fr.as_ref().map_or(0, |f| f.pending_kv.len() + f.pending_gate.len());
        let values: usize = self
            .layers
            .iter()
            .map(|l| l.ring.len() + l.comp_rows.len() + l.idx_rows.len() + f(&l.comp) + f(&l.idx))
            .sum();
        (values * std::mem::size_of::<f32>()) as u64
    }

    /// Tokens whose compressed rows are reserved up front; longer sessions grow (amortised doubling).
    pub const RESERVE_TOKENS_MAX: usize = 32768;

    /// Empty state for `cfg`, with row capacity reserved for `min(ctx, RESERVE_TOKENS_MAX)` tokens (no growth in
    /// the decode loop below that).
    pub fn new(cfg: &ModelConfig, ctx: usize) -> SessionKv {
        let ctx = ctx.min(Self::RESERVE_TOKENS_MAX);
        let layers = (0..cfg.n_layers)
            .map(|l| {
                let ratio = cfg.compress_ratios[l];
                let kind = cfg.layer_kind(l);
                let (comp, idx) = match kind {
                    LayerKind::Window => (None, None),
                    LayerKind::Hca => (Some(Frontier::new(ratio, cfg.head_dim, 1)), None),
                    LayerKind::Csa => {
                        (Some(Frontier::new(ratio, cfg.head_dim, 2)), Some(Frontier::new(ratio, cfg.idx_head_dim, 2)))
                    }
                };
                let n_rows = ctx.checked_div(ratio).unwrap_or(0);
                LayerKv {
                    ring: vec![0.0; cfg.window * cfg.head_dim],
                    comp_rows: Vec::with_capacity(n_rows * cfg.head_dim),
                    idx_rows: Vec::with_capacity(if idx.is_some() { n_rows * cfg.idx_head_dim } else { 0 }),
                    comp,
                    idx,
                }
            })
            .collect();
        SessionKv { layers, sync: KvSync::default() }
    }

    /// Zeroes the state (as new) while keeping the allocations.
    pub fn clear(&mut self) {
        self.sync = KvSync::default();
        for l in &mut self.layers {
            l.ring.fill(0.0);
            l.comp_rows.clear();
            l.idx_rows.clear();
            for f in [&mut l.comp, &mut l.idx].into_iter().flatten() {
                f.pending_kv.fill(0.0);
                f.pending_gate.fill(0.0);
                f.n_pending = 0;
                f.prev_kv.fill(0.0);
                f.prev_gate.fill(0.0);
                f.has_prev = false;
            }
        }
    }

    /// Values held (for logs and memory accounting).
    pub fn n_values(&self) -> usize {
        self.layers
            .iter()
            .map(|l| {
                let f = |f: &Option<Frontier>| f.as_ref().map_or(0, |f| f.pending_kv.len() * 2 + f.prev_kv.len() * 2);
                l.ring.len() + l.comp_rows.len() + l.idx_rows.len() + f(&l.comp) + f(&l.idx)
            })
            .sum()
    }
}
