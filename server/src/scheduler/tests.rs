//! The scheduler's tests: admission, batching, prefix reuse and the RAM tier, on the scripted test model.

use super::*;
use crate::fake::{FakeCodec, FakeRunner, EOS};
use crate::model::Codec;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

fn job(prompt: Vec<u32>, max_tokens: usize) -> (GenRequest, UnboundedReceiver<JobEvent>) {
    let (tx, rx) = unbounded_channel();
    let sampling = SamplerConfig::greedy();
    (GenRequest { prompt, sampling, max_tokens, eos: vec![EOS], system_block: 0, events: tx, constraint: None }, rx)
}

fn collect(rx: &mut UnboundedReceiver<JobEvent>) -> (Vec<JobEvent>, String) {
    let mut events = Vec::new();
    let mut text = Vec::new();
    while let Some(ev) = rx.blocking_recv() {
        let last = matches!(ev, JobEvent::Done(_) | JobEvent::Error(_));
        if let JobEvent::Token(t) = ev {
            text.push(t as u8);
        }
        events.push(ev);
        if last {
            break;
        }
    }
    (events, String::from_utf8_lossy(&text).into_owned())
}

fn prompt(user: &str) -> Vec<u32> {
    FakeCodec.encode(&format!("<|user|>{user}\n<|assistant|>")).unwrap()
}

#[test]
fn generates_and_reuses_the_prefix() {
    let metrics = Arc::new(Metrics::default());
    let config = SchedulerConfig { prefill_chunk: 7, ..Default::default() };
    let s = Scheduler::start(Box::new(FakeRunner::new(8)), config, metrics.clone());
    let p1 = prompt("hello");
    let (j, mut rx) = job(p1.clone(), 100);
    s.submit(j).unwrap();
    let (ev, text) = collect(&mut rx);
    assert_eq!(text, "Hello! You said: hello.");
    assert_eq!(ev[0], JobEvent::Started { prompt_tokens: p1.len(), cached_tokens: 0 });
    assert_eq!(ev.last().unwrap(), &JobEvent::Done(JobStopReason::Eos));
    // The follow-up carries the whole history: everything before its new turn comes from the parked session.
    let mut p2 = p1.clone();
    p2.extend(FakeCodec.encode("Hello! You said: hello.<|end|>\n<|user|>again\n<|assistant|>").unwrap());
    let (j, mut rx) = job(p2.clone(), 100);
    s.submit(j).unwrap();
    let (ev, text) = collect(&mut rx);
    assert_eq!(text, "Hello! You said: again.");
    let hello_len = p1.len() + "Hello! You said: hello.".len();
    assert_eq!(ev[0], JobEvent::Started { prompt_tokens: p2.len(), cached_tokens: hello_len });
    assert_eq!(metrics.prefix_hit_tokens(CacheTier::Host), hello_len as u64);
    s.shutdown();
}

/// The fake model without any roll back (the real engine rolls back only within its log's reach).
struct NoTruncate(FakeRunner);

impl Runner for NoTruncate {
    fn vocab_size(&self) -> usize {
        self.0.vocab_size()
    }
    fn create_session(&mut self) -> Result<RunnerSessionId, crate::model::BackendError> {
        self.0.create_session()
    }
    fn free_session(&mut self, session: RunnerSessionId) {
        self.0.free_session(session)
    }
    fn truncate(&mut self, _: RunnerSessionId, _: usize) -> bool {
        false
    }
    fn fork(&mut self, session: RunnerSessionId) -> Option<RunnerSessionId> {
        self.0.fork(session)
    }
    fn feed(&mut self, session: RunnerSessionId, tokens: &[u32]) -> Result<(), crate::model::BackendError> {
        self.0.feed(session, tokens)
    }
    fn step(&mut self) -> Result<(), crate::model::BackendError> {
        self.0.step()
    }
    fn logits(&self, session: RunnerSessionId) -> Option<&[f32]> {
        self.0.logits(session)
    }
}

