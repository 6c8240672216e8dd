//! Saving an engine session to the `ds4-kv` store and restoring it, as the bench needs it (the engine has no such
//! bridge yet; when it gains one, `kvbench` should call that instead).
//!
//! Mapping of a [`SessionSnapshot`] at position `n` with span `S` (tokens per page):
//! - page `p` (tokens `pS..(p+1)S`), group `l` = layer `l`: the compressed rows that span appended
//!   (`TAG_COMP`, `head_dim` wide) and, on CSA layers, the indexer rows (`TAG_IDX`). Spans are a multiple of every
//!   compress ratio (the store enforces `span_multiple_of`), so rows never straddle pages.
//! - the checkpoint (tail tokens `⌊n/S⌋·S..n`), group `l`: the raw window ring (`TAG_RING`), the tail's
//!   compressed/indexer rows, and each compressor frontier (`TAG_FRONT_COMP`/`TAG_FRONT_IDX` + field offset); one
//!   extra group `n_layers` holds the last logits (`TAG_LOGITS`).
//!
//! Restoring rebuilds the snapshot from a fresh `SessionKv::new(cfg, 0)` and checks every block's size against it,
//! so a store written for another model gives an error, never a panic. Codecs are lossless: a restored snapshot
//! equals the saved one (`kvbench` checks this).

use anyhow::{bail, Context, Result};
use ds4_engine::model::ModelConfig;
use ds4_engine::tables::{Frontier, SessionKv, SessionSnapshot};
use ds4_kv::{Key, KvStore, RowBlock, RowsView, SaveReason};

pub const TAG_COMP: u32 = 0;
pub const TAG_IDX: u32 = 1;
pub const TAG_RING: u32 = 2;
pub const TAG_FRONT_COMP: u32 = 10;
pub const TAG_FRONT_IDX: u32 = 20;
pub const TAG_LOGITS: u32 = 30;

/// Field offsets inside a frontier's tag range.
const F_PENDING_KV: u32 = 0;
const F_PENDING_GATE: u32 = 1;
const F_PREV_KV: u32 = 2;
const F_PREV_GATE: u32 = 3;
const F_META: u32 = 4;

fn block(tag: u32, width: usize, values: &[f32]) -> Option<RowBlock<'_>> {
    if values.is_empty() || width == 0 {
        return None;
    }
    Some(RowBlock { tag, rows: (values.len() / width) as u32, width: width as u32, values })
}

fn frontier_blocks<'a>(f: &'a Frontier, base: u32, meta: &'a [f32; 2], out: &mut Vec<RowBlock<'a>>) {
    let w = f.coff * f.dim;
    out.extend(block(base + F_PENDING_KV, w, &f.pending_kv));
    out.extend(block(base + F_PENDING_GATE, w, &f.pending_gate));
    out.extend(block(base + F_PREV_KV, f.dim, &f.prev_kv));
    out.extend(block(base + F_PREV_GATE, f.dim, &f.prev_gate));
    out.extend(block(base + F_META, 2, meta));
}

/// What [`save`] wrote.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Saved {
    /// Pages newly written (existing ones are shared, not rewritten).
    pub pages: usize,
    /// Tokens in the checkpoint tail.
    pub tail: usize,
}

/// Saves `snap` (pages for the full spans not yet stored, then a checkpoint).
pub fn save(store: &KvStore, cfg: &ModelConfig, snap: &SessionSnapshot) -> Result<Saved> {
    let span = store.span_tokens() as usize;
    let tokens = &snap.history;
    if tokens.len() != snap.pos || snap.kv.layers.len() != cfg.n_layers {
        bail!("snapshot of {} tokens / {} layers does not fit the model", tokens.len(), snap.kv.layers.len());
    }
    let full = snap.pos / span;
    let existing = store.page_chain(tokens);
    let mut parent: Key = existing.last().map(|e| e.key).unwrap_or_else(|| store.root());
    let rows_of = |l: usize, a: usize, b: usize| -> (usize, usize) {
        let r = cfg.compress_ratios[l];
        match (a.checked_div(r), b.checked_div(r)) {
            (Some(a), Some(b)) => (a, b),
            _ => (0, 0),
        }
    };
    let mut pages = 0;
    for p in existing.len()..full {
        let groups: Vec<Vec<RowBlock<'_>>> = (0..cfg.n_layers)
            .map(|l| {
                let kv = &snap.kv.layers[l];
                let (a, b) = rows_of(l, p * span, (p + 1) * span);
                let mut g = Vec::new();
                g.extend(block(
                    TAG_COMP,
                    cfg.head_dim,
                    kv.comp_rows.get(a * cfg.head_dim..b * cfg.head_dim).unwrap_or(&[]),
                ));
                let ih = cfg.idx_head_dim;
                g.extend(block(TAG_IDX, ih, kv.idx_rows.get(a * ih..b * ih).unwrap_or(&[])));
                g
            })
            .collect();
        parent = store.put_page(&parent, &tokens[p * span..(p + 1) * span], &groups, SaveReason::Cold)?.key;
        pages += 1;
    }
    let metas: Vec<[[f32; 2]; 2]> = snap
        .kv
        .layers
        .iter()
        .map(|l| {
            let m =
                |f: &Option<Frontier>| f.as_ref().map_or([0.0; 2], |f| [f.n_pending as f32, f.has_prev as u8 as f32]);
            [m(&l.comp), m(&l.idx)]
        })
        .collect();
    let mut groups: Vec<Vec<RowBlock<'_>>> = Vec::with_capacity(cfg.n_layers + 1);
    for (l, (kv, meta)) in snap.kv.layers.iter().zip(&metas).enumerate() {
        let (a, _) = rows_of(l, full * span, snap.pos);
        let mut g = Vec::new();
        g.extend(block(TAG_RING, cfg.head_dim, &kv.ring));
        g.extend(block(TAG_COMP, cfg.head_dim, kv.comp_rows.get(a * cfg.head_dim..).unwrap_or(&[])));
        g.extend(block(TAG_IDX, cfg.idx_head_dim, kv.idx_rows.get(a * cfg.idx_head_dim..).unwrap_or(&[])));
        if let Some(f) = &kv.comp {
            frontier_blocks(f, TAG_FRONT_COMP, &meta[0], &mut g);
        }
        if let Some(f) = &kv.idx {
            frontier_blocks(f, TAG_FRONT_IDX, &meta[1], &mut g);
        }
        groups.push(g);
    }
    groups.push(block(TAG_LOGITS, snap.logits.len().max(1), &snap.logits).into_iter().collect());
    store.put_checkpoint(&parent, &tokens[full * span..], &groups, SaveReason::Cold)?;
    Ok(Saved { pages, tail: snap.pos - full * span })
}

