//! Shared helpers for the kv integration tests: a fake "engine" that produces deterministic rows from token ids,
//! shaped like DeepSeek V4 Flash state (CSA layers: 512-d KV rows + 128-d indexer rows per 4 tokens; HCA layers: one
//! 512-d row per 128 tokens), with FP8-rounded non-rope dims and bf16-exact rope dims like the live engine.
#![allow(dead_code)]

use ds4_kv::{KvOptions, KvStore, ModelIdentity, RowBlock, RowsView};

pub const SPAN: u32 = 128;

pub fn identity() -> ModelIdentity {
    ModelIdentity::new("deepseek4-flash-test layers=3 dim=512 quant=q2 sim=1")
}

pub fn opts(budget: u64) -> KvOptions {
    KvOptions { span_tokens: SPAN, span_multiple_of: 128, disk_budget_bytes: budget, ..KvOptions::default() }
}

pub fn open(dir: &std::path::Path, budget: u64) -> KvStore {
    KvStore::open(dir, identity(), opts(budget)).expect("open")
}

fn mix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51afd7ed558ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ceb9fe1a85ec53);
    x ^ (x >> 33)
}

/// A value in [-1, 1) from a seed.
pub fn val(seed: u64) -> f32 {
    (mix(seed) >> 40) as f32 / (1u64 << 23) as f32 - 1.0
}

/// A 512-d KV row: 448 dims on an FP8 e4m3 grid with a power-of-two scale per 64, then 64 bf16 rope dims.
pub fn kv_row(seed: u64) -> Vec<f32> {
    let mut r = Vec::with_capacity(512);
    for b in 0..7u64 {
        let scale = (2f32).powi((mix(seed ^ b) % 8) as i32 - 10);
        for i in 0..64u64 {
            // e4m3 values with 3 mantissa bits: m/8 * 2^e
            let m = 8 + (mix(seed.wrapping_mul(31).wrapping_add(b * 64 + i)) % 8) as i32;
            let e = (mix(seed.wrapping_add(b * 1000 + i)) % 6) as i32;
            let s = if mix(seed ^ (i << 7)) & 1 == 0 { 1.0 } else { -1.0 };
            r.push(s * m as f32 / 8.0 * (2f32).powi(e) * scale);
        }
    }
    for i in 0..64u64 {
        r.push(half::bf16::from_f32(val(seed.wrapping_mul(7).wrapping_add(i))).to_f32());
    }
    r
}

/// Rows of one page: layer 0 CSA (KV + indexer), layer 1 HCA, layer 2 ratio-0 (nothing), all from the span's tokens.
pub struct PageRows {
    pub csa_kv: Vec<f32>,
    pub csa_idx: Vec<f32>,
    pub hca: Vec<f32>,
}

pub fn page_rows(start: u64, tokens: &[u32]) -> PageRows {
    let seed: u64 = tokens.iter().fold(start, |a, &t| mix(a ^ t as u64));
    let csa_kv = (0..tokens.len() as u64 / 4).flat_map(|r| kv_row(seed.wrapping_add(r))).collect();
    let csa_idx = (0..tokens.len() as u64 / 4 * 128).map(|i| half::f16::from_f32(val(seed ^ i)).to_f32()).collect();
    let hca = (0..tokens.len() as u64 / 128).flat_map(|r| kv_row((seed ^ 0xabc).wrapping_add(r))).collect();
    PageRows { csa_kv, csa_idx, hca }
}

impl PageRows {
    pub fn layers(&self) -> Vec<Vec<RowBlock<'_>>> {
        vec![
            vec![
                RowBlock { tag: 0, rows: (self.csa_kv.len() / 512) as u32, width: 512, values: &self.csa_kv },
                RowBlock { tag: 1, rows: (self.csa_idx.len() / 128) as u32, width: 128, values: &self.csa_idx },
            ],
            vec![RowBlock { tag: 0, rows: (self.hca.len() / 512) as u32, width: 512, values: &self.hca }],
            vec![],
        ]
    }
}

/// A checkpoint blob: raw window (random f32, not compressible), frontier, logits.
pub fn checkpoint_rows(tokens: &[u32], window_values: usize) -> Vec<f32> {
    let seed = tokens.iter().fold(99u64, |a, &t| mix(a ^ t as u64));
    (0..window_values as u64).map(|i| val(seed.wrapping_add(i)) * 3.0).collect()
}

/// Collects every block a load hands over.
/// A loaded block: (group, tag, rows, width, values).
pub type Block = (u32, u32, u32, u32, Vec<f32>);

pub fn collect(store: &KvStore, key: &ds4_kv::Key) -> ds4_kv::KvResult<Vec<Block>> {
    let mut out = Vec::new();
    store.load(key, |v: RowsView<'_>| {
        out.push((v.group, v.tag, v.rows, v.width, v.values.to_vec()));
        Ok(())
    })?;
    Ok(out)
}

/// Saves a whole session: missing pages in order, then a checkpoint with `window_values` values at the end.
pub fn save_session(store: &KvStore, tokens: &[u32], window_values: usize) -> ds4_kv::KvResult<ds4_kv::EntryRef> {
    let span = store.span_tokens() as usize;
    let have = store.page_chain(tokens);
    let mut parent = have.last().map(|r| r.key).unwrap_or(store.root());
    for (p, s) in tokens.chunks_exact(span).enumerate().skip(have.len()) {
        let rows = page_rows((p * span) as u64, s);
        parent = store.put_page(&parent, s, &rows.layers(), ds4_kv::SaveReason::Continued)?.key;
    }
    let tail = &tokens[tokens.len() / span * span..];
    let ck = checkpoint_rows(tokens, window_values);
    store.put_checkpoint(
        &parent,
        tail,
        &[vec![RowBlock { tag: 7, rows: 1, width: ck.len() as u32, values: &ck }]],
        ds4_kv::SaveReason::Evict,
    )
}

/// `n` tokens derived from `seed`.
pub fn tokens(seed: u64, n: usize) -> Vec<u32> {
    (0..n as u64).map(|i| (mix(seed.wrapping_mul(1_000_003).wrapping_add(i)) % 129_280) as u32).collect()
}
