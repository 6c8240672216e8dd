//! The DSpark drafter (V4-Flash-0731): a block of drafts from one parallel forward of three small stages, made
//! sequential by a light Markov head, with a confidence per draft ([`DsparkModel`]: weights and config).
//!
//! # What it computes (`docs/speculative-decoding.md` has the formulas)
//!
//! The target keeps, per position `t`, its *features*: for each target layer id `l_j` the mean of its `hc` mHC
//! streams after layer `l_j` ([`Engine::set_tap_layers`], [`crate::graph::Op::TapStreams`]). The drafter turns
//! each into a context row `c_t = RMSNorm(main_proj · f_t) · main_norm` and, per stage `s`, a key row
//! `K_s[t] = RoPE_t(RMSNorm(wkv_s · c_t) · kv_norm_s)`. To draft after the target's last position `a − 1` and the
//! chosen next token `x_a`, it runs the block `[x_a, m, …, m]` (`B` ids, `m` the noise token) at positions
//! `a … a+B−1` through the stages — each the trunk's block recipe (mHC, window attention with sinks, learned-routing
//! MoE) except that every block row attends to the context keys of positions `max(0, a−W) … a−1` and to all `B`
//! block rows (no causal mask inside the block) — then the last stage's mHC head and norm and the target's output
//! matrix give base logits `base_i` (row `i` predicts position `a+i+1`). The Markov head makes the drafts
//! sequential: `z_i = base_i + markov_w2 · markov_w1[prev_i]`, `d_i = argmax z_i`, `prev_0 = x_a`,
//! `prev_{i+1} = d_i`; and the confidence head gives `c_i = σ(w · [x_post_i ; markov_w1[prev_i]])`, the chance
//! that `d_i` stands given that the drafts before it did. A draft is cut where the running product of the `c_i`
//! falls below [`DsparkOptions::min_confidence`].
//!
//! Checked against an independent JAX forward (`tools/train_demo/dspark_ref.py`, fixture
//! `engine/tests/data/dspark-tiny`, test `engine/tests/dspark_fixture.rs`).
//!
//! # State per target session
//!
//! The key rows of the last `W + MAX_DRAFT + 2` target positions, per stage, rebuilt from the features the target
//! kept since the last draft (rows of positions the target rolled back and recomputed replace the old ones). Rows
//! of the block are never kept. Positions whose features are gone (a restart far behind) are left out of the
//! window: weaker drafts for a while, never a different output (the target verifies every draft).
//!
//! It runs on the CPU beside any target backend, with the CPU kernels (products, norms, mHC, SwiGLU) and its own
//! small attention and routing loops, in f32 without activation simulation (as the MTP drafter).

use std::collections::HashMap;

use super::mtp::MAX_DRAFT;
use super::Drafter;
use crate::backend::cpu::attention::attend;
use crate::backend::cpu::matmul::matmul;
use crate::backend::cpu::pool::Pool;
use crate::backend::cpu::{hc, moe, norm};
use crate::engine::{argmax, Engine};
use crate::model::weights::{HcWeights, LayerWeights};
use crate::model::{DsparkModel, Model, RopeFreqs};
use crate::tables::SessionId;
use crate::{Error, Result};

/// Options of the DSpark drafter.
#[derive(Clone, Copy, Debug)]
pub struct DsparkOptions {
    /// Cut a draft where the product of the drafts' confidences falls below this (0 = the whole block).
    pub min_confidence: f32,
    /// CPU threads for the drafter (0 = all cores; a model file under 1 GiB always gets one).
    pub threads: usize,
}

impl Default for DsparkOptions {
    fn default() -> Self {
        DsparkOptions { min_confidence: 0.0, threads: 0 }
    }
}

