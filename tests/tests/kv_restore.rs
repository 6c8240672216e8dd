//! The KV disk tier end to end at the engine level: a session saved with `ds4_engine::persist::save` and restored
//! with `restore_longest` (in a fresh engine, as after a restart) continues with bit-identical logits to a session
//! that prefilled everything; a common prefix of two sessions is stored once; a store written by another model or
//! mode is never reused. Models: tiny-a converted with the f32 recipe (needs `../shared`) and the built-in demo
//! model, each in exact and simulation mode.

use std::path::Path;

use ds4_engine::engine::{argmax, Engine, EngineOptions};
use ds4_engine::gguf::GgufFile;
use ds4_engine::persist;
use ds4_kv::SaveReason;
use ds4_tests::{bits, golden_gguf, shared, tokens};

#[derive(Clone, Copy)]
enum Model<'a> {
    File(&'a Path),
    Demo,
}

fn open(m: Model<'_>, exact: bool) -> Engine {
    let opts = EngineOptions { exact, threads: 2, max_batch_tokens: 48, ctx: 1024, ..EngineOptions::default() };
    match m {
        Model::File(p) => Engine::open(p, opts).expect("open engine"),
        Model::Demo => {
            let bytes = ds4_engine::convert::demo_model_gguf(7).expect("demo model");
            Engine::from_gguf(GgufFile::from_bytes(bytes).expect("demo gguf"), opts).expect("demo engine")
        }
    }
}

fn files(dir: &Path, ext: &str) -> (usize, u64) {
    let mut n = 0;
    let mut bytes = 0;
    for e in std::fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        if e.path().extension().is_some_and(|x| x == ext) {
            n += 1;
            bytes += e.metadata().unwrap().len();
        }
    }
    (n, bytes)
}

/// Logits after feeding `all` in one go, then `gen` greedy tokens (each step's logits).
fn reference(m: Model<'_>, exact: bool, all: &[u32], gen: usize) -> Vec<Vec<u32>> {
    let mut e = open(m, exact);
    let s = e.create_session();
    e.feed(s, all).unwrap();
    e.run_until_idle().unwrap();
    let mut out = vec![bits(e.logits(s).unwrap())];
    for _ in 0..gen {
        let t = argmax(e.logits(s).unwrap());
        e.feed(s, &[t]).unwrap();
        e.run_until_idle().unwrap();
        out.push(bits(e.logits(s).unwrap()));
    }
    out
}

fn round_trip(m: Model<'_>, exact: bool) {
    let dir = tempfile::tempdir().unwrap();
    let e0 = open(m, exact);
    let vocab = e0.config().vocab;
    let opts = persist::kv_options(e0.config(), 32, 64 << 20);
    let span = opts.span_tokens as usize;
    drop(e0);

    // A history of 3 full spans + a partial one, then a suffix prompt.
    let history = tokens(1, 3 * span + 11, vocab);
    let suffix = tokens(2, 9, vocab);
    let all: Vec<u32> = history.iter().chain(&suffix).copied().collect();
    let want = reference(m, exact, &all, 4);

    {
        let mut e = open(m, exact);
        let store = persist::open_store(&e, dir.path(), opts.clone()).unwrap();
        let s = e.create_session();
        e.feed(s, &history).unwrap();
        e.run_until_idle().unwrap();
        let info = persist::save(&store, &e, s, SaveReason::Shutdown).unwrap();
        assert_eq!((info.position, info.pages, info.pages_written), (history.len(), 3, 3));
        assert_eq!(info.restore_points, vec![3 * span], "a restore point at the last page boundary");
    }
    assert_eq!(files(dir.path(), "page").0, 3);
    assert_eq!(files(dir.path(), "ckpt").0, 2);

    // A fresh engine and store on the same directory (a restart).
    let mut e = open(m, exact);
    let store = persist::open_store(&e, dir.path(), opts.clone()).unwrap();
    let (s, matched) = persist::restore_longest(&store, &mut e, &all).unwrap().expect("cached prefix");
    assert_eq!(matched, history.len());
    assert_eq!(e.history(s).unwrap(), &history[..]);
    e.feed(s, &all[matched..]).unwrap();
    e.run_until_idle().unwrap();
    let mut got = vec![bits(e.logits(s).unwrap())];
    for _ in 0..4 {
        let t = argmax(e.logits(s).unwrap());
        e.feed(s, &[t]).unwrap();
        e.run_until_idle().unwrap();
        got.push(bits(e.logits(s).unwrap()));
    }
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(g == w, "step {i}: restored logits differ from a full prefill (exact={exact})");
    }

    // A prompt diverging inside the second page reuses only the first page's checkpoint-less chain: no checkpoint
    // there, so nothing is restored.
    let mut other = history.clone();
    other[span + 3] = (other[span + 3] + 1) % vocab as u32;
    assert!(persist::restore_longest(&store, &mut e, &other).unwrap().is_none());

    // A prompt diverging inside the last (partial) page resumes from the restore point at its boundary, and
    // continues exactly like a cold prefill of that prompt.
    let mut edited = all.clone();
    edited[3 * span + 5] = (edited[3 * span + 5] + 1) % vocab as u32;
    let (s2, m2) = persist::restore_longest(&store, &mut e, &edited).unwrap().expect("restore point");
    assert_eq!(m2, 3 * span);
    assert!(e.logits(s2).is_err(), "a restore point holds no logits");
    e.feed(s2, &edited[m2..]).unwrap();
    e.run_until_idle().unwrap();
    let cold = reference(m, exact, &edited, 0);
    assert!(bits(e.logits(s2).unwrap()) == cold[0], "restored from the restore point: logits differ (exact={exact})");
    // Restored rows fill pages of the engine's pool; dropping the sessions returns every page.
    assert!(e.page_pool().live_pages() > 0);
    e.free_session(s).unwrap();
    e.free_session(s2).unwrap();
    assert_eq!((e.page_pool().live_pages(), e.page_pool().live_bytes()), (0, 0), "pages leaked (exact={exact})");

    // The other mode (or model) never reuses these entries.
    let mut e2 = open(m, !exact);
    let store2 = persist::open_store(&e2, dir.path(), opts).unwrap();
    assert!(persist::restore_longest(&store2, &mut e2, &all).unwrap().is_none());
}

