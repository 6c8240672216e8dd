//! Fork without copy ([`Engine::fork`]): a fork shares its parent's KV pages and roll-back log chunks by reference
//! and copies only the private tail (raw window rings, compressor frontiers), so the bytes it copies do not grow
//! with the session's length; afterwards both sessions evolve independently — appending into the shared partial
//! page, rolling back, crossing page boundaries — with logits bit-identical to unforked sessions that processed
//! the same tokens. Freeing every session returns the engine's page pool to empty. On wgpu the same holds for the
//! device tier (device pages shared by a fork of a device-resident session, copied on write).

use ds4_engine::convert::{demo_config, random_model_gguf};
use ds4_engine::engine::{BackendKind, Engine, EngineOptions};
use ds4_engine::gguf::GgufFile;
use ds4_engine::model::config::LayerKind;
use ds4_engine::persist;
use ds4_engine::tables::{SessionId, PAGE_TOKENS};
use ds4_tests::{bits, continue_with, golden_gguf, shared, tokens, wgpu_available};

fn open_tiny(ctx: usize) -> Option<Engine> {
    let sh = shared()?;
    let gguf = golden_gguf(&sh, "tiny-a", "f32");
    let opts = EngineOptions { threads: 2, ctx, max_batch_tokens: 256, ..EngineOptions::default() };
    Some(Engine::open(&gguf, opts).expect("open tiny-a"))
}

fn prefill(e: &mut Engine, toks: &[u32]) -> SessionId {
    let s = e.create_session();
    e.feed(s, toks).unwrap();
    e.run_until_idle().unwrap();
    s
}

/// Bytes one fork of `s` copies, and the fork.
fn fork_cost(e: &mut Engine, s: SessionId) -> (u64, SessionId) {
    let before = e.kv_bytes_copied();
    let f = e.fork(s).unwrap();
    (e.kv_bytes_copied() - before, f)
}

#[test]
fn fork_copies_the_private_tail_only_whatever_the_length() {
    let Some(mut e) = open_tiny(2048) else { return };
    let vocab = e.config().vocab;
    let n = 500;
    let all = tokens(21, 4 * n, vocab);
    let short = prefill(&mut e, &all[..n]);
    let long = prefill(&mut e, &all);
    let pages_before = e.page_pool().live_pages();
    let (c_short, f_short) = fork_cost(&mut e, short);
    let (c_long, f_long) = fork_cost(&mut e, long);
    assert!(c_short > 0, "a fork copies its ring and frontiers");
    assert_eq!(c_short, c_long, "the copied tail does not depend on the length");
    assert_eq!(e.page_pool().live_pages(), pages_before, "a fork allocates no page");
    let kv_long = e.kv_bytes(long).unwrap();
    assert!(c_long * 4 < kv_long, "fork copied {c_long} of {kv_long} bytes");
    // Same state, same next logits.
    assert_eq!(bits(e.logits(f_long).unwrap()), bits(e.logits(long).unwrap()));
    assert_eq!(e.snapshot(f_short).unwrap(), e.snapshot(short).unwrap());
    // Freeing every session releases every page (shared ones once their last holder goes).
    for s in [short, f_long, long, f_short] {
        e.free_session(s).unwrap();
    }
    assert_eq!((e.page_pool().live_pages(), e.page_pool().live_bytes()), (0, 0));
}

#[test]
fn forked_sessions_decode_like_unforked_ones() {
    let Some(mut e) = open_tiny(2048) else { return };
    let Some(mut cold) = open_tiny(2048) else { return };
    let vocab = e.config().vocab;
    // A prefix ending inside a page (partial page shared by the fork), continuations crossing the next boundary.
    let p = PAGE_TOKENS + 200;
    let prompt = tokens(5, p, vocab);
    let (ca, cb) = (tokens(6, 70, vocab), tokens(7, 70, vocab));
    let a = prefill(&mut e, &prompt);
    let b = e.fork(a).unwrap();
    let copied = e.kv_bytes_copied();
    // Both append into the shared partial pages; each must see only its own rows.
    let got_b = continue_with(&mut e, b, &cb);
    let got_a = continue_with(&mut e, a, &ca);
    assert!(e.kv_bytes_copied() > copied, "appending to a shared partial page copies it");
    for (cont, got) in [(&ca, &got_a), (&cb, &got_b)] {
        let c = prefill(&mut cold, &prompt);
        assert!(*got == continue_with(&mut cold, c, cont), "a forked session diverged from a cold one");
        cold.free_session(c).unwrap();
    }
    // A fork of a fork, rolled back into the shared full pages, then continued: as a cold prefill of that prefix.
    let f = e.fork(b).unwrap();
    let len = PAGE_TOKENS - 3;
    e.rollback(f, len).unwrap();
    let cc = tokens(8, 40, vocab);
    let got_f = continue_with(&mut e, f, &cc);
    let c = prefill(&mut cold, &prompt[..len]);
    assert!(got_f == continue_with(&mut cold, c, &cc), "a rolled back fork diverged from a cold prefill");
    // The parent is untouched by its fork's roll back.
    let mut after_b = prompt.clone();
    after_b.extend_from_slice(&cb);
    assert_eq!(e.history(b).unwrap(), &after_b[..]);
    let c2 = prefill(&mut cold, &after_b);
    assert_eq!(bits(e.logits(b).unwrap()), bits(cold.logits(c2).unwrap()));
    for s in [a, b, f] {
        e.free_session(s).unwrap();
    }
    assert_eq!(e.page_pool().live_pages(), 0);
}