/// One block's outputs, every row `i` for position `a + i + 1`.
#[derive(Clone, Debug, PartialEq)]
pub struct Proposal {
    /// Greedy drafts `d_i` (the whole block, before any confidence cut).
    pub tokens: Vec<u32>,
    /// `[B, d]`: the last stage's mHC head collapse (before its norm).
    pub x_post: Vec<f32>,
    /// `[B, vocab]`: the stages' logits before the Markov head.
    pub base_logits: Vec<f32>,
    /// `[B, vocab]`: `z_i`, the Markov-corrected logits the drafts are the argmax of.
    pub logits: Vec<f32>,
    /// `c_i`: the chance that draft `i` stands given that the drafts before it did.
    pub confidence: Vec<f32>,
    /// Context rows the window wanted whose features were gone.
    pub cold: usize,
}

impl Proposal {
    /// The drafts kept by the confidence cut: while the running product of the confidences is at least `min`.
    pub fn cut(&self, min: f32) -> &[u32] {
        let mut s = 1f32;
        let n = self.confidence.iter().take_while(|&&c| {
            s *= c;
            s >= min
        });
        &self.tokens[..n.count()]
    }
}

/// Per target session: key rows of positions `from..from + n`, `[n, head_dim]` per stage.
#[derive(Debug, Default)]
struct Track {
    from: usize,
    keys: Vec<Vec<f32>>,
}

impl Track {
    fn len(&self, hd: usize) -> usize {
        self.keys.first().map_or(0, |k| k.len() / hd)
    }

    /// Drops the rows of positions `pos..`.
    fn cut(&mut self, pos: usize, hd: usize) {
        if pos <= self.from {
            self.keys.iter_mut().for_each(Vec::clear);
            self.from = pos;
        } else if pos < self.from + self.len(hd) {
            self.keys.iter_mut().for_each(|k| k.truncate((pos - self.from) * hd));
        }
    }
}

/// The DSpark drafter. See the module docs.
pub struct DsparkDrafter {
    dm: DsparkModel,
    pool: Pool,
    rope: RopeFreqs,
    opts: DsparkOptions,
    tracks: HashMap<SessionId, Track>,
    /// Window rows wanted whose features were gone, over all drafts.
    pub cold_positions: usize,
}

impl std::fmt::Debug for DsparkDrafter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DsparkDrafter").field("config", &self.dm.config).field("sessions", &self.tracks.len()).finish()
    }
}

/// Model files below this size get a one-thread drafter (as the MTP drafter).
const SMALL_MODEL_BYTES: u64 = 1 << 30;

impl DsparkDrafter {
    /// The drafter of `target`'s model file, or `None` when the file has no DSpark drafter.
    pub fn new(target: &Model, opts: DsparkOptions) -> Result<Option<DsparkDrafter>> {
        let Some(dm) = DsparkModel::load(target)? else {
            return Ok(None);
        };
        let threads = if target.file.file_size() < SMALL_MODEL_BYTES { 1 } else { opts.threads };
        let threads = if threads == 0 { std::thread::available_parallelism().map_or(1, |n| n.get()) } else { threads };
        let mut pool = Pool::new(threads);
        pool.set_f32_acts(true);
        let rope = RopeFreqs::new(&dm.model.config.rope_main, dm.model.config.rope_dim);
        Ok(Some(DsparkDrafter { dm, pool, rope, opts, tracks: HashMap::new(), cold_positions: 0 }))
    }

    /// Draft tokens per block.
    pub fn block_size(&self) -> usize {
        self.dm.config.block_size
    }

    /// The trunk layers whose features the drafter reads.
    pub fn target_layers(&self) -> &[usize] {
        &self.dm.config.target_layers
    }

    /// The options.
    pub fn options(&self) -> DsparkOptions {
        self.opts
    }

    /// Sets the confidence cut-off ([`DsparkOptions::min_confidence`]).
    pub fn set_min_confidence(&mut self, p: f32) {
        self.opts.min_confidence = p;
    }

    /// Feature rows a target session keeps for the drafter: the window before the draft point, plus a draft's
    /// worth.
    pub fn rows_needed(&self) -> usize {
        self.dm.model.config.window.max(1) + MAX_DRAFT + 2
    }

