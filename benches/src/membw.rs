//! The memory-bandwidth roofline: a multi-threaded streaming read over a buffer far larger than the caches.
//!
//! Each thread reads its contiguous share of the buffer once per pass, 64 bytes at a time into eight independent
//! 64-bit accumulators (the compiler vectorises this into full-width loads with no dependency chain), and the sums
//! are passed through [`std::hint::black_box`] so the reads cannot be elided. The figure is only meaningful when the
//! buffer exceeds the last-level cache; callers size it (see `kernels::working_set`).

use std::hint::black_box;
use std::time::Duration;

use crate::par;

/// A bandwidth measurement.
#[derive(Clone, Copy, Debug)]
pub struct Bandwidth {
    /// Best-pass read bandwidth in GB/s (10^9 bytes per second).
    pub gbs: f64,
    /// Bytes read per pass.
    pub bytes: u64,
    /// Threads used.
    pub threads: usize,
    /// Passes run.
    pub passes: usize,
}

/// Sums a byte slice as u64 lanes; the result only exists to keep the loads alive.
#[inline(never)]
pub fn read_sum(buf: &[u8]) -> u64 {
    let mut acc = [0u64; 8];
    let mut chunks = buf.chunks_exact(64);
    for c in &mut chunks {
        for (i, a) in acc.iter_mut().enumerate() {
            let mut w = [0u8; 8];
            w.copy_from_slice(&c[i * 8..i * 8 + 8]);
            *a = a.wrapping_add(u64::from_ne_bytes(w));
        }
    }
    let tail: u64 = chunks.remainder().iter().map(|&b| b as u64).sum();
    acc.iter().fold(tail, |s, &a| s.wrapping_add(a))
}

/// Measures the read bandwidth over `buf` with `threads` threads: at least `min_passes`, then more until `budget`
/// is spent (at most 50). `tick` runs after each pass.
pub fn measure(buf: &[u8], threads: usize, min_passes: usize, budget: Duration, tick: impl FnMut()) -> Bandwidth {
    let ranges = par::split(buf.len(), threads, 4096);
    let t = par::best_of(
        min_passes,
        50,
        budget,
        || {
            par::for_each_range(&ranges, |_, r| {
                black_box(read_sum(black_box(&buf[r])));
            })
        },
        tick,
    );
    Bandwidth {
        gbs: par::gbs(buf.len() as u64, t.best),
        bytes: buf.len() as u64,
        threads: ranges.len(),
        passes: t.passes,
    }
}

/// The CSV header of the `membw` report.
pub const CSV_HEADER: &str = "bytes,threads,passes,gbs";

/// `ds4-bench membw`: read bandwidth for each buffer size in `sizes` and each thread count `1..=threads`, as CSV.
/// A size far below the last-level cache shows the read loop's in-cache speed (the loop is not the bottleneck
/// when it is several times the large-buffer figure).
pub fn sweep(
    sizes: &[usize],
    threads: usize,
    min_passes: usize,
    budget: Duration,
    out: &mut dyn std::io::Write,
    pb: &indicatif::ProgressBar,
) -> anyhow::Result<Vec<Bandwidth>> {
    writeln!(out, "{CSV_HEADER}")?;
    pb.set_length((sizes.len() * threads) as u64);
    let mut res = Vec::new();
    for &size in sizes {
        let mut buf = vec![0u8; size];
        crate::blocks::SplitMix64::new(size as u64).fill_bytes(&mut buf);
        for t in 1..=threads {
            pb.set_message(format!("{} MiB, {t} threads", size >> 20));
            let bw = measure(&buf, t, min_passes, budget, || {});
            writeln!(out, "{},{},{},{:.2}", bw.bytes, bw.threads, bw.passes, bw.gbs)?;
            res.push(bw);
            pb.inc(1);
        }
    }
    Ok(res)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_sum_adds_every_byte_lane() {
        let buf: Vec<u8> = (0..200u32).map(|i| (i % 251) as u8).collect();
        // Reference: the sum of the little/native-endian u64 words of full 64-byte chunks plus the tail bytes.
        let full = buf.len() / 64 * 64;
        let mut want = 0u64;
        for w in buf[..full].chunks_exact(8) {
            want = want.wrapping_add(u64::from_ne_bytes(w.try_into().unwrap()));
        }
        want = want.wrapping_add(buf[full..].iter().map(|&b| b as u64).sum::<u64>());
        assert_eq!(read_sum(&buf), want);
        assert_eq!(read_sum(&[]), 0);
    }

    #[test]
    fn sweep_writes_one_parseable_row_per_size_and_thread_count() {
        let mut out = Vec::new();
        let r = sweep(&[1 << 16, 1 << 18], 2, 1, Duration::ZERO, &mut out, &indicatif::ProgressBar::hidden()).unwrap();
        assert_eq!(r.len(), 4);
        let text = String::from_utf8(out).unwrap();
        let mut lines = text.lines();
        assert_eq!(lines.next(), Some(CSV_HEADER));
        let rows: Vec<Vec<f64>> = lines.map(|l| l.split(',').map(|f| f.parse().unwrap()).collect()).collect();
        assert_eq!(rows.len(), 4);
        assert_eq!((rows[0][0], rows[0][1]), ((1 << 16) as f64, 1.0));
        assert_eq!((rows[3][0], rows[3][1]), ((1 << 18) as f64, 2.0));
        assert!(rows.iter().all(|r| r[3] > 0.0));
    }

    #[test]
    fn measure_reports_positive_bandwidth() {
        let buf = vec![1u8; 1 << 20];
        let bw = measure(&buf, 2, 2, Duration::ZERO, || {});
        assert!(bw.gbs > 0.0 && bw.gbs.is_finite());
        assert_eq!(bw.bytes, 1 << 20);
        assert_eq!(bw.passes, 2);
        assert!(bw.threads >= 1 && bw.threads <= 2);
    }
}