/// A Flash-shaped layer mix (CSA ratio 4, HCA ratio 128, window) on the small random demo model, 2k vs 8k tokens
/// (32k tokens take minutes in a debug build on 2 cores; `ds4-bench kv` measures the 32k fork).
#[test]
fn fork_of_a_long_flash_shaped_session_copies_what_a_short_one_does() {
    let mut c = demo_config();
    c.compress_ratios = vec![4, 128, 0];
    c.compress_ratios_all = c.compress_ratios.clone();
    let bytes = random_model_gguf(&c, 3, Vec::new()).expect("random model");
    let opts = EngineOptions { threads: 2, ctx: 8192, max_batch_tokens: 2048, ..EngineOptions::default() };
    let mut e = Engine::from_gguf(GgufFile::from_bytes(bytes).unwrap(), opts).unwrap();
    let vocab = e.config().vocab;
    let all = tokens(9, 8192 - 8, vocab);
    let short = prefill(&mut e, &all[..2048 - 8]);
    let long = prefill(&mut e, &all);
    let (c_short, fs) = fork_cost(&mut e, short);
    let (c_long, fl) = fork_cost(&mut e, long);
    assert_eq!(c_short, c_long);
    let kv = e.kv_bytes(long).unwrap();
    assert!(c_long * 8 < kv, "fork of 8k tokens copied {c_long} of {kv} bytes");
    let cont = tokens(10, 4, vocab);
    assert!(continue_with(&mut e, fl, &cont) == continue_with(&mut e, long, &cont));
    for s in [short, long, fs, fl] {
        e.free_session(s).unwrap();
    }
    assert_eq!(e.page_pool().live_pages(), 0);
}

/// A wgpu engine (device-resident KV) on a random model; `rollback`: device roll-back log tokens.
fn open_wgpu(bytes: &[u8], rollback: usize) -> Engine {
    let opts = EngineOptions {
        backend: BackendKind::Wgpu,
        threads: 2,
        ctx: 2048,
        max_batch_tokens: 256,
        rollback,
        ..EngineOptions::default()
    };
    Engine::from_gguf(GgufFile::from_bytes(bytes.to_vec()).unwrap(), opts).unwrap()
}

/// The demo model's layer mix: CSA ratio 4, HCA ratio 8, window (a device page is 256 tokens in both).
fn demo_bytes() -> Vec<u8> {
    random_model_gguf(&demo_config(), 12, Vec::new()).expect("random model")
}

/// Bytes of one [`ds4_engine::backend::wgpu::LOG_CHUNK_TOKENS`]-token chunk of every roll-back log input of every
/// layer: raw KV rows, and per compressor its features and gate logits (main: `coff·head_dim`, indexer:
/// `2·idx_head_dim` wide).
fn log_chunk_bytes(e: &Engine) -> u64 {
    let c = e.config();
    let per_token: usize = (0..c.n_layers)
        .map(|l| match c.layer_kind(l) {
            LayerKind::Window => c.head_dim,
            LayerKind::Hca => c.head_dim + 2 * c.head_dim,
            LayerKind::Csa => c.head_dim + 2 * 2 * c.head_dim + 2 * 2 * c.idx_head_dim,
        })
        .sum();
    (per_token * ds4_engine::backend::wgpu::LOG_CHUNK_TOKENS * 4) as u64
}