    /// The full block (before any confidence cut) for each request: per target session the context (its history
    /// and the chosen next token, which the target has not processed). All blocks run through the stages
    /// together. Sessions not [`Drafter::attach`]ed, or whose target position is not the context's last, get
    /// `None`.
    pub fn propose_many(&mut self, target: &mut Engine, reqs: &[(SessionId, &[u32])]) -> Result<Vec<Option<Proposal>>> {
        let hd = self.dm.model.config.head_dim;
        let mut live = Vec::new();
        for (i, &(tid, ctx)) in reqs.iter().enumerate() {
            if ctx.is_empty() || !self.tracks.contains_key(&tid) || target.position(tid)? + 1 != ctx.len() {
                continue;
            }
            let pos = ctx.len() - 1;
            let (from, rows) = target.take_hidden(tid)?;
            let keys = if rows.is_empty() { Vec::new() } else { self.context_keys(&rows, from)? };
            let keep = self.rows_needed();
            let t = self.tracks.get_mut(&tid).expect("attached");
            t.cut(pos, hd);
            if !keys.is_empty() {
                t.cut(from, hd);
                if t.len(hd) == 0 {
                    t.from = from;
                }
                for (k, new) in t.keys.iter_mut().zip(&keys) {
                    k.extend_from_slice(new);
                }
            }
            let n = t.len(hd);
            if n > keep {
                t.keys.iter_mut().for_each(|k| drop(k.drain(..(n - keep) * hd)));
                t.from += n - keep;
            }
            live.push(i);
        }
        let mut out = vec![None; reqs.len()];
        if live.is_empty() {
            return Ok(out);
        }
        let blocks: Vec<(usize, u32, &Track)> =
            live.iter().map(|&i| (reqs[i].1.len() - 1, *reqs[i].1.last().unwrap(), &self.tracks[&reqs[i].0])).collect();
        let props = self.forward(&blocks)?;
        for (i, p) in live.into_iter().zip(props) {
            self.cold_positions += p.cold;
            out[i] = Some(p);
        }
        Ok(out)
    }

    /// [`DsparkDrafter::propose_many`] with each session's drafts cut by confidence and to its most tokens wanted
    /// (`reqs`: session, context, k; [`MAX_DRAFT`] at most): what a scheduler drafting for many sessions asks.
    pub fn draft_many(&mut self, target: &mut Engine, reqs: &[(SessionId, &[u32], usize)]) -> Result<Vec<Vec<u32>>> {
        let asks: Vec<(SessionId, &[u32])> = reqs.iter().map(|&(s, c, _)| (s, c)).collect();
        let min = self.opts.min_confidence;
        let props = self.propose_many(target, &asks)?;
        Ok(props
            .into_iter()
            .zip(reqs)
            .map(|(p, &(_, _, k))| {
                p.map_or_else(Vec::new, |p| p.cut(min).iter().copied().take(k.min(MAX_DRAFT)).collect())
            })
            .collect())
    }

    /// Context key rows (per stage, `[n, head_dim]`) of `n` target feature rows (`[n, taps·d]`) of positions
    /// `from..`.
    pub fn context_keys(&self, features: &[f32], from: usize) -> Result<Vec<Vec<f32>>> {
        let m = &self.dm.model;
        let c = &m.config;
        let (d, hd, eps) = (c.d_model, c.head_dim, c.rms_eps);
        let fw = self.dm.config.target_layers.len() * d;
        if !features.len().is_multiple_of(fw) {
            return Err(Error::InvalidArgument(format!("DSpark features: {} values, rows of {fw}", features.len())));
        }
        let n = features.len() / fw;
        let mut ctx = vec![0f32; n * d];
        matmul(&self.pool, m.mat(self.dm.weights.main_proj), features, n, &mut ctx)?;
        let w = m.dense(self.dm.weights.main_norm);
        ctx.chunks_exact_mut(d).for_each(|r| norm::rms_norm_inplace(r, w, eps));
        let mut out = Vec::with_capacity(m.layers.len());
        for lw in &m.layers {
            let mut k = vec![0f32; n * hd];
            matmul(&self.pool, m.mat(lw.wkv), &ctx, n, &mut k)?;
            let kn = m.dense(lw.kv_norm);
            for (j, r) in k.chunks_exact_mut(hd).enumerate() {
                norm::rms_norm_inplace(r, kn, eps);
                self.rope.apply(r, from + j, false);
            }
            out.push(k);
        }
        Ok(out)
    }