#[test]
fn without_truncate_prompt_checkpoints_serve_repeats_and_divergent_follow_ups() {
    let s = Scheduler::start(Box::new(NoTruncate(FakeRunner::new(8))), Default::default(), Default::default());
    let p1 = prompt("hello");
    let (j, mut rx) = job(p1.clone(), 100);
    s.submit(j).unwrap();
    let (ev, solo) = collect(&mut rx);
    assert_eq!(ev[0], JobEvent::Started { prompt_tokens: p1.len(), cached_tokens: 0 });
    // The same prompt again: served from the prompt checkpoint, logits included, nothing re-fed.
    let (j, mut rx) = job(p1.clone(), 100);
    s.submit(j).unwrap();
    let (ev, again) = collect(&mut rx);
    assert_eq!(ev[0], JobEvent::Started { prompt_tokens: p1.len(), cached_tokens: p1.len() });
    assert_eq!(again, solo);
    // A follow-up whose assistant turn was re-rendered differently still reuses the first prompt.
    let mut p2 = p1.clone();
    p2.extend(FakeCodec.encode("Hi!<|end|>\n<|user|>more\n<|assistant|>").unwrap());
    let (j, mut rx) = job(p2.clone(), 100);
    s.submit(j).unwrap();
    let (ev, text) = collect(&mut rx);
    assert_eq!(ev[0], JobEvent::Started { prompt_tokens: p2.len(), cached_tokens: p1.len() });
    assert_eq!(text, "Hello! You said: more.");
    s.shutdown();
}

#[test]
fn max_tokens_and_context_limits() {
    let config = SchedulerConfig { context_size: 40, ..Default::default() };
    let s = Scheduler::start(Box::new(FakeRunner::new(8)), config, Arc::new(Metrics::default()));
    let (j, mut rx) = job(prompt("hello"), 3);
    s.submit(j).unwrap();
    let (ev, text) = collect(&mut rx);
    assert_eq!(text, "Hel");
    assert_eq!(ev.last().unwrap(), &JobEvent::Done(JobStopReason::Length));
    let (j, mut rx) = job(prompt(&"x".repeat(50)), 3);
    s.submit(j).unwrap();
    let (ev, _) = collect(&mut rx);
    assert!(matches!(&ev[0], JobEvent::Error(m) if m.contains("context size 40")), "{ev:?}");
    let (j, mut rx) = job(prompt("a long answer"), 1000);
    s.submit(j).unwrap();
    let (ev, text) = collect(&mut rx);
    assert_eq!(ev.last().unwrap(), &JobEvent::Done(JobStopReason::Length));
    assert_eq!(text.len() + prompt("a long answer").len(), 40);
    s.shutdown();
}

#[test]
fn concurrent_jobs_match_solo_runs_and_queue_bounds() {
    let config = SchedulerConfig { max_active: 3, max_queue: 64, prefill_chunk: 5, ..Default::default() };
    let s = Scheduler::start(Box::new(FakeRunner::new(32)), config, Arc::new(Metrics::default()));
    let mut rxs = Vec::new();
    for i in 0..10 {
        let (j, rx) = job(prompt(&format!("number {i}")), 100);
        s.submit(j).unwrap();
        rxs.push((i, rx));
    }
    for (i, mut rx) in rxs {
        assert_eq!(collect(&mut rx).1, format!("Hello! You said: number {i}."));
    }
    s.shutdown();
    let (j, _rx) = job(prompt("late"), 5);
    assert_eq!(s.submit(j), Err(SubmitError::ShuttingDown));

    let config = SchedulerConfig { max_queue: 0, ..Default::default() };
    let s = Scheduler::start(Box::new(FakeRunner::new(4)), config, Arc::new(Metrics::default()));
    let (j, _rx) = job(prompt("x"), 5);
    assert_eq!(s.submit(j), Err(SubmitError::QueueFull));
    s.shutdown();
}