/// One wgpu fork scenario with a device roll-back log of `rollback` tokens (0: none): checks what
/// [`wgpu_fork_shares_device_pages_and_copies_the_tail_only`] states and returns the bytes the fork copied and
/// the bytes the fork's first decoded token (which completes no compressed row) and its next 8 (which do)
/// copied.
fn wgpu_fork_case(bytes: &[u8], rollback: usize) -> (u64, u64, u64) {
    let mut e = open_wgpu(bytes, rollback);
    let vocab = e.config().vocab;
    let all = tokens(31, 2 * PAGE_TOKENS + 100, vocab);
    let short = prefill(&mut e, &all[..PAGE_TOKENS + 40]);
    let long = prefill(&mut e, &all);
    let (live, shared) = e.device_kv_pages().expect("a paged device tier");
    assert!(live > 0 && shared == 0, "{live} live, {shared} shared pages before the forks");
    let (c_short, fs) = fork_cost(&mut e, short);
    let (c_long, fl) = fork_cost(&mut e, long);
    assert!(c_short > 0, "a fork copies its ring and frontiers");
    assert_eq!(c_short, c_long, "the copied tail does not depend on the length");
    assert_eq!(e.device_kv_pages(), Some((live, live)), "a device fork allocates no page or chunk, shares them all");
    let kv = e.kv_bytes(long).unwrap();
    assert!(c_long * 2 < kv, "fork copied {c_long} of {kv} bytes");
    // Read back through the shared pages, the fork's state is its parent's.
    assert!(e.snapshot(fs).unwrap() == e.snapshot(short).unwrap());
    // The fork appends first: its shared partial pages (and log chunks) are copied, then each decodes its own
    // continuation.
    let (ca, cb) = (tokens(32, 9, vocab), tokens(33, 9, vocab));
    let copied = e.kv_bytes_copied();
    let mut got_f = continue_with(&mut e, fl, &ca[..1]);
    let first = e.kv_bytes_copied() - copied;
    got_f.extend(continue_with(&mut e, fl, &ca[1..]));
    let rest = e.kv_bytes_copied() - copied - first;
    assert!(rest > 0, "appending to a shared partial page copies it");
    assert!(e.device_kv_pages().unwrap().0 > live, "the copies are fresh pages");
    let got_l = continue_with(&mut e, long, &cb);
    let mut cold = open_wgpu(bytes, 0);
    for (cont, got) in [(&ca, &got_f), (&cb, &got_l)] {
        let c = prefill(&mut cold, &all);
        assert!(*got == continue_with(&mut cold, c, cont), "a forked device session diverged from a cold one");
        cold.free_session(c).unwrap();
    }
    for s in [short, fl, long, fs] {
        e.free_session(s).unwrap();
    }
    assert_eq!(e.device_kv_pages(), Some((0, 0)), "freed sessions return every device page and log chunk");
    (c_long, first, rest)
}

/// On wgpu a device-resident session forks on the device: every KV page and roll-back log chunk is shared (no
/// page allocated, the bytes copied are the private tail — rings and frontiers, the same with a log as without and
/// for 1 and 2 full pages); the first token logged copies exactly one log chunk per input per layer (the log has
/// wrapped: the chunk it writes is shared) and nothing else, the first appended rows copy the shared partial pages
/// (the same bytes with a log as without: the fork's log chunk is private by then); parent and fork then
/// decode different continuations exactly as cold sessions do, and freeing every session returns the device pools
/// to empty.
#[test]
fn wgpu_fork_shares_device_pages_and_copies_the_tail_only() {
    if !wgpu_available() {
        return;
    }
    let bytes = demo_bytes();
    let (fork_plain, first_plain, rest_plain) = wgpu_fork_case(&bytes, 0);
    assert_eq!(first_plain, 0, "a token that completes no compressed row appends no row");
    // 100 + window (16) log slots: both prefills wrap the log, so each of its chunks is written.
    let (fork_log, first_log, rest_log) = wgpu_fork_case(&bytes, 100);
    assert_eq!(fork_log, fork_plain, "a fork copies no roll-back log byte");
    let chunk = log_chunk_bytes(&open_wgpu(&bytes, 0));
    assert_eq!(first_log, chunk, "the first token copies one log chunk per input per layer");
    assert_eq!(rest_log, rest_plain, "the log chunk written next is private");
}