fn shared_prefix_stored_once(m: Model<'_>) {
    let dir = tempfile::tempdir().unwrap();
    let mut e = open(m, true);
    let vocab = e.config().vocab;
    let opts = persist::kv_options(e.config(), 32, 64 << 20);
    let span = opts.span_tokens as usize;
    let store = persist::open_store(&e, dir.path(), opts).unwrap();
    let system = tokens(3, 2 * span, vocab);
    let a: Vec<u32> = system.iter().copied().chain(tokens(4, span + 5, vocab)).collect();
    let b: Vec<u32> = system.iter().copied().chain(tokens(5, 7, vocab)).collect();
    let sa = e.create_session();
    e.feed(sa, &a).unwrap();
    e.run_until_idle().unwrap();
    let ia = persist::save(&store, &e, sa, SaveReason::Cold).unwrap();
    let (_, a_page_bytes) = files(dir.path(), "page");
    let sb = e.create_session();
    e.feed(sb, &b).unwrap();
    e.run_until_idle().unwrap();
    let ib = persist::save(&store, &e, sb, SaveReason::Cold).unwrap();
    assert_eq!((ia.pages, ia.pages_written), (3, 3));
    assert_eq!((ib.pages, ib.pages_written), (2, 0), "the shared system prompt's pages are written once");
    let (pages, page_bytes) = files(dir.path(), "page");
    assert_eq!(pages, 3);
    assert_eq!(page_bytes, a_page_bytes, "the second conversation wrote no page bytes");
    assert_eq!(files(dir.path(), "ckpt").0, 4, "two checkpoints and two restore points");
    assert_eq!((ia.restore_points, ib.restore_points), (vec![3 * span], vec![2 * span]));
    // Each resumes from its own checkpoint.
    let (_, ma) = persist::restore_longest(&store, &mut e, &a).unwrap().unwrap();
    let (_, mb) = persist::restore_longest(&store, &mut e, &b).unwrap().unwrap();
    assert_eq!((ma, mb), (a.len(), b.len()));
}

#[test]
fn tiny_a_restore_is_bit_identical_exact_and_sim() {
    let Some(sh) = shared() else { return };
    let gguf = golden_gguf(&sh, "tiny-a", "f32");
    round_trip(Model::File(&gguf), true);
    round_trip(Model::File(&gguf), false);
}

#[test]
fn demo_restore_is_bit_identical_exact_and_sim() {
    round_trip(Model::Demo, true);
    round_trip(Model::Demo, false);
}

#[test]
fn shared_prefix_pages_are_stored_once() {
    shared_prefix_stored_once(Model::Demo);
}