#[test]
fn decoding_gets_a_token_every_tick_during_another_long_prefill() {
    // The model processes 8 rows per step and the scheduler may queue 512 prompt tokens: a 400-token prompt
    // takes dozens of ticks, and the session already decoding gets one token in each of them. The worker is
    // driven tick by tick here (no thread), so the counts are exact.
    let runner = FakeRunner::new(8).with_batch_tokens(8);
    let queued = Arc::new(AtomicUsize::new(0));
    let mut w = Worker::new(Box::new(runner), None, SchedulerConfig::default(), Default::default(), queued.clone());
    let submit = |w: &mut Worker, j: GenRequest| {
        queued.fetch_add(1, Ordering::SeqCst);
        w.waiting.push_back((j, Instant::now()));
    };
    let tokens = |rx: &mut UnboundedReceiver<JobEvent>| {
        std::iter::from_fn(|| rx.try_recv().ok()).filter(|e| matches!(e, JobEvent::Token(_))).count()
    };
    let (a, mut rx_a) = job(prompt("a long answer"), 10_000);
    submit(&mut w, a);
    let mut ticks = 0;
    while tokens(&mut rx_a) == 0 {
        w.admit();
        w.tick();
        ticks += 1;
        assert!(ticks < 100, "no first token");
    }
    let long = prompt(&"x".repeat(400));
    let (b, mut rx_b) = job(long.clone(), 3);
    submit(&mut w, b);
    let mut prefill_ticks = 0;
    loop {
        w.admit();
        w.tick();
        let b_started = tokens(&mut rx_b) > 0;
        // One token for the decoding session on every tick, the prefill tick included.
        assert_eq!(tokens(&mut rx_a), 1, "tick {prefill_ticks} of the prefill");
        if b_started {
            break;
        }
        prefill_ticks += 1;
        assert!(prefill_ticks < 1000, "the prefill does not finish");
    }
    assert!(prefill_ticks >= long.len() / 8, "a {}-token prefill in {prefill_ticks} ticks", long.len());
}

#[test]
fn the_ram_tier_is_bounded_by_bytes_not_by_count() {
    // The fake model charges 64 bytes per token: a budget of 150 tokens' worth keeps two ~68-token
    // conversations (prompt + reply) parked, not three; the least recently used one is evicted.
    let config = SchedulerConfig { max_parked_bytes: 150 * 64, ..Default::default() };
    let mut w = Worker::new(Box::new(FakeRunner::new(64)), None, config, Default::default(), Default::default());
    let run = |w: &mut Worker, p: Vec<u32>| {
        let (j, mut rx) = job(p, 100);
        w.queued.fetch_add(1, Ordering::SeqCst);
        w.waiting.push_back((j, Instant::now()));
        while w.active.len() + w.waiting.len() > 0 {
            w.admit();
            w.tick();
        }
        collect(&mut rx)
    };
    let prompts: Vec<Vec<u32>> = (0..3).map(|i| prompt(&format!("conversation {i}"))).collect();
    for p in &prompts {
        run(&mut w, p.clone());
    }
    let held = |w: &Worker, p: &[u32]| w.parked.iter().any(|s| s.tokens.starts_with(p));
    assert_eq!(w.parked.len(), 2, "bytes {}", w.parked_bytes());
    assert!(w.parked_bytes() <= 150 * 64);
    assert!(!held(&w, &prompts[0]) && held(&w, &prompts[1]) && held(&w, &prompts[2]));
    // Using the oldest one makes it recent: the next eviction takes the other.
    let (ev, _) = run(&mut w, prompts[1].clone());
    assert!(matches!(ev[0], JobEvent::Started { cached_tokens, .. } if cached_tokens + 1 >= prompts[1].len()));
    run(&mut w, prompts[0].clone());
    assert!(held(&w, &prompts[0]) && held(&w, &prompts[1]) && !held(&w, &prompts[2]));
    // Many small sessions fit where a count bound of 16 would have evicted: 40 sessions of 1 KiB.
    let config = SchedulerConfig { max_parked_bytes: 1 << 20, ..Default::default() };
    let mut w = Worker::new(Box::new(FakeRunner::new(128)), None, config, Default::default(), Default::default());
    for i in 0..40 {
        run(&mut w, prompt(&format!("q{i}")));
    }
    assert_eq!(w.parked.len(), 40);
}

