//! The mapping between a [`SessionSnapshot`] and the `ds4-kv` row blocks of its pages and checkpoint.
//!
//! With a span of `S` tokens (a multiple of every layer's compress ratio, so no compressed row straddles pages):
//! - page `p` (tokens `p·S..(p+1)·S`), group `l` = layer `l`: the compressed rows the span appended
//!   ([`TAG_COMP`], `head_dim` wide) and on CSA layers the indexer rows ([`TAG_IDX`], `idx_head_dim` wide).
//!   Window-only layers have an empty group.
//! - the checkpoint after `P` full pages, group `l`: the raw window ring ([`TAG_RING`]), the compressed/indexer
//!   rows after page `P` (the partial span), and each compressor frontier's four arrays plus one meta row
//!   `[n_pending, has_prev]` ([`TAG_FRONT_COMP`] / [`TAG_FRONT_IDX`] + field); group `n_layers` holds the last
//!   logits ([`TAG_LOGITS`], absent when empty).
//!
//! [`SnapshotBuilder`] rebuilds the snapshot from those blocks, checking every block's tag and size against a fresh
//! `SessionKv` of this model, so rows from another model or a damaged entry give an error, never a panic. The
//! store's codecs are lossless, so a rebuilt snapshot equals the saved one bit for bit.

use std::borrow::Cow;

use ds4_kv::{RowBlock, RowsView};

use crate::model::ModelConfig;
use crate::tables::{Frontier, PageLedger, SessionKv, SessionSnapshot};
use crate::{Error, Result};

/// Compressed KV rows.
pub const TAG_COMP: u32 = 0;
/// Indexer key rows.
pub const TAG_IDX: u32 = 1;
/// Raw sliding-window ring.
pub const TAG_RING: u32 = 2;
/// Main compressor frontier (+ field 0..=4).
pub const TAG_FRONT_COMP: u32 = 10;
/// Indexer compressor frontier (+ field 0..=4).
pub const TAG_FRONT_IDX: u32 = 20;
/// Next-token logits.
pub const TAG_LOGITS: u32 = 30;

const F_PENDING_KV: u32 = 0;
const F_PENDING_GATE: u32 = 1;
const F_PREV_KV: u32 = 2;
const F_PREV_GATE: u32 = 3;
const F_META: u32 = 4;

fn block(tag: u32, width: usize, values: &[f32]) -> Option<RowBlock<'_>> {
    (width > 0 && !values.is_empty()).then(|| RowBlock {
        tag,
        rows: (values.len() / width) as u32,
        width: width as u32,
        values,
    })
}

/// Row range `[a, b)` (in rows) of layer `l` for tokens `t0..t1`, or `None` for a window-only layer.
fn row_range(cfg: &ModelConfig, l: usize, t0: usize, t1: usize) -> Option<(usize, usize)> {
    let r = cfg.compress_ratios[l];
    (r > 0).then(|| (t0 / r, t1 / r))
}

/// Per layer, the `(tag, width, values)` row spans of a token range: each borrowed straight from the session's
/// pages when the range lies in one page (a span of [`crate::tables::PAGE_TOKENS`] tokens always does), gathered
/// otherwise. [`page_groups`] / [`checkpoint_groups`] turn them into the store's row blocks.
pub type RowSpans<'a> = Vec<Vec<(u32, usize, Cow<'a, [f32]>)>>;

/// Row spans of page `p` (tokens `p·span..(p+1)·span`) of `snap`, one group per layer.
pub fn page_spans<'a>(cfg: &ModelConfig, snap: &'a SessionSnapshot, p: usize, span: usize) -> RowSpans<'a> {
    row_spans(cfg, snap, p * span, (p + 1) * span)
}

/// Row spans of the partial span after `pages` full pages of `span` tokens (what the checkpoint holds).
pub fn tail_spans<'a>(cfg: &ModelConfig, snap: &'a SessionSnapshot, pages: usize, span: usize) -> RowSpans<'a> {
    row_spans(cfg, snap, pages * span, snap.pos)
}

fn row_spans<'a>(cfg: &ModelConfig, snap: &'a SessionSnapshot, t0: usize, t1: usize) -> RowSpans<'a> {
    snap.kv
        .layers
        .iter()
        .enumerate()
        .map(|(l, lk)| {
            let mut g = Vec::new();
            if let Some((a, b)) = row_range(cfg, l, t0, t1) {
                g.push((TAG_COMP, cfg.head_dim, lk.comp_rows.range(a, b)));
                if lk.idx.is_some() {
                    g.push((TAG_IDX, cfg.idx_head_dim, lk.idx_rows.range(a, b)));
                }
            }
            g
        })
        .collect()
}