fn copy_exact(dst: &mut [f32], v: &RowsView<'_>, what: &str) -> ds4_kv::Result<()> {
    if dst.len() != v.values.len() {
        return Err(ds4_kv::KvError::Invalid(format!(
            "layer {} {what}: {} values stored, the model needs {}",
            v.group,
            v.values.len(),
            dst.len()
        )));
    }
    dst.copy_from_slice(v.values);
    Ok(())
}

fn apply_frontier(f: Option<&mut Frontier>, field: u32, v: &RowsView<'_>) -> ds4_kv::Result<()> {
    let Some(f) = f else {
        return Err(ds4_kv::KvError::Invalid(format!("layer {}: frontier stored for a layer without one", v.group)));
    };
    match field {
        F_PENDING_KV => copy_exact(&mut f.pending_kv, v, "pending_kv"),
        F_PENDING_GATE => copy_exact(&mut f.pending_gate, v, "pending_gate"),
        F_PREV_KV => copy_exact(&mut f.prev_kv, v, "prev_kv"),
        F_PREV_GATE => copy_exact(&mut f.prev_gate, v, "prev_gate"),
        F_META if v.values.len() == 2 && v.values[0] >= 0.0 && (v.values[0] as usize) < f.ratio.max(1) => {
            f.n_pending = v.values[0] as usize;
            f.has_prev = v.values[1] != 0.0;
            Ok(())
        }
        _ => Err(ds4_kv::KvError::Invalid(format!("layer {}: bad frontier block {field}", v.group))),
    }
}

/// Restores the longest stored prefix of `tokens` that ends at a checkpoint, or `None` when there is none.
pub fn restore(store: &KvStore, cfg: &ModelConfig, tokens: &[u32]) -> Result<Option<SessionSnapshot>> {
    let m = store.longest_prefix(tokens);
    let Some(ckpt) = m.checkpoint else { return Ok(None) };
    let mut kv = SessionKv::new(cfg, m.matched_tokens);
    let mut logits = Vec::new();
    let n_layers = cfg.n_layers as u32;
    let mut apply = |v: RowsView<'_>| -> ds4_kv::Result<()> {
        if v.group == n_layers && v.tag == TAG_LOGITS {
            logits = v.values.to_vec();
            return Ok(());
        }
        let Some(l) = kv.layers.get_mut(v.group as usize) else {
            return Err(ds4_kv::KvError::Invalid(format!("group {} beyond the model's {n_layers} layers", v.group)));
        };
        match v.tag {
            TAG_COMP => l.comp_rows.extend_from_slice(v.values),
            TAG_IDX => l.idx_rows.extend_from_slice(v.values),
            TAG_RING => copy_exact(&mut l.ring, &v, "ring")?,
            t if (TAG_FRONT_COMP..TAG_FRONT_COMP + 5).contains(&t) => {
                apply_frontier(l.comp.as_mut(), t - TAG_FRONT_COMP, &v)?
            }
            t if (TAG_FRONT_IDX..TAG_FRONT_IDX + 5).contains(&t) => {
                apply_frontier(l.idx.as_mut(), t - TAG_FRONT_IDX, &v)?
            }
            t => return Err(ds4_kv::KvError::Invalid(format!("unknown block tag {t}"))),
        }
        Ok(())
    };
    for p in &m.pages {
        store.load(&p.key, &mut apply).with_context(|| format!("loading page {}", p.key))?;
    }
    store.load(&ckpt.key, &mut apply).context("loading the checkpoint")?;
    Ok(Some(SessionSnapshot { pos: m.matched_tokens, history: tokens[..m.matched_tokens].to_vec(), kv, logits }))
}