    /// The stages, head, Markov head and confidence head over blocks `(anchor position, anchor token, track)`.
    fn forward(&self, blocks: &[(usize, u32, &Track)]) -> Result<Vec<Proposal>> {
        let m = &self.dm.model;
        let c = &m.config;
        let cfg = &self.dm.config;
        let (bs, d, hc, v) = (cfg.block_size, c.d_model, c.hc_mult, c.vocab);
        let n = blocks.len() * bs;
        let hcd = hc * d;
        // The block ids' embeddings in every stream.
        let mut x = vec![0f32; n * hcd];
        let emb = m.mat(m.global.embed);
        let mut row = vec![0f32; d];
        for (b, &(_, anchor, _)) in blocks.iter().enumerate() {
            for i in 0..bs {
                let tok = if i == 0 { anchor } else { cfg.noise_token };
                if tok as usize >= emb.rows {
                    return Err(Error::InvalidArgument(format!("token {tok} outside the vocabulary")));
                }
                crate::backend::cpu::matmul::dequant_row(emb.ty, emb.row(tok as usize), &mut row)?;
                for j in 0..hc {
                    let at = ((b * bs + i) * hc + j) * d;
                    x[at..at + d].copy_from_slice(&row);
                }
            }
        }
        let pos: Vec<usize> = blocks.iter().flat_map(|&(a, _, _)| a..a + bs).collect();
        let mut cold = vec![0usize; blocks.len()];
        for (s, lw) in m.layers.iter().enumerate() {
            let (u, post, comb) = self.hc_pre(&x, n, lw.hc_attn)?;
            let f = self.attention(s, lw, &u, &pos, blocks, &mut cold)?;
            hc_post(&mut x, &f, &post, &comb, hc, d);
            let (u, post, comb) = self.hc_pre(&x, n, lw.hc_ffn)?;
            let f = self.moe(s, lw, &u, n)?;
            hc_post(&mut x, &f, &post, &comb, hc, d);
        }
        // Head: the last stage's mHC head and norm, the target's output matrix.
        let g = &m.global;
        let mut vn = x.clone();
        vn.chunks_exact_mut(hcd).for_each(|r| norm::rms_norm_unweighted(r, c.rms_eps));
        let mut mix = vec![0f32; n * hc];
        matmul(&self.pool, m.mat(g.hc_fn), &vn, n, &mut mix)?;
        let mut x_post = vec![0f32; n * d];
        let mut pre = vec![0f32; hc];
        let (base, scale) = (m.dense(g.hc_base), m.dense(g.hc_scale)[0]);
        for r in 0..n {
            hc::head_weights(&mix[r * hc..(r + 1) * hc], base, scale, c.hc_eps, &mut pre);
            hc::collapse(&x[r * hcd..(r + 1) * hcd], &pre, d, &mut x_post[r * d..(r + 1) * d]);
        }
        let mut h = x_post.clone();
        let nw = m.dense(g.norm);
        h.chunks_exact_mut(d).for_each(|r| norm::rms_norm_inplace(r, nw, c.rms_eps));
        let mut base_logits = vec![0f32; n * v];
        matmul(&self.pool, m.mat(g.head), &h, n, &mut base_logits)?;
        // Markov head and confidence, row by row within each block.
        let w = &self.dm.weights;
        let (w1, w2, rank) = (m.mat(w.markov_w1), m.mat(w.markov_w2), cfg.markov_rank);
        let conf_w = m.dense(w.confidence);
        let mut e = vec![0f32; rank];
        let mut bias = vec![0f32; v];
        let mut out = Vec::with_capacity(blocks.len());
        for (b, &(_, anchor, _)) in blocks.iter().enumerate() {
            let mut prev = anchor;
            let mut p = Proposal {
                tokens: Vec::with_capacity(bs),
                x_post: x_post[b * bs * d..(b + 1) * bs * d].to_vec(),
                base_logits: base_logits[b * bs * v..(b + 1) * bs * v].to_vec(),
                logits: vec![0f32; bs * v],
                confidence: Vec::with_capacity(bs),
                cold: cold[b],
            };
            for i in 0..bs {
                crate::backend::cpu::matmul::dequant_row(w1.ty, w1.row(prev as usize), &mut e)?;
                matmul(&self.pool, w2, &e, 1, &mut bias)?;
                let z = &mut p.logits[i * v..(i + 1) * v];
                for ((o, &bl), &bi) in z.iter_mut().zip(&p.base_logits[i * v..(i + 1) * v]).zip(&bias) {
                    *o = bl + bi;
                }
                let xp = &p.x_post[i * d..(i + 1) * d];
                let logit: f32 = conf_w[..d].iter().zip(xp).map(|(a, b)| a * b).sum::<f32>()
                    + conf_w[d..].iter().zip(&e).map(|(a, b)| a * b).sum::<f32>();
                p.confidence.push(1.0 / (1.0 + (-logit).exp()));
                prev = argmax(z);
                p.tokens.push(prev);
            }
            out.push(p);
        }
        Ok(out)
    }