/// Row blocks of a page (its [`page_spans`]), one group per layer.
pub fn page_groups<'a>(spans: &'a RowSpans<'_>) -> Vec<Vec<RowBlock<'a>>> {
    spans.iter().map(|g| g.iter().filter_map(|(tag, w, v)| block(*tag, *w, v)).collect()).collect()
}

/// Row blocks of the checkpoint of `snap` whose partial-span rows are `tail` ([`tail_spans`]; the meta rows are
/// owned by `meta`, which must outlive the blocks).
pub fn checkpoint_groups<'a>(
    cfg: &ModelConfig,
    snap: &'a SessionSnapshot,
    tail: &'a RowSpans<'_>,
    meta: &'a [[f32; 2]],
) -> Vec<Vec<RowBlock<'a>>> {
    let mut groups = page_groups(tail);
    let mut mi = 0;
    for (lk, g) in snap.kv.layers.iter().zip(&mut groups) {
        g.extend(block(TAG_RING, cfg.head_dim, &lk.ring));
        for (base, f) in [(TAG_FRONT_COMP, &lk.comp), (TAG_FRONT_IDX, &lk.idx)] {
            let Some(f) = f else { continue };
            let w = f.coff * f.dim;
            g.extend(block(base + F_PENDING_KV, w, &f.pending_kv));
            g.extend(block(base + F_PENDING_GATE, w, &f.pending_gate));
            g.extend(block(base + F_PREV_KV, f.dim, &f.prev_kv));
            g.extend(block(base + F_PREV_GATE, f.dim, &f.prev_gate));
            g.extend(block(base + F_META, 2, &meta[mi]));
            mi += 1;
        }
    }
    groups.push(block(TAG_LOGITS, snap.logits.len(), &snap.logits).into_iter().collect());
    groups
}

/// The `[n_pending, has_prev]` meta rows of every frontier of `snap`, in layer order (main before indexer).
pub fn frontier_meta(snap: &SessionSnapshot) -> Vec<[f32; 2]> {
    let mut out = Vec::new();
    for lk in &snap.kv.layers {
        for f in [&lk.comp, &lk.idx].into_iter().flatten() {
            out.push([f.n_pending as f32, if f.has_prev { 1.0 } else { 0.0 }]);
        }
    }
    out
}

/// Rebuilds a snapshot from the blocks of a page chain and a checkpoint (fed in file order).
pub struct SnapshotBuilder<'c> {
    cfg: &'c ModelConfig,
    kv: SessionKv,
    logits: Vec<f32>,
}

fn bad(what: String) -> Error {
    Error::Session(format!("stored KV entry does not fit this model: {what}"))
}

fn fill(dst: &mut [f32], v: &RowsView<'_>, width: usize, what: &str) -> Result<()> {
    if v.width as usize != width || v.values.len() != dst.len() {
        return Err(bad(format!(
            "layer {} {what}: {} x {} values, expected {} of width {width}",
            v.group,
            v.rows,
            v.width,
            dst.len()
        )));
    }
    dst.copy_from_slice(v.values);
    Ok(())
}

fn fill_frontier(f: &mut Frontier, field: u32, v: &RowsView<'_>) -> Result<()> {
    match field {
        F_PENDING_KV => fill(&mut f.pending_kv, v, f.coff * f.dim, "pending features"),
        F_PENDING_GATE => fill(&mut f.pending_gate, v, f.coff * f.dim, "pending gates"),
        F_PREV_KV => fill(&mut f.prev_kv, v, f.dim, "previous features"),
        F_PREV_GATE => fill(&mut f.prev_gate, v, f.dim, "previous gates"),
        F_META => {
            let mut m = [0f32; 2];
            fill(&mut m, v, 2, "frontier meta")?;
            if !(m[0] >= 0.0 && (m[0] as usize) < f.ratio.max(1) && (m[1] == 0.0 || m[1] == 1.0)) {
                return Err(bad(format!("layer {} frontier meta {m:?}", v.group)));
            }
            f.n_pending = m[0] as usize;
            f.has_prev = m[1] == 1.0;
            Ok(())
        }
        _ => Err(bad(format!("layer {} unknown frontier field {field}", v.group))),
    }
}

