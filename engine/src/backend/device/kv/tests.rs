//! The layer's page tables, fork and roll back on the mock device ([`super::super::mock`]), against the host
//! tables' rules ([`crate::tables::kv`]): the same token inputs drive a host `SessionKv` and a device mirror (log
//! records, ring stores, frontier pushes with `ape`, emitted rows appended), and every download must equal the host
//! state, after steps, after a fork stepped apart from its parent, and after roll backs.

use super::super::mock::MockDevice;
use super::*;
use crate::model::Model;
use crate::tables::kv::LayerApes;

/// A deterministic input value.
fn val(seed: u64, p: usize, l: usize, what: u64, i: usize) -> f32 {
    let mut h = seed ^ (p as u64) << 20 ^ (l as u64) << 40 ^ what << 50 ^ i as u64;
    h = h.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    ((h >> 40) % 2001) as f32 / 1000.0 - 1.0
}

struct Inputs {
    raw: Vec<f32>,
    /// `(kv, gate)` of the main and the indexer compressor (where the layer has them).
    comp: Option<(Vec<f32>, Vec<f32>)>,
    idx: Option<(Vec<f32>, Vec<f32>)>,
}

fn inputs(cfg: &ModelConfig, kv: &SessionKv, seed: u64, p: usize, l: usize) -> Inputs {
    let v = |what: u64, n: usize| (0..n).map(|i| val(seed, p, l, what, i)).collect::<Vec<_>>();
    let lk = &kv.layers[l];
    let pair = |f: &Option<Frontier>, a: u64| f.as_ref().map(|f| (v(a, f.coff * f.dim), v(a + 1, f.coff * f.dim)));
    Inputs { raw: v(0, cfg.head_dim), comp: pair(&lk.comp, 1), idx: pair(&lk.idx, 3) }
}

/// The row a compressor emits at the end of the block ending at `p` (any values: the layer only stores it).
fn emitted(p: usize, l: usize, idx: bool, dim: usize) -> Vec<f32> {
    (0..dim).map(|i| val(7, p, l, 9 + idx as u64, i)).collect()
}