    /// mHC pre-mix of every row: the collapsed sublayer input `[n, d]`, and `post` `[n, hc]`, `comb` `[n, hc·hc]`.
    fn hc_pre(&self, x: &[f32], n: usize, w: HcWeights) -> Result<HcMix> {
        let m = &self.dm.model;
        let c = &m.config;
        let (hc, d, mixn) = (c.hc_mult, c.d_model, c.hc_mix());
        let mut vn = x.to_vec();
        vn.chunks_exact_mut(hc * d).for_each(|r| norm::rms_norm_unweighted(r, c.rms_eps));
        let mut mix = vec![0f32; n * mixn];
        matmul(&self.pool, m.mat(w.fn_), &vn, n, &mut mix)?;
        let (base, scale) = (m.dense(w.base), m.dense(w.scale));
        let (mut u, mut post, mut comb) = (vec![0f32; n * d], vec![0f32; n * hc], vec![0f32; n * hc * hc]);
        let mut pre = vec![0f32; hc];
        for r in 0..n {
            hc::hc_weights(
                &mix[r * mixn..(r + 1) * mixn],
                base,
                scale,
                hc,
                c.hc_eps,
                c.hc_sinkhorn_iters,
                &mut pre,
                &mut post[r * hc..(r + 1) * hc],
                &mut comb[r * hc * hc..(r + 1) * hc * hc],
            );
            hc::collapse(&x[r * hc * d..(r + 1) * hc * d], &pre, d, &mut u[r * d..(r + 1) * d]);
        }
        Ok((u, post, comb))
    }