impl<'c> SnapshotBuilder<'c> {
    /// An empty builder for `cfg` (pages in a pool of their own).
    #[cfg(test)]
    pub(crate) fn new(cfg: &'c ModelConfig) -> SnapshotBuilder<'c> {
        SnapshotBuilder::new_in(cfg, &PageLedger::new())
    }

    /// An empty builder for `cfg` whose rows fill pages of `pool` (the engine's, so a restored session's pages
    /// are accounted with the live ones).
    pub fn new_in(cfg: &'c ModelConfig, pool: &PageLedger) -> SnapshotBuilder<'c> {
        SnapshotBuilder { cfg, kv: SessionKv::new_in(cfg, 0, pool), logits: Vec::new() }
    }

    /// Takes one block (page or checkpoint).
    pub fn push(&mut self, v: RowsView<'_>) -> Result<()> {
        let c = self.cfg;
        let l = v.group as usize;
        if l == c.n_layers {
            if v.tag != TAG_LOGITS || v.rows != 1 || v.width as usize != c.vocab {
                return Err(bad(format!("logits block tag {} {} x {}", v.tag, v.rows, v.width)));
            }
            self.logits = v.values.to_vec();
            return Ok(());
        }
        let Some(lk) = self.kv.layers.get_mut(l) else {
            return Err(bad(format!("group {l} (model has {} layers)", c.n_layers)));
        };
        let rows_ok = |w: usize| v.width as usize == w && v.values.len() == v.rows as usize * w;
        match v.tag {
            TAG_COMP if lk.comp.is_some() && rows_ok(c.head_dim) => lk.comp_rows.extend_from_slice(v.values),
            TAG_IDX if lk.idx.is_some() && rows_ok(c.idx_head_dim) => lk.idx_rows.extend_from_slice(v.values),
            TAG_RING => fill(&mut lk.ring, &v, c.head_dim, "ring")?,
            t if (TAG_FRONT_COMP..TAG_FRONT_COMP + 5).contains(&t) && lk.comp.is_some() => {
                fill_frontier(lk.comp.as_mut().expect("checked"), t - TAG_FRONT_COMP, &v)?
            }
            t if (TAG_FRONT_IDX..TAG_FRONT_IDX + 5).contains(&t) && lk.idx.is_some() => {
                fill_frontier(lk.idx.as_mut().expect("checked"), t - TAG_FRONT_IDX, &v)?
            }
            t => return Err(bad(format!("layer {l}: unexpected block tag {t} ({} x {})", v.rows, v.width))),
        }
        Ok(())
    }

    /// Takes one span as pages RAM already holds (one per row table, in [`crate::tables::page_index`] order) in
    /// place of a stored page's blocks.
    pub fn push_pages(&mut self, pages: Vec<std::sync::Arc<crate::tables::Page>>) -> Result<()> {
        let n = pages.len();
        let mut it = pages.into_iter();
        for (i, t) in crate::tables::page_index::tables_mut(&mut self.kv).enumerate() {
            let ok = it.next().is_some_and(|pg| t.push_page(pg));
            if !ok {
                return Err(bad(format!("resident span: table {i} of {n} pages does not take its page")));
            }
        }
        if it.next().is_some() {
            return Err(bad(format!("resident span: {n} pages for fewer tables")));
        }
        Ok(())
    }

    /// The snapshot at `history` (its length is the position). The engine's `restore` validates the row counts.
    pub fn finish(self, history: Vec<u32>) -> SessionSnapshot {
        SessionSnapshot { pos: history.len(), history, kv: self.kv, logits: self.logits }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::GgufFile;

    fn cfg() -> ModelConfig {
        let f = GgufFile::from_bytes(crate::convert::demo_model_gguf(3).unwrap()).unwrap();
        ModelConfig::from_gguf(&f).unwrap()
    }

    /// A snapshot with distinct values everywhere, at `pos` tokens.
    fn snapshot(cfg: &ModelConfig, pos: usize) -> SessionSnapshot {
        let mut kv = SessionKv::new(cfg, 0);
        let mut x = 0.0f32;
        let mut next = || {
            x += 0.25;
            x
        };
        for (l, lk) in kv.layers.iter_mut().enumerate() {
            lk.ring.iter_mut().for_each(|v| *v = next());
            if let Some(r) = (cfg.compress_ratios[l] > 0).then_some(cfg.compress_ratios[l]) {
                lk.comp_rows.extend_from_slice(&(0..pos / r * cfg.head_dim).map(|_| next()).collect::<Vec<_>>());
                if lk.idx.is_some() {
                    let v: Vec<f32> = (0..pos / r * cfg.idx_head_dim).map(|_| next()).collect();
                    lk.idx_rows.extend_from_slice(&v);
                }
            }
            for f in [&mut lk.comp, &mut lk.idx].into_iter().flatten() {
                f.pending_kv.iter_mut().chain(f.pending_gate.iter_mut()).for_each(|v| *v = next());
                f.prev_kv.iter_mut().chain(f.prev_gate.iter_mut()).for_each(|v| *v = next());
                f.n_pending = pos % f.ratio;
                f.has_prev = f.coff == 2;
            }
        }
        let logits = (0..cfg.vocab).map(|_| next()).collect();
        SessionSnapshot { pos, history: (0..pos as u32).collect(), kv, logits }
    }

    fn views<'a>(groups: &'a [Vec<RowBlock<'a>>]) -> impl Iterator<Item = RowsView<'a>> {
        groups.iter().enumerate().flat_map(|(g, bs)| {
            bs.iter().map(move |b| RowsView {
                group: g as u32,
                tag: b.tag,
                rows: b.rows,
                width: b.width,
                values: b.values,
            })
        })
    }

    #[test]
    fn pages_and_checkpoint_rebuild_the_snapshot() {
        let c = cfg();
        let span = *c.compress_ratios.iter().max().unwrap() * 4;
        let snap = snapshot(&c, 2 * span + 5);
        let spans: Vec<_> = (0..2).map(|p| page_spans(&c, &snap, p, span)).collect();
        let pages: Vec<_> = spans.iter().map(page_groups).collect();
        let meta = frontier_meta(&snap);
        let tail = tail_spans(&c, &snap, 2, span);
        let ck = checkpoint_groups(&c, &snap, &tail, &meta);
        let mut b = SnapshotBuilder::new(&c);
        for g in pages.iter().chain(std::iter::once(&ck)) {
            for v in views(g) {
                b.push(v).unwrap();
            }
        }
        assert_eq!(b.finish(snap.history.clone()), snap);
    }

    #[test]
    fn a_page_span_is_written_from_the_live_page_without_a_copy() {
        let c = cfg();
        let span = crate::tables::PAGE_TOKENS;
        let snap = snapshot(&c, 2 * span + 5);
        for p in 0..2 {
            let spans = page_spans(&c, &snap, p, span);
            let n: usize = spans.iter().flatten().map(|(_, _, v)| v.len()).sum();
            assert!(n > 0);
            assert!(spans.iter().flatten().all(|(_, _, v)| matches!(v, Cow::Borrowed(_))), "page {p} was gathered");
        }
        // A span of two engine pages has to be gathered (still bit-exact: the rebuild test covers the content).
        let spans = page_spans(&c, &snap, 0, 2 * span);
        assert!(spans.iter().flatten().any(|(_, _, v)| matches!(v, Cow::Owned(_))));
    }

    #[test]
    fn foreign_blocks_are_errors_not_panics() {
        let c = cfg();
        let w = c.head_dim + 1; // no layer has rows this wide
        let vals = vec![0.0f32; w];
        let ring_short = vec![0.0f32; c.head_dim];
        let hca = (0..c.n_layers).find(|&l| c.compress_ratios[l] > 0).expect("a compressed layer") as u32;
        let cases = [
            RowsView { group: 99, tag: TAG_COMP, rows: 1, width: w as u32, values: &vals },
            RowsView { group: 0, tag: TAG_RING, rows: 1, width: c.head_dim as u32, values: &ring_short },
            RowsView { group: hca, tag: TAG_COMP, rows: 1, width: w as u32, values: &vals },
            RowsView { group: 0, tag: TAG_COMP, rows: 1, width: c.head_dim as u32, values: &ring_short },
            RowsView { group: hca, tag: 77, rows: 1, width: w as u32, values: &vals },
            RowsView { group: c.n_layers as u32, tag: TAG_LOGITS, rows: 1, width: w as u32, values: &vals },
            RowsView { group: hca, tag: TAG_FRONT_COMP + F_META, rows: 1, width: 2, values: &[1e9, 0.5] },
        ];
        for v in cases {
            let (g, t) = (v.group, v.tag);
            let mut b = SnapshotBuilder::new(&c);
            assert!(b.push(v).is_err(), "accepted group {g} tag {t}");
        }
    }
}