/// A session that generated past its prompt, saved with the prompt's end as a mark (what the server does on evict and
/// shutdown): after a restart, the next turn — which re-renders the generated tokens, so it diverges right after
/// the prompt — restores the page boundary below the prompt end instead of recomputing everything, and continues
/// exactly like a cold prefill. A mark the roll-back log cannot reach is skipped.
#[test]
fn a_mark_at_the_prompt_end_serves_the_next_turn_after_a_restart() {
    let m = Model::Demo;
    let dir = tempfile::tempdir().unwrap();
    let e0 = open(m, false);
    let vocab = e0.config().vocab;
    let opts = persist::kv_options(e0.config(), 32, 64 << 20);
    let span = opts.span_tokens as usize;
    drop(e0);
    let prompt = tokens(3, 2 * span + 7, vocab);
    let generated = tokens(4, span + 20, vocab);
    let session: Vec<u32> = prompt.iter().chain(&generated).copied().collect();
    {
        let mut e = open(m, false);
        let store = persist::open_store(&e, dir.path(), opts.clone()).unwrap();
        let s = e.create_session();
        e.feed(s, &session).unwrap();
        e.run_until_idle().unwrap();
        let unmarked = persist::save(&store, &e, s, SaveReason::Evict).unwrap();
        assert_eq!(unmarked.restore_points, vec![3 * span]);
        let info = persist::save_marked(&store, &e, s, SaveReason::Evict, &[prompt.len(), session.len() + 5]).unwrap();
        assert_eq!(info.restore_points, vec![3 * span, 2 * span], "below the end, then below the mark");
    }
    let next: Vec<u32> = prompt.iter().chain(&tokens(5, 30, vocab)).copied().collect();
    let mut e = open(m, false);
    let store = persist::open_store(&e, dir.path(), opts.clone()).unwrap();
    let (s, n) = persist::restore_longest(&store, &mut e, &next).unwrap().expect("the mark's restore point");
    assert_eq!(n, 2 * span);
    e.feed(s, &next[n..]).unwrap();
    e.run_until_idle().unwrap();
    assert!(bits(e.logits(s).unwrap()) == reference(m, false, &next, 0)[0], "logits differ from a cold prefill");

    // Beyond the roll-back reach: the mark is skipped, the save still succeeds.
    let short = EngineOptions { rollback: 8, threads: 2, max_batch_tokens: 48, ctx: 1024, ..EngineOptions::default() };
    let bytes = ds4_engine::convert::demo_model_gguf(7).unwrap();
    let mut e = Engine::from_gguf(GgufFile::from_bytes(bytes).unwrap(), short).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let store = persist::open_store(&e, dir.path(), opts).unwrap();
    let s = e.create_session();
    e.feed(s, &session).unwrap();
    e.run_until_idle().unwrap();
    let info = persist::save_marked(&store, &e, s, SaveReason::Evict, &[prompt.len()]).unwrap();
    assert!(!info.restore_points.contains(&(2 * span)), "{:?}", info.restore_points);
}

/// A session loaded from disk next to a live session with the same prefix that the page index does not know (it
/// was never saved or restored) joins the live session's pages at install (one copy in memory) and continues exactly
/// as the live one does.
#[test]
fn a_restored_session_joins_the_pages_a_live_session_holds() {
    let dir = tempfile::tempdir().unwrap();
    let mut e = open(Model::Demo, false);
    let vocab = e.config().vocab;
    let store = persist::open_store(&e, dir.path(), persist::kv_options(e.config(), 256, 64 << 20)).unwrap();
    let history = tokens(5, 2 * 256 + 40, vocab);
    let live = e.create_session();
    e.feed(live, &history).unwrap();
    e.run_until_idle().unwrap();
    // Saved by another engine (as before a restart), so this engine's page index does not know the live pages:
    // the restore decodes every page and the install then joins the live ones.
    let mut other = open(Model::Demo, false);
    let saved = other.create_session();
    other.feed(saved, &history).unwrap();
    other.run_until_idle().unwrap();
    persist::save(&store, &other, saved, SaveReason::Cold).unwrap();
    drop(other);
    let layout = persist::KvLayout::of(&e);
    let snap = persist::load_longest(&store, &layout, &history).unwrap().expect("saved");
    assert_eq!(snap.pos, history.len());
    let before = e.page_pool().live_bytes();
    let restored = e.restore(snap).unwrap();
    // The decoded copies of the two full 256-token pages of every compressed table went; the partial page stays.
    let (a, b) = (e.snapshot(live).unwrap(), e.snapshot(restored).unwrap());
    let mut joined = 0;
    for (la, lb) in a.kv.layers.iter().zip(&b.kv.layers) {
        for (ta, tb) in [(&la.comp_rows, &lb.comp_rows), (&la.idx_rows, &lb.idx_rows)] {
            if ta.width() > 0 && ta.rows() > 0 {
                let full = (ta.rows() / ta.rows_per_page()).min(2);
                assert!((0..full).all(|p| tb.same_page(ta, p)), "a full page was not joined");
                assert!(!tb.same_page(ta, ta.n_pages() - 1) || ta.rows() % ta.rows_per_page() == 0);
                joined += full;
            }
        }
    }
    assert!(joined > 0, "the model has compressed layers with full pages");
    drop((a, b));
    assert!(e.page_pool().live_bytes() < before, "the duplicate pages were not released");
    let t = tokens(6, 3, vocab);
    for s in [live, restored] {
        e.feed(s, &t).unwrap();
    }
    e.run_until_idle().unwrap();
    assert_eq!(bits(e.logits(live).unwrap()), bits(e.logits(restored).unwrap()));
}

