//! Per-dispatch GPU times from timestamp queries, where the adapter has them (`wgpu::Features::TIMESTAMP_QUERY`:
//! most Vulkan, Metal and DX12 drivers, and Mesa's lavapipe).
//!
//! While timing is on ([`super::context::WgpuContext::start_timing`]), every dispatch's compute pass writes a
//! timestamp at its start and end into a query set (up to [`TIMED_DISPATCHES`] dispatches; later ones are not
//! timed), labelled with its pipeline (`matmul_Q8_0_sg32::multi`, …); [`super::context::WgpuContext::finish_timing`]
//! resolves them (one submission and one readback of its own, outside what a tick counts) and returns each timed
//! dispatch's seconds. A pass per dispatch is what the backend records, so the begin/end pair of a pass is its
//! dispatch.

/// Most dispatches one timing window records (a query set holds at most 4096 queries in wgpu, two per dispatch).
pub const TIMED_DISPATCHES: u32 = 2048;

/// One timing window (see the module docs).
pub(super) struct Timing {
    pub(super) set: wgpu::QuerySet,
    pub(super) resolve: wgpu::Buffer,
    /// The pipeline of each timed dispatch, in order.
    pub(super) labels: Vec<String>,
}

impl Timing {
    pub(super) fn new(device: &wgpu::Device) -> Self {
        let set = device.create_query_set(&wgpu::QuerySetDescriptor {
            label: Some("dispatch timestamps"),
            ty: wgpu::QueryType::Timestamp,
            count: 2 * TIMED_DISPATCHES,
        });
        let resolve = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("dispatch timestamps"),
            size: 2 * TIMED_DISPATCHES as u64 * 8,
            usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        Self { set, resolve, labels: Vec::new() }
    }

    /// The timestamp writes of the next dispatch, labelled `label`, or `None` when the window is full.
    pub(super) fn next(&mut self, label: &str) -> Option<wgpu::ComputePassTimestampWrites<'_>> {
        let i = u32::try_from(self.labels.len()).ok().filter(|&i| i < TIMED_DISPATCHES)?;
        self.labels.push(label.to_string());
        Some(wgpu::ComputePassTimestampWrites {
            query_set: &self.set,
            beginning_of_pass_write_index: Some(2 * i),
            end_of_pass_write_index: Some(2 * i + 1),
        })
    }
}

/// Seconds of each dispatch from resolved `(begin, end)` timestamp pairs (`words`: little-endian u32 halves) and
/// the queue's nanoseconds per tick; a pair whose end precedes its begin (a driver quirk) counts as 0.
pub(super) fn durations(words: &[u32], period_ns: f32) -> Vec<f64> {
    let stamp = |w: &[u32]| u64::from(w[0]) | (u64::from(w[1]) << 32);
    words
        .chunks_exact(4)
        .map(|p| stamp(&p[2..]).saturating_sub(stamp(&p[..2])) as f64 * period_ns as f64 * 1e-9)
        .collect()
}

/// Seconds and dispatches per label, largest total first.
pub fn by_label(times: &[(String, f64)]) -> Vec<(String, f64, usize)> {
    let mut out: Vec<(String, f64, usize)> = Vec::new();
    for (label, s) in times {
        match out.iter_mut().find(|o| &o.0 == label) {
            Some(o) => {
                o.1 += s;
                o.2 += 1;
            }
            None => out.push((label.clone(), *s, 1)),
        }
    }
    out.sort_by(|a, b| b.1.total_cmp(&a.1));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_from_resolved_pairs() {
        // (begin 10, end 25) and (begin 2^32 + 5, end 2^32 + 9), 2 ns per tick; a reversed pair counts 0.
        let words = [10, 0, 25, 0, 5, 1, 9, 1, 9, 0, 3, 0];
        let d = durations(&words, 2.0);
        assert_eq!(d.len(), 3);
        assert!((d[0] - 30e-9).abs() < 1e-15 && (d[1] - 8e-9).abs() < 1e-15 && d[2] == 0.0, "{d:?}");
        let g = by_label(&[("a".into(), 1.0), ("b".into(), 3.0), ("a".into(), 1.5)]);
        assert_eq!(g, vec![("b".into(), 3.0, 1), ("a".into(), 2.5, 2)]);
    }
}