#[test]
fn a_dropped_receiver_cancels_and_frees_the_slot() {
    let config = SchedulerConfig { max_active: 1, ..Default::default() };
    let runner = FakeRunner::new(4).with_delay(std::time::Duration::from_millis(2));
    let s = Scheduler::start(Box::new(runner), config, Arc::new(Metrics::default()));
    let (j, mut rx) = job(prompt("a long answer"), 10_000);
    s.submit(j).unwrap();
    // Wait for the first token, then hang up.
    loop {
        if let Some(JobEvent::Token(_)) = rx.blocking_recv() {
            break;
        }
    }
    drop(rx);
    // With max_active = 1 this only completes once the cancelled job has left the active set.
    let (j, mut rx) = job(prompt("next"), 100);
    s.submit(j).unwrap();
    assert_eq!(collect(&mut rx).1, "Hello! You said: next.");
    s.shutdown();
}

/// Gates a disk tier's restores (as a slow disk would): they run once the flag is set.
type Gate = Arc<(parking_lot::Mutex<bool>, parking_lot::Condvar)>;

/// The real engine (CPU; the trained demo model, or with `demo_seed` the random demo model, whose CSA and HCA layers
/// have paged rows) behind a scheduler with a disk tier in a fresh directory; `hold` gates its restores.
fn real_scheduler(
    max_parked: usize,
    hold: Option<Gate>,
    demo_seed: Option<u64>,
) -> (Scheduler, Arc<Metrics>, tempfile::TempDir) {
    use crate::engine::{load, LoadOptions};
    use crate::model::Runner;
    let opts = LoadOptions {
        placement: Default::default(),
        backend: ds4_engine::engine::BackendKind::Cpu,
        ctx: 2048,
        max_batch_tokens: 256,
        max_sessions: 16,
        active_sessions: 4,
        demo_seed,
    };
    let (runner, _codec, _info) = load(None, &opts).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut tier = DiskTier::open(runner.kv_layout().unwrap(), dir.path().to_path_buf(), 1 << 30).unwrap();
    tier.hold = hold;
    let metrics = Arc::new(Metrics::default());
    let config = SchedulerConfig { max_parked, context_size: 2048, prefill_chunk: 128, ..SchedulerConfig::default() };
    let s = Scheduler::start_with_tier(Box::new(runner), Some(tier), config, metrics.clone());
    (s, metrics, dir)
}

/// Token ids of the demo model's vocabulary, a different sequence per seed.
fn ids(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| 10 + (i * 7919 + seed * 104729) % 250).collect()
}

/// A greedy job with no end-of-sequence token (it runs to `max_tokens`).
fn greedy(prompt: Vec<u32>, max_tokens: usize) -> (GenRequest, UnboundedReceiver<JobEvent>) {
    let (tx, rx) = unbounded_channel();
    let sampling = SamplerConfig::greedy();
    let req =
        GenRequest { prompt, sampling, max_tokens, eos: vec![u32::MAX], system_block: 0, events: tx, constraint: None };
    (req, rx)
}