    /// Stage `s`'s attention sublayer (normed input to output projection) over the blocks' rows `u` `[n, d]`.
    fn attention(
        &self,
        s: usize,
        lw: &LayerWeights,
        u: &[f32],
        pos: &[usize],
        blocks: &[(usize, u32, &Track)],
        cold: &mut [usize],
    ) -> Result<Vec<f32>> {
        let m = &self.dm.model;
        let c = &m.config;
        let (d, hd, nh, eps, bs) = (c.d_model, c.head_dim, c.n_heads, c.rms_eps, self.dm.config.block_size);
        let n = pos.len();
        let mut xn = u.to_vec();
        let an = m.dense(lw.attn_norm);
        xn.chunks_exact_mut(d).for_each(|r| norm::rms_norm_inplace(r, an, eps));
        let mut ql = vec![0f32; n * c.q_lora_rank];
        matmul(&self.pool, m.mat(lw.wq_a), &xn, n, &mut ql)?;
        let qn = m.dense(lw.q_norm);
        ql.chunks_exact_mut(c.q_lora_rank).for_each(|r| norm::rms_norm_inplace(r, qn, eps));
        let mut q = vec![0f32; n * nh * hd];
        matmul(&self.pool, m.mat(lw.wq_b), &ql, n, &mut q)?;
        for (j, r) in q.chunks_exact_mut(hd).enumerate() {
            norm::rms_norm_unweighted(r, eps);
            self.rope.apply(r, pos[j / nh], false);
        }
        let mut kv = vec![0f32; n * hd];
        matmul(&self.pool, m.mat(lw.wkv), &xn, n, &mut kv)?;
        let kn = m.dense(lw.kv_norm);
        for (j, r) in kv.chunks_exact_mut(hd).enumerate() {
            norm::rms_norm_inplace(r, kn, eps);
            self.rope.apply(r, pos[j], false);
        }
        let sinks = m.dense(lw.sinks);
        let scale = 1.0 / (hd as f32).sqrt();
        let window = c.window.max(1);
        let mut o = vec![0f32; n * nh * hd];
        let mut keys: Vec<&[f32]> = Vec::new();
        let mut sc = Vec::new();
        for (b, &(a, _, t)) in blocks.iter().enumerate() {
            keys.clear();
            let lo = a.saturating_sub(window);
            let have = t.from..t.from + t.len(hd);
            for p in lo..a {
                if have.contains(&p) {
                    let r = (p - t.from) * hd;
                    keys.push(&t.keys[s][r..r + hd]);
                } else if s == 0 {
                    cold[b] += 1;
                }
            }
            keys.extend(kv[b * bs * hd..(b + 1) * bs * hd].chunks_exact(hd));
            for i in 0..bs {
                let r = b * bs + i;
                let oh = &mut o[r * nh * hd..(r + 1) * nh * hd];
                let key = |j: usize| keys[j];
                attend(&q[r * nh * hd..(r + 1) * nh * hd], &sinks[..nh], keys.len(), &key, scale, &mut sc, oh);
                oh.chunks_exact_mut(hd).for_each(|h| self.rope.apply(h, pos[r], true));
            }
        }
        // Grouped output projection: group g of the heads' outputs through rows g·rank.. of wo_a.
        let (groups, rank) = (c.o_groups, c.o_lora_rank);
        let gs = nh * hd / groups;
        let wo_a = m.mat(lw.wo_a);
        let mut olow = vec![0f32; n * groups * rank];
        let mut xg = vec![0f32; n * gs];
        let mut yg = vec![0f32; n * rank];
        for g in 0..groups {
            for r in 0..n {
                xg[r * gs..(r + 1) * gs].copy_from_slice(&o[r * nh * hd + g * gs..r * nh * hd + (g + 1) * gs]);
            }
            matmul(&self.pool, wo_a.rows_slice(g * rank, rank), &xg, n, &mut yg)?;
            for r in 0..n {
                olow[r * groups * rank + g * rank..r * groups * rank + (g + 1) * rank]
                    .copy_from_slice(&yg[r * rank..(r + 1) * rank]);
            }
        }
        let mut out = vec![0f32; n * d];
        matmul(&self.pool, m.mat(lw.wo_b), &olow, n, &mut out)?;
        Ok(out)
    }

