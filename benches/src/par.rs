//! Splitting work across all cores with std scoped threads, and timing repeated passes.
//!
//! [`split`] cuts `0..n` into `parts` contiguous ranges whose lengths differ by at most one `align` unit;
//! [`for_each_range`] runs a closure on each range on its own thread (the calling thread takes the last range).
//! [`best_of`] repeats a pass until a time budget is spent and keeps the fastest pass, the usual STREAM convention,
//! applied the same way to the bandwidth probe and to the kernels so their ratio is fair.

use std::ops::Range;
use std::time::{Duration, Instant};

/// Splits `0..n` into at most `parts` contiguous ranges, each a multiple of `align` long (except possibly the
/// last when `n` is not a multiple of `align`). Empty ranges are dropped.
pub fn split(n: usize, parts: usize, align: usize) -> Vec<Range<usize>> {
    let align = align.max(1);
    let units = n.div_ceil(align);
    let parts = parts.clamp(1, units.max(1));
    let mut out = Vec::with_capacity(parts);
    let mut start = 0usize;
    for p in 0..parts {
        let u = units / parts + usize::from(p < units % parts);
        let end = (start + u * align).min(n);
        if end > start {
            out.push(start..end);
        }
        start = end;
    }
    out
}

/// Runs `f(part_index, range)` for each range on its own scoped thread; the calling thread runs the last one.
pub fn for_each_range<F>(ranges: &[Range<usize>], f: F)
where
    F: Fn(usize, Range<usize>) + Sync,
{
    let Some((last, rest)) = ranges.split_last() else { return };
    std::thread::scope(|s| {
        for (i, r) in rest.iter().enumerate() {
            let f = &f;
            let r = r.clone();
            s.spawn(move || f(i, r));
        }
        f(rest.len(), last.clone());
    });
}

/// Result of repeated timed passes.
#[derive(Clone, Copy, Debug)]
pub struct Timing {
    /// The fastest pass.
    pub best: Duration,
    /// Passes run.
    pub passes: usize,
}

/// Runs `pass` at least `min_passes` times and until `budget` has elapsed (at most `max_passes`), returning the
/// fastest pass time. `tick` is called after each pass (progress bars).
pub fn best_of(
    min_passes: usize,
    max_passes: usize,
    budget: Duration,
    mut pass: impl FnMut(),
    mut tick: impl FnMut(),
) -> Timing {
    let start = Instant::now();
    let mut best = Duration::MAX;
    let mut passes = 0usize;
    while passes < max_passes.max(1) && (passes < min_passes.max(1) || start.elapsed() < budget) {
        let t = Instant::now();
        pass();
        let d = t.elapsed();
        best = best.min(d);
        passes += 1;
        tick();
    }
    Timing { best, passes }
}

/// Bytes per second as GB/s (10^9, the unit memory bandwidth is quoted in).
pub fn gbs(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64().max(1e-12) / 1e9
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn split_covers_exactly_once() {
        for n in [0usize, 1, 7, 64, 1000, 4097] {
            for parts in 1..6 {
                for align in [1usize, 4, 32] {
                    let r = split(n, parts, align);
                    assert!(r.len() <= parts);
                    let mut next = 0;
                    for x in &r {
                        assert_eq!(x.start, next);
                        assert!(x.end > x.start);
                        if x.end != n {
                            assert_eq!((x.end - x.start) % align, 0, "n={n} parts={parts} align={align}");
                        }
                        next = x.end;
                    }
                    assert_eq!(next, n);
                }
            }
        }
    }

    #[test]
    fn split_is_balanced() {
        let r = split(100, 3, 1);
        let lens: Vec<usize> = r.iter().map(|x| x.len()).collect();
        assert_eq!(lens, vec![34, 33, 33]);
    }

    #[test]
    fn for_each_range_visits_every_range() {
        let ranges = split(1000, 4, 1);
        let sum = AtomicUsize::new(0);
        let calls = AtomicUsize::new(0);
        for_each_range(&ranges, |_, r| {
            sum.fetch_add(r.sum::<usize>(), Ordering::Relaxed);
            calls.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(sum.into_inner(), (0..1000).sum::<usize>());
        assert_eq!(calls.into_inner(), 4);
    }

    #[test]
    fn best_of_respects_pass_bounds() {
        let mut n = 0;
        let t = best_of(3, 5, Duration::ZERO, || n += 1, || {});
        assert_eq!(n, 3);
        assert_eq!(t.passes, 3);
        let mut m = 0;
        let t = best_of(1, 4, Duration::from_secs(3600), || m += 1, || {});
        assert_eq!((m, t.passes), (4, 4));
    }
}
