//! The CPU decode loop allocates nothing once warm, on every thread (the pool's workers included), for quantized
//! weights (activation quantization, grouped MoE dispatch) as well as f32 ones.
//!
//! KV rows live in pages of 256 tokens (`ds4_engine::tables::pages`): the step whose row fills a page allocates
//! the next page (its buffer and its `Arc`), two allocations per paged table, once every 256 tokens; every other
//! step allocates nothing. Both are asserted, the first with steps that cross a page boundary.
//!
//! This binary holds one test on purpose: its global allocator counts the allocations of every thread while the
//! counting window is open, which is only meaningful when no other test runs alongside.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use ds4_engine::engine::{argmax, Engine, EngineOptions};
use ds4_tests::{golden_gguf, shared};

struct Counting;

static COUNTING: AtomicBool = AtomicBool::new(false);
static ALLOCS: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator; the bookkeeping is two atomics.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            ALLOCS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            ALLOCS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(p, l, n) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Allocations (all threads) during `steps` decode steps after a prefill of `prompt` and three warm-up steps.
fn decode_allocs(recipe: &str, threads: usize, steps: usize, prompt: &[u32]) -> Option<usize> {
    let sh = shared()?;
    let gguf = golden_gguf(&sh, "tiny-a", recipe);
    let mut e = Engine::open(&gguf, EngineOptions { threads, ..EngineOptions::default() }).expect("open engine");
    let s = e.create_session();
    e.feed(s, prompt).unwrap();
    e.run_until_idle().unwrap();
    for _ in 0..3 {
        let t = argmax(e.logits(s).unwrap());
        e.feed(s, &[t]).unwrap();
        e.run_until_idle().unwrap();
    }
    ALLOCS.store(0, Ordering::SeqCst);
    COUNTING.store(true, Ordering::SeqCst);
    for _ in 0..steps {
        let t = argmax(e.logits(s).unwrap());
        e.feed(s, &[t]).unwrap();
        e.step().unwrap();
    }
    COUNTING.store(false, Ordering::SeqCst);
    Some(ALLOCS.load(Ordering::SeqCst))
}

#[test]
fn cpu_decode_steps_do_not_allocate_on_any_thread() {
    // q2: IQ2_XXS gate/up (Q8_K activations) with Q8_0 downs and shared expert (Q8_0 activations); q4: Q4_K.
    for recipe in ["q2", "q4", "f32"] {
        for threads in [1usize, 2, 3] {
            let Some(n) = decode_allocs(recipe, threads, 12, &[0, 5, 17, 42, 9, 100, 3, 77, 1, 2]) else { return };
            assert_eq!(n, 0, "{recipe}, {threads} threads: {n} allocations in 12 decode steps");
        }
    }
    // Positions 250..266 cross the first page boundary (token 256) of every paged table (ratio 4: row 64 at token
    // 259; ratio 8: row 32 at token 263): tiny-a has two CSA layers (compressed + indexer rows) and two HCA layers,
    // six tables, one new page of two allocations each.
    let prompt: Vec<u32> = (0..247u32).map(|i| (i * 37 + 11) % 500).collect();
    let Some(n) = decode_allocs("f32", 2, 16, &prompt) else { return };
    assert_eq!(n, 12, "{n} allocations in 16 decode steps across a page boundary (want 6 tables x 2)");
}