/// Waits until the tier has nothing queued and has written a checkpoint.
fn saves_done(metrics: &Metrics, dir: &std::path::Path) {
    let t0 = Instant::now();
    let checkpoint = || dir.read_dir().unwrap().any(|f| f.unwrap().path().extension().is_some_and(|x| x == "ckpt"));
    while metrics.kv_tier.get().unwrap().io_pending() > 0 || !checkpoint() {
        assert!(t0.elapsed().as_secs() < 60, "the saves never finished");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// The real engine behind a scheduler with a disk tier whose restores are held: a job whose prompt the tier holds
/// waits for its restore while another session keeps decoding, then starts from the restored prefix. The scheduler
/// thread never waits on the tier's I/O.
#[test]
fn a_restore_runs_off_the_scheduler_thread_while_others_decode() {
    let gate: Gate = Arc::default();
    // No RAM tier: a finished session goes to the disk tier (an eviction save), so the next prompt must restore.
    let (s, metrics, dir) = real_scheduler(0, Some(gate.clone()), None);
    // A 600-token prompt, saved on its way through (cold save after prefill, eviction save when it ends).
    let x = ids(1, 600);
    let (j, mut rx) = greedy(x.clone(), 2);
    s.submit(j).unwrap();
    let (ev, _) = collect(&mut rx);
    assert!(matches!(ev.last(), Some(JobEvent::Done(_))), "{ev:?}");
    saves_done(&metrics, dir.path());
    // A decoding job, then one whose prompt extends the saved one.
    let (a, mut rx_a) = greedy(ids(2, 40), 400);
    s.submit(a).unwrap();
    assert!(matches!(rx_a.blocking_recv(), Some(JobEvent::Started { cached_tokens: 0, .. })));
    let mut y = x.clone();
    y.extend(ids(3, 20));
    let (b, mut rx_b) = greedy(y.clone(), 3);
    s.submit(b).unwrap();
    // While the restore is held, the other session keeps getting tokens and the job waits, not started.
    let (mut decoded, t1) = (0, Instant::now());
    while decoded < 30 {
        match rx_a.try_recv() {
            Ok(JobEvent::Token(_)) => decoded += 1,
            Ok(other) => panic!("the decoding job stopped: {other:?}"),
            Err(_) => {
                assert!(t1.elapsed().as_secs() < 60, "decoding stalled while a restore was held ({decoded} tokens)");
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
    }
    assert!(rx_b.try_recv().is_err(), "the restoring job started before its restore came back");
    assert_eq!(metrics.kv_restoring.load(Ordering::Relaxed), 1);
    *gate.0.lock() = true;
    gate.1.notify_all();
    let (ev_b, _) = collect(&mut rx_b);
    match ev_b[0] {
        JobEvent::Started { prompt_tokens, cached_tokens } => {
            assert_eq!(prompt_tokens, y.len());
            assert!(cached_tokens >= 512 && cached_tokens <= x.len(), "restored {cached_tokens} of {}", x.len());
        }
        ref e => panic!("{e:?}"),
    }
    assert!(matches!(ev_b.last(), Some(JobEvent::Done(_))), "{ev_b:?}");
    assert!(metrics.prefix_hit_tokens(CacheTier::Disk) >= 512);
    // The decoding job was never held up: it finishes with all its tokens.
    let (ev_a, _) = collect(&mut rx_a);
    assert!(matches!(ev_a.last(), Some(JobEvent::Done(JobStopReason::Length))), "{ev_a:?}");
    s.shutdown();
}

/// One page identity at the server: a prompt restored from the disk tier while a live session holds its pages takes
/// them by key (counted as spans from RAM, none decoded) and starts from the whole saved prefix.
#[test]
fn a_restore_takes_the_pages_a_live_session_holds() {
    let (s, metrics, dir) = real_scheduler(0, None, Some(7));
    // A 600-token prompt that keeps decoding (its session stays live); its cold save registers its two full spans.
    let x = ids(4, 600);
    let (a, mut rx_a) = greedy(x.clone(), 300);
    s.submit(a).unwrap();
    assert!(matches!(rx_a.blocking_recv(), Some(JobEvent::Started { cached_tokens: 0, .. })));
    saves_done(&metrics, dir.path());
    let tier = metrics.kv_tier.get().unwrap().clone();
    assert_eq!(tier.pages().resident, 2, "the cold save registered the live session's full spans");
    // Another conversation with the same 600-token start: no parked session, so the disk tier restores it.
    let mut y = x.clone();
    y.extend(ids(5, 20));
    let (b, mut rx_b) = greedy(y.clone(), 3);
    s.submit(b).unwrap();
    let (ev_b, _) = collect(&mut rx_b);
    assert!(
        matches!(ev_b[0], JobEvent::Started { cached_tokens: 600, .. }),
        "the whole saved prefix is restored: {:?}",
        ev_b[0]
    );
    assert!(matches!(ev_b.last(), Some(JobEvent::Done(_))), "{ev_b:?}");
    let st = tier.pages();
    assert_eq!((st.joined, st.decoded), (2, 0), "both spans joined from RAM, none read and decoded");
    let text = metrics.render();
    assert!(text.contains("ds4_kv_restored_pages_total{from=\"ram\"} 2"), "{text}");
    let (ev_a, _) = collect(&mut rx_a);
    assert!(matches!(ev_a.last(), Some(JobEvent::Done(_))), "{ev_a:?}");
    s.shutdown();
}

/// The fake model behaving like a device engine asked for logit candidates: after a step, a session that asked
/// for `k` sees only its row's `k` best logits (the rest −∞); asking for 0 drops such a row. Records the requests.
struct Candidates {
    inner: FakeRunner,
    asked: Arc<Mutex<Vec<(RunnerSessionId, usize)>>>,
    k: std::collections::HashMap<RunnerSessionId, usize>,
    rows: std::collections::HashMap<RunnerSessionId, Option<Vec<f32>>>,
}

impl Runner for Candidates {
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }
    fn create_session(&mut self) -> Result<RunnerSessionId, crate::model::BackendError> {
        self.inner.create_session()
    }
    fn free_session(&mut self, session: RunnerSessionId) {
        self.k.remove(&session);
        self.rows.remove(&session);
        self.inner.free_session(session)
    }
    fn truncate(&mut self, session: RunnerSessionId, len: usize) -> bool {
        self.rows.remove(&session);
        self.inner.truncate(session, len)
    }
    fn can_truncate(&self) -> bool {
        self.inner.can_truncate()
    }
    fn fork(&mut self, session: RunnerSessionId) -> Option<RunnerSessionId> {
        assert!(self.rows.get(&session).is_none_or(|r| r.is_none()), "a partial row must not be forked");
        self.inner.fork(session)
    }
    fn feed(&mut self, session: RunnerSessionId, tokens: &[u32]) -> Result<(), crate::model::BackendError> {
        self.inner.feed(session, tokens)
    }
    fn step(&mut self) -> Result<(), crate::model::BackendError> {
        self.inner.step()?;
        self.rows.clear();
        for (&s, &k) in &self.k {
            if let Some(row) = self.inner.logits(s) {
                let (mut ids, mut vals) = (vec![0; k], vec![0.0; k]);
                ds4_engine::sampler::top_candidates(row, &mut ids, &mut vals);
                let mut part = vec![0.0; row.len()];
                ds4_engine::sampler::expand_candidates(&ids, &vals, &mut part);
                self.rows.insert(s, Some(part));
            }
        }
        Ok(())
    }
    fn logits(&self, session: RunnerSessionId) -> Option<&[f32]> {
        match self.rows.get(&session) {
            Some(row) => row.as_deref(),
            None => self.inner.logits(session),
        }
    }
    fn set_logit_candidates(&mut self, session: RunnerSessionId, k: usize) {
        self.asked.lock().push((session, k));
        if k > 0 {
            self.k.insert(session, k);
        } else {
            self.k.remove(&session);
            if self.rows.contains_key(&session) {
                self.rows.insert(session, None);
            }
        }
    }
}

#[test]
fn greedy_and_top_k_jobs_ask_for_candidates_after_their_first_token_only() {
    let asked = Arc::new(Mutex::new(Vec::new()));
    let runner =
        Candidates { inner: FakeRunner::new(8), asked: asked.clone(), k: Default::default(), rows: Default::default() };
    let s = Scheduler::start(Box::new(runner), Default::default(), Default::default());
    let p = prompt("hello");
    let (j, mut rx) = job(p.clone(), 100);
    s.submit(j).unwrap();
    let (_, text) = collect(&mut rx);
    assert_eq!(text, "Hello! You said: hello.", "the same text from the best logit alone");
    let calls = asked.lock().clone();
    assert_eq!(calls.iter().map(|c| c.1).collect::<Vec<_>>(), [1, 0], "k = 1 after the first token, 0 at the end");
    // Top-k sampling asks for k; top-p without top-k reads whole rows.
    for (sampling, want) in [
        (SamplerConfig { top_k: 5, temperature: 0.7, ..Default::default() }, Some(5)),
        (SamplerConfig { top_p: 0.9, temperature: 0.7, ..Default::default() }, None),
    ] {
        asked.lock().clear();
        let (mut j, mut rx) = job(prompt("again"), 100);
        j.sampling = sampling;
        s.submit(j).unwrap();
        collect(&mut rx);
        let ks: Vec<usize> = asked.lock().iter().map(|c| c.1).filter(|&k| k > 0).collect();
        assert_eq!(ks.first().copied(), want);
    }
    s.shutdown();
}