/// On wgpu a roll back of a fork into a shared full page cuts only the fork's table: its next append copies that
/// page instead of writing into it, the parent's state is untouched, and the fork continues as a cold prefill of
/// the shorter prefix.
#[test]
fn wgpu_rollback_of_a_fork_into_a_shared_page_copies_on_write() {
    if !wgpu_available() {
        return;
    }
    let bytes = demo_bytes();
    let mut e = open_wgpu(&bytes, 400);
    let vocab = e.config().vocab;
    let all = tokens(41, 2 * PAGE_TOKENS + 100, vocab);
    let s = prefill(&mut e, &all);
    let f = e.fork(s).unwrap();
    let before = e.snapshot(s).unwrap();
    let (live, _) = e.device_kv_pages().unwrap();
    let len = PAGE_TOKENS + 10;
    e.rollback(f, len).unwrap();
    let (live_rb, shared_rb) = e.device_kv_pages().unwrap();
    assert_eq!(live_rb, live, "the parent still holds the pages the fork dropped");
    assert!(shared_rb > 0 && shared_rb < live, "{shared_rb} of {live} pages still shared");
    let copied = e.kv_bytes_copied();
    let cont = tokens(42, 9, vocab);
    let got = continue_with(&mut e, f, &cont);
    assert!(e.kv_bytes_copied() > copied, "the append into the shared page copied it");
    assert!(e.snapshot(s).unwrap() == before, "the fork wrote into a page its parent reads");
    let mut cold = open_wgpu(&bytes, 0);
    let c = prefill(&mut cold, &all[..len]);
    assert!(got == continue_with(&mut cold, c, &cont), "the rolled back fork diverged from a cold prefill");
    for x in [f, s] {
        e.free_session(x).unwrap();
    }
    assert_eq!(e.device_kv_pages(), Some((0, 0)));
}

/// One page identity down to the device tier: two sessions restored on wgpu from the same stored prefix hold one
/// device copy of its full pages (the restored host pages carry their store keys; the device pool shares a keyed
/// page it holds instead of uploading it again), and both continue as a cold session does.
#[test]
fn wgpu_sessions_restored_from_one_prefix_share_device_pages() {
    if !wgpu_available() {
        return;
    }
    let bytes = demo_bytes();
    let mut e = open_wgpu(&bytes, 0);
    let vocab = e.config().vocab;
    let dir = tempfile::tempdir().unwrap();
    let store = persist::open_store(&e, dir.path(), persist::kv_options(e.config(), 256, 64 << 20)).unwrap();
    let all = tokens(41, 2 * PAGE_TOKENS + 100, vocab);
    let s = prefill(&mut e, &all);
    persist::save(&store, &e, s, ds4_kv::SaveReason::Cold).unwrap();
    e.free_session(s).unwrap();
    assert_eq!(e.device_kv_pages(), Some((0, 0)));
    let layout = persist::KvLayout::of(&e);
    let cont = tokens(42, 6, vocab);
    let r1 = e.restore(persist::load_longest(&store, &layout, &all).unwrap().expect("saved")).unwrap();
    let got1 = continue_with(&mut e, r1, &cont);
    let (live1, shared1) = e.device_kv_pages().unwrap();
    assert_eq!(shared1, 0);
    let r2 = e.restore(persist::load_longest(&store, &layout, &all).unwrap().expect("saved")).unwrap();
    let got2 = continue_with(&mut e, r2, &cont);
    let (live2, full) = e.device_kv_pages().unwrap();
    let c = e.config();
    let tables: usize = (0..c.n_layers)
        .map(|l| match c.layer_kind(l) {
            LayerKind::Window => 0,
            LayerKind::Hca => 1,
            LayerKind::Csa => 2,
        })
        .sum();
    assert_eq!(full, 2 * tables, "the two full spans of every paged table are shared");
    assert_eq!(live2 - live1, live1 - full, "the second session adds only what is not a shared full page");
    let mut cold = open_wgpu(&bytes, 0);
    let c = prefill(&mut cold, &all);
    let want = continue_with(&mut cold, c, &cont);
    assert!(got1 == want && got2 == want, "a restored device session diverged from a cold one");
    // A snapshot (what a save takes) reads back only what the host does not hold under the same key: the cold
    // session's snapshot reads every row, the restored one all but its two full spans.
    let read = |e: &mut Engine, s| {
        let before = e.device_counters().unwrap().device_to_host;
        let snap = e.snapshot(s).unwrap();
        (snap, e.device_counters().unwrap().device_to_host - before)
    };
    let (snap_cold, read_cold) = read(&mut cold, c);
    let (snap_r1, read_r1) = read(&mut e, r1);
    assert!(snap_r1 == snap_cold, "the snapshot of a restored device session differs from a cold one's");
    let full_span_bytes: u64 = snap_cold
        .kv
        .layers
        .iter()
        .flat_map(|l| [&l.comp_rows, &l.idx_rows])
        .filter(|t| t.rows() > 0)
        .map(|t| (2 * t.rows_per_page() * t.width() * 4) as u64)
        .sum();
    assert_eq!(read_cold - read_r1, full_span_bytes, "the kept full pages are exactly what was not read back");
    for s in [r1, r2] {
        e.free_session(s).unwrap();
    }
    assert_eq!(e.device_kv_pages(), Some((0, 0)), "freed sessions return every device page");
}