    /// Stage `s`'s MoE sublayer (learned routing, as the trunk's learned layers; plus the shared expert).
    fn moe(&self, s: usize, lw: &LayerWeights, u: &[f32], n: usize) -> Result<Vec<f32>> {
        let m = &self.dm.model;
        let c = &m.config;
        let (d, ne, k, ffn, eps) = (c.d_model, c.n_experts, c.n_experts_used, c.expert_ffn, c.rms_eps);
        let limit = c.swiglu_limit[s];
        let mut xn = u.to_vec();
        let fnw = m.dense(lw.ffn_norm);
        xn.chunks_exact_mut(d).for_each(|r| norm::rms_norm_inplace(r, fnw, eps));
        let mut router = vec![0f32; n * ne];
        matmul(&self.pool, m.mat(lw.gate), &xn, n, &mut router)?;
        let bias = lw.gate_bias.map(|b| m.dense(b));
        let (gate, up, down) = (m.mat(lw.gate_exps), m.mat(lw.up_exps), m.mat(lw.down_exps));
        let mut out = vec![0f32; n * d];
        let (mut h1, mut h3, mut y) = (vec![0f32; ffn], vec![0f32; ffn], vec![0f32; d]);
        let (mut sel, mut wts) = (vec![0u32; k], vec![0f32; k]);
        for r in 0..n {
            let x = &xn[r * d..(r + 1) * d];
            let scores = &mut router[r * ne..(r + 1) * ne];
            moe::router_scores(scores);
            moe::top_k_biased(scores, bias, &mut sel);
            moe::routing_weights(scores, &sel, c.weights_norm, c.routed_scale, &mut wts);
            let mut chosen: Vec<(usize, f32)> = sel.iter().map(|&e| e as usize).zip(wts.iter().copied()).collect();
            chosen.sort_by_key(|&(e, _)| e);
            let o = &mut out[r * d..(r + 1) * d];
            for (e, w) in chosen {
                matmul(&self.pool, gate.rows_slice(e * ffn, ffn), x, 1, &mut h1)?;
                matmul(&self.pool, up.rows_slice(e * ffn, ffn), x, 1, &mut h3)?;
                moe::swiglu(&mut h1, &h3, limit);
                h1.iter_mut().for_each(|a| *a *= w);
                matmul(&self.pool, down.rows_slice(e * d, d), &h1, 1, &mut y)?;
                o.iter_mut().zip(&y).for_each(|(a, b)| *a += b);
            }
            if let (Some(g), Some(up_sh), Some(dn)) = (lw.gate_sh, lw.up_sh, lw.down_sh) {
                matmul(&self.pool, m.mat(g), x, 1, &mut h1)?;
                matmul(&self.pool, m.mat(up_sh), x, 1, &mut h3)?;
                moe::swiglu(&mut h1, &h3, limit);
                matmul(&self.pool, m.mat(dn), &h1, 1, &mut y)?;
                o.iter_mut().zip(&y).for_each(|(a, b)| *a += b);
            }
        }
        Ok(out)
    }
}

/// A sublayer input and its post-mix weights.
type HcMix = (Vec<f32>, Vec<f32>, Vec<f32>);

fn hc_post(x: &mut [f32], f: &[f32], post: &[f32], comb: &[f32], hc: usize, d: usize) {
    let mut tmp = vec![0f32; hc * d];
    for (r, xr) in x.chunks_exact_mut(hc * d).enumerate() {
        hc::post_mix(xr, &f[r * d..(r + 1) * d], &post[r * hc..(r + 1) * hc], &comb[r * hc * hc..], hc, d, &mut tmp);
    }
}

impl Drafter for DsparkDrafter {
    fn attach(&mut self, target: &mut Engine, session: SessionId) -> Result<()> {
        if target.tap_layers() != self.dm.config.target_layers.as_slice() {
            target.set_tap_layers(&self.dm.config.target_layers)?;
        }
        target.set_keep_hidden(session, self.rows_needed())?;
        let stages = self.dm.model.layers.len();
        self.tracks.insert(session, Track { from: 0, keys: vec![Vec::new(); stages] });
        Ok(())
    }

    fn detach(&mut self, target: &mut Engine, session: SessionId) {
        let _ = target.set_keep_hidden(session, 0);
        self.tracks.remove(&session);
    }

    fn draft(&mut self, target: &mut Engine, session: SessionId, context: &[u32], k: usize) -> Result<Vec<u32>> {
        Ok(self.draft_many(target, &[(session, context, k)])?.pop().unwrap_or_default())
    }
}