/// One token on the host: log, ring, frontier push (gate + ape), emitted row, CSA carry.
fn step_host(cfg: &ModelConfig, kv: &mut SessionKv, apes: &[LayerApes<'_>], seed: u64, p: usize) {
    #[allow(clippy::needless_range_loop)] // `l` also seeds the inputs
    for l in 0..cfg.n_layers {
        let x = inputs(cfg, kv, seed, p, l);
        let lk = &mut kv.layers[l];
        let (c, i) = (x.comp.as_ref(), x.idx.as_ref());
        lk.log.record(p, &x.raw, c.map(|c| (&c.0[..], &c.1[..])), i.map(|c| (&c.0[..], &c.1[..])));
        let hd = cfg.head_dim;
        let s = p % cfg.window;
        lk.ring[s * hd..(s + 1) * hd].copy_from_slice(&x.raw);
        for (f, rows, inp, ape, idx) in [
            (&mut lk.comp, &mut lk.comp_rows, c, apes[l].0, false),
            (&mut lk.idx, &mut lk.idx_rows, i, apes[l].1, true),
        ] {
            let (Some(f), Some((kvi, gi)), Some(ape)) = (f.as_mut(), inp, ape) else { continue };
            let (m, w, dim) = (f.ratio, f.coff * f.dim, f.dim);
            let j = p % m;
            f.pending_kv[j * w..(j + 1) * w].copy_from_slice(kvi);
            for c in 0..w {
                f.pending_gate[j * w + c] = gi[c] + ape[j * w + c];
            }
            f.n_pending = j + 1;
            if j + 1 == m {
                rows.push(&emitted(p, l, idx, dim));
                f.n_pending = 0;
                if f.coff == 2 {
                    for b in 0..m {
                        f.prev_kv[b * dim..(b + 1) * dim].copy_from_slice(&f.pending_kv[b * w..b * w + dim]);
                        f.prev_gate[b * dim..(b + 1) * dim].copy_from_slice(&f.pending_gate[b * w..b * w + dim]);
                    }
                    f.has_prev = true;
                }
            }
        }
    }
}

type MockApes = Vec<(Option<<MockDevice as DeviceMem>::Buf>, Option<<MockDevice as DeviceMem>::Buf>)>;

/// The same token on the device mirror `m`, with the layer's operations only.
#[allow(clippy::too_many_arguments)]
fn step_dev(
    dev: &MockDevice,
    cfg: &ModelConfig,
    host: &SessionKv,
    m: &mut SlotKv<MockDevice>,
    pools: &mut [LayerPools<MockDevice>],
    apes: &MockApes,
    seed: u64,
    p: usize,
) -> u64 {
    let mut enc = dev.encoder();
    let mut copied = 0;
    for l in 0..cfg.n_layers {
        let x = inputs(cfg, host, seed, p, l);
        let up = |v: &Option<(Vec<f32>, Vec<f32>)>| {
            v.as_ref().map(|(a, b)| (dev.upload_f32("kv", a), dev.upload_f32("gate", b)))
        };
        let (raw, c, i) = (dev.upload_f32("raw", &x.raw), up(&x.comp), up(&x.idx));
        let (ld, lp) = (&mut m.layers[l], &mut pools[l]);
        let src = LogSources { raw: &raw, comp: c.as_ref().map(|(a, b)| (a, b)), idx: i.as_ref().map(|(a, b)| (a, b)) };
        let log = ld.log.as_mut().expect("a log");
        copied += log.record(dev, &mut enc, lp.log.as_mut().expect("log pools"), &src, 0, p, 1).unwrap();
        copy_rows(dev, &mut enc, &raw, &ld.ring, &[(0, p % cfg.window)], cfg.head_dim);
        for (f, rows, pool, inp, ape, idx) in [
            (&ld.fcomp, ld.comp.as_mut(), lp.comp.as_mut(), &c, &apes[l].0, false),
            (&ld.fidx, ld.idx.as_mut(), lp.idx.as_mut(), &i, &apes[l].1, true),
        ] {
            let (Some(f), Some(rows), Some(pool), Some((kvb, gb)), Some(ape)) = (f, rows, pool, inp, ape) else {
                continue;
            };
            let (m, w) = (f.ratio, f.coff * f.dim);
            let j = p % m;
            copy_rows(dev, &mut enc, kvb, &f.kv, &[(0, m + j)], w);
            copy_rows(dev, &mut enc, gb, &f.gate, &[(0, m + j)], w);
            dev.add_ape(&mut enc, &f.gate, (m + j) * w, 1, w, ape, j, m).unwrap();
            if j + 1 == m {
                let row = dev.upload_f32("row", &emitted(p, l, idx, f.dim));
                copied += rows.append(dev, &mut enc, pool, &row, 0, 1).unwrap();
                if f.coff == 2 {
                    let hop = dev.temp(m * w);
                    for b in [&f.kv, &f.gate] {
                        dev.copy(&mut enc, b, (m * w * 4) as u64, &hop, 0, (m * w * 4) as u64);
                        dev.copy(&mut enc, &hop, 0, b, 0, (m * w * 4) as u64);
                    }
                }
            }
        }
        ld.pos = Some(p + 1);
    }
    dev.submit(enc).unwrap();
    copied
}

/// Asserts the device mirror downloads to `want`'s state.
fn same(
    dev: &MockDevice,
    cfg: &ModelConfig,
    m: &SlotKv<MockDevice>,
    pools: &[LayerPools<MockDevice>],
    want: &SessionKv,
    what: &str,
) {
    let mut got = SessionKv::new(cfg, 4096);
    m.download(dev, pools, &mut got).unwrap();
    for (l, (g, w)) in got.layers.iter().zip(&want.layers).enumerate() {
        assert!(g.ring == w.ring, "{what}: layer {l} ring");
        assert!(g.comp_rows.to_vec() == w.comp_rows.to_vec(), "{what}: layer {l} compressed rows");
        assert!(g.idx_rows.to_vec() == w.idx_rows.to_vec(), "{what}: layer {l} indexer rows");
        assert!(g.comp == w.comp, "{what}: layer {l} compressor frontier");
        assert!(g.idx == w.idx, "{what}: layer {l} indexer frontier");
    }
}

#[test]
fn steps_fork_and_roll_back_match_the_host_tables() {
    let model =
        Model::load(crate::gguf::GgufFile::from_bytes(crate::convert::demo::demo_model_gguf(7).unwrap()).unwrap())
            .unwrap();
    let cfg = &model.config;
    assert!((0..cfg.n_layers).any(|l| cfg.layer_kind(l) == LayerKind::Csa), "a CSA layer is exercised");
    let host_apes: Vec<LayerApes<'_>> = model
        .layers
        .iter()
        .map(|l| {
            let ape = |id| model.dense(id);
            (l.compressor.as_ref().map(|c| ape(c.ape)), l.indexer.as_ref().map(|i| ape(i.comp.ape)))
        })
        .collect();
    let dev = MockDevice::new(None);
    let dev_apes: MockApes = host_apes
        .iter()
        .map(|(a, b)| (a.map(|a| dev.upload_f32("ape", a)), b.map(|b| dev.upload_f32("ape", b))))
        .collect();
    let (ctx, r) = (4096, 40);
    let mut host = SessionKv::new(cfg, ctx);
    host.enable_log(cfg, ctx, r);
    let mut dk = DevKv::<MockDevice>::default();
    let mut enc = dev.encoder();
    let pools = dk.pools(&dev, cfg).unwrap();
    let mirror = SlotKv::upload(&dev, &mut enc, cfg, &host, r, pools).unwrap();
    dev.submit(enc).unwrap();
    dk.insert(0, mirror);
    let n = 100;
    {
        let DevKv { slots, pools } = &mut dk;
        let m = slots.get_mut(&0).unwrap();
        for p in 0..n {
            step_host(cfg, &mut host, &host_apes, 1, p);
            assert_eq!(step_dev(&dev, cfg, &host, m, pools, &dev_apes, 1, p), 0, "nothing shared yet");
        }
        same(&dev, cfg, m, pools, &host, "after the steps");
        assert_eq!(m.rollback_floor(cfg, n), host.rollback_floor(cfg, n));
    }
    // Fork: rows and log chunks shared, only the rings and frontiers copied.
    let (live, _) = dk.pages();
    let before = dev.copied_bytes();
    let mut enc = dev.encoder();
    let DevKv { slots, pools } = &mut dk;
    let (fork, bytes) = slots[&0].duplicate(&dev, &mut enc, pools).unwrap();
    dev.submit(enc).unwrap();
    let tail: u64 = slots[&0]
        .layers
        .iter()
        .map(|l| {
            let f = |f: &Option<FrontDev<MockDevice>>| f.as_ref().map_or(0, |f| 2 * 2 * f.ratio * f.coff * f.dim);
            ((l.ring_len + f(&l.fcomp) + f(&l.fidx)) * 4) as u64
        })
        .sum();
    assert_eq!(bytes, tail, "a fork copies the rings and frontiers only");
    let ids: usize = slots[&0]
        .layers
        .iter()
        .map(|l| l.comp.as_ref().map_or(0, |t| t.ids.len()) + l.idx.as_ref().map_or(0, |t| t.ids.len()))
        .sum();
    assert_eq!(dev.copied_bytes() - before, tail + 4 * ids as u64, "besides them, only page ids: no KV row");
    dk.insert(1, fork);
    let (live2, shared) = dk.pages();
    assert_eq!((live2, shared), (live, live), "every page and log chunk shared, none allocated");
    // Parent and fork step apart: copy on write keeps each one's rows.
    let mut host_fork = host.fork();
    let DevKv { slots, pools } = &mut dk;
    let mut cow = 0;
    for p in n..n + 7 {
        step_host(cfg, &mut host, &host_apes, 1, p);
        step_host(cfg, &mut host_fork, &host_apes, 2, p);
        cow += step_dev(&dev, cfg, &host, slots.get_mut(&0).unwrap(), pools, &dev_apes, 1, p);
        cow += step_dev(&dev, cfg, &host_fork, slots.get_mut(&1).unwrap(), pools, &dev_apes, 2, p);
    }
    assert!(cow > 0, "the first writes into shared pages and chunks copied them");
    same(&dev, cfg, &slots[&0], pools, &host, "parent after the fork");
    same(&dev, cfg, &slots[&1], pools, &host_fork, "fork");
    // Roll backs: the fork to several lengths, down to its floor; below it, nothing changes.
    let mut pos = n + 7;
    let floor = slots[&1].rollback_floor(cfg, pos);
    assert_eq!(floor, host_fork.rollback_floor(cfg, pos));
    assert!(floor > 0 && floor < n, "{floor}");
    let below = floor - 1;
    let apes: Vec<_> = dev_apes.iter().map(|(a, b)| (a.as_ref(), b.as_ref())).collect();
    let mut enc = dev.encoder();
    assert!(!slots.get_mut(&1).unwrap().rollback(&dev, &mut enc, cfg, &apes, pools, pos, below).unwrap());
    assert!(enc.is_empty(), "a refused roll back records nothing");
    dev.submit(enc).unwrap();
    for len in [pos - 1, n + 2, n - 3, floor] {
        let mut enc = dev.encoder();
        assert!(slots.get_mut(&1).unwrap().rollback(&dev, &mut enc, cfg, &apes, pools, pos, len).unwrap());
        dev.submit(enc).unwrap();
        assert!(host_fork.rollback(cfg, &host_apes, pos, len));
        same(&dev, cfg, &slots[&1], pools, &host_fork, &format!("fork rolled back to {len}"));
        pos = len;
    }
    // The fork goes on from its roll back; the parent is untouched.
    for p in pos..pos + 5 {
        step_host(cfg, &mut host_fork, &host_apes, 3, p);
        step_dev(&dev, cfg, &host_fork, slots.get_mut(&1).unwrap(), pools, &dev_apes, 3, p);
    }
    same(&dev, cfg, &slots[&1], pools, &host_fork, "fork stepped after its roll back");
    same(&dev, cfg, &slots[&0], pools, &host, "parent");
    dk.remove(1);
    dk.remove(0);
    assert_eq!(dk.pages(), (0, 0), "releasing both mirrors returns every page and chunk");
    assert_eq!(dev.pending(), 0, "every encoder was submitted");
}