/// One page identity over RAM and the store: a restore takes the pages RAM holds under the same key (the engine's
/// page index) and reads only the rest. With the page files deleted behind the store's back, a prefix whose pages a
/// restored session still holds restores anyway (nothing but the checkpoint is read), shares that session's pages,
/// and continues bit for bit like a session that prefilled everything.
#[test]
fn a_restore_reads_only_the_pages_ram_does_not_hold() {
    let dir = tempfile::tempdir().unwrap();
    let mut e = open(Model::Demo, false);
    let vocab = e.config().vocab;
    let store = persist::open_store(&e, dir.path(), persist::kv_options(e.config(), 256, 64 << 20)).unwrap();
    let history = tokens(11, 3 * 256 + 40, vocab);
    let s = e.create_session();
    e.feed(s, &history).unwrap();
    e.run_until_idle().unwrap();
    persist::save(&store, &e, s, SaveReason::Cold).unwrap();
    let pool = e.page_pool().clone();
    let index = || pool.index().expect("the engine's pool has an index").stats();
    assert_eq!(index().resident, 3, "a save registers the session's full pages");
    e.free_session(s).unwrap();
    assert_eq!(index().resident, 0, "the index keeps no page alive");

    // Nothing in RAM: every page is read and decoded, then registered.
    let layout = persist::KvLayout::of(&e);
    let first = e.restore(persist::load_longest(&store, &layout, &history).unwrap().expect("saved")).unwrap();
    let st = index();
    assert_eq!((st.joined, st.decoded, st.resident), (0, 3, 3));

    // The page files go; the restored session holds the pages, so only the checkpoint is read.
    let (pages, _) = files(dir.path(), "page");
    assert_eq!(pages, 3);
    for f in std::fs::read_dir(dir.path()).unwrap() {
        let p = f.unwrap().path();
        if p.extension().is_some_and(|x| x == "page") {
            std::fs::remove_file(p).unwrap();
        }
    }
    let pages_before = e.page_pool().live_pages();
    let snap = persist::load_longest(&store, &layout, &history).unwrap().expect("pages joined from RAM");
    let st = index();
    assert_eq!((st.joined, st.decoded), (3, 3), "three spans joined, none decoded again");
    let second = e.restore(snap).unwrap();
    let (a, b) = (e.snapshot(first).unwrap(), e.snapshot(second).unwrap());
    let mut tables = 0;
    for (la, lb) in a.kv.layers.iter().zip(&b.kv.layers) {
        for (ta, tb) in [(&la.comp_rows, &lb.comp_rows), (&la.idx_rows, &lb.idx_rows)] {
            if ta.rows() >= 3 * ta.rows_per_page() {
                assert!((0..3).all(|p| tb.same_page(ta, p)), "a full page is a second copy");
                tables += 1;
            }
        }
    }
    assert!(tables > 0, "the model has compressed layers");
    drop((a, b));
    let partial_pages = e.page_pool().live_pages() - pages_before;
    assert!(partial_pages <= tables as u64, "only the partial pages are new: {partial_pages} for {tables} tables");

    // Both continue exactly as a session that prefilled everything.
    let cold = e.create_session();
    e.feed(cold, &history).unwrap();
    let t = tokens(12, 3, vocab);
    for s in [first, second, cold] {
        e.feed(s, &t).unwrap();
    }
    e.run_until_idle().unwrap();
    let want = bits(e.logits(cold).unwrap());
    assert_eq!(bits(e.logits(first).unwrap()), want);
    assert_eq!(bits(e.logits(second).unwrap()), want);
}
