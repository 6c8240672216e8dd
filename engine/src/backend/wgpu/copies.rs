//! Buffer copies and zero fills inside the tick's compute pass, batched.
//!
//! A tick records many small row copies (the window ring, the roll-back log, the compressor frontiers, scratch
//! rows for a kernel). A copy command would end the compute pass, and one kernel per copy costs a dispatch each,
//! so [`WgpuContext::copy`] records a copy as a *segment* waiting in the encoder ([`Enc`]); the waiting segments
//! go out as one dispatch of `copy.wgsl` (up to [`CopyParams::SEGMENTS`] segments within the adapter's storage-binding limit, each bound to its own pair of
//! bindings) when the next dispatch is recorded, when the encoder is used for a raw command
//! ([`WgpuContext::raw_encoder`]) or submitted, or when a new segment would depend on a waiting one.
//!
//! Invariant: the segments of one dispatch are independent — none writes a buffer another reads (a buffer bound
//! read-only and read-write in one dispatch is also invalid in WebGPU), and no two write overlapping bytes — so
//! running them concurrently gives what running them in recording order gives, and everything recorded after
//! them sees their writes. Bits are copied exactly (u32 words). A copy that a kernel cannot do (not whole aligned
//! words, source and destination the same buffer, a range past one binding or past the grid) is a copy command,
//! after the waiting segments.

use std::sync::atomic::Ordering;

use ds4_shaders_wgsl::params::CopyParams;

use super::context::{Enc, WgpuContext};

/// One waiting copy (or the destination of a zero fill): each buffer bound at `(offset, size)` (size 0: whole),
/// with the copy's first word within that binding, and the absolute byte ranges for the dependence checks.
pub(crate) struct Segment {
    src: wgpu::Buffer,
    src_bind: (u64, u64, u32),
    src_bytes: (u64, u64),
    dst: wgpu::Buffer,
    dst_bind: (u64, u64, u32),
    dst_bytes: (u64, u64),
    words: u32,
}

fn overlap(a: (u64, u64), b: (u64, u64)) -> bool {
    a.0 < b.1 && b.0 < a.1
}

impl Segment {
    /// Whether `self` may run in the same dispatch as `other` (see the module invariant).
    fn independent_of(&self, other: &Segment) -> bool {
        self.dst != other.src
            && self.src != other.dst
            && (self.dst != other.dst || !overlap(self.dst_bytes, other.dst_bytes))
    }
}

impl WgpuContext {
    /// Records a copy of `bytes` bytes from `src` at `src_at` to `dst` at `dst_at` (see the module docs: batched
    /// with the copies around it where they are independent, a copy command where a kernel cannot do it).
    pub fn copy(&self, enc: &mut Enc, src: &wgpu::Buffer, src_at: u64, dst: &wgpu::Buffer, dst_at: u64, bytes: u64) {
        if bytes == 0 {
            return;
        }
        self.flush_held(enc);
        match self.segment(src, src_at, dst, dst_at, bytes) {
            Some(seg) => {
                let full = enc.pending.len() >= self.copy_segments();
                if full || enc.pending.iter().any(|p| !seg.independent_of(p)) {
                    self.flush_copies(enc);
                }
                enc.pending.push(seg);
            }
            None => self.raw_encoder(enc).copy_buffer_to_buffer(src, src_at, dst, dst_at, bytes),
        }
    }

    /// Records zeroing `bytes` bytes of `b` at `at`: a kernel where it can (after the waiting copies), else a
    /// clear command.
    pub fn clear(&self, enc: &mut Enc, b: &wgpu::Buffer, at: u64, bytes: u64) {
        if bytes == 0 {
            return;
        }
        self.flush_copies(enc);
        let words = bytes / 4;
        let fits = bytes.is_multiple_of(4) && at.is_multiple_of(4) && self.grid(words).is_some();
        let done = fits
            && self.window(b, at, bytes).is_some_and(|w| {
                let mut s = [[0; 4]; CopyParams::SEGMENTS];
                s[0] = [words as u32, 0, w.2, 0];
                let p = CopyParams { s };
                self.copy_dispatch(enc, "zero", p, &[(2, b, w.0, w.1)], words)
            });
        if !done {
            self.raw_encoder(enc).clear_buffer(b, at, Some(bytes));
        }
    }

    /// The encoder itself, for a command outside the compute pass: the waiting copies go out first and the open
    /// pass ends.
    pub fn raw_encoder<'e>(&self, enc: &'e mut Enc) -> &'e mut wgpu::CommandEncoder {
        self.flush_copies(enc);
        enc.end_pass();
        &mut enc.enc
    }

    /// Records the held dispatch ([`super::pairs`]) and the waiting copies: one dispatch for all of them (they
    /// are independent by construction).
    pub(super) fn flush_copies(&self, enc: &mut Enc) {
        self.flush_held(enc);
        self.flush_segments(enc);
    }

    /// Records the waiting copies only (a held dispatch never waits beside them).
    pub(super) fn flush_segments(&self, enc: &mut Enc) {
        if enc.pending.is_empty() {
            return;
        }
        let segs = std::mem::take(&mut enc.pending);
        let mut p = CopyParams::default();
        let mut bound = Vec::with_capacity(2 * segs.len());
        let mut widest = 0;
        for (i, s) in segs.iter().enumerate() {
            p.s[i] = [s.words, s.src_bind.2, s.dst_bind.2, 0];
            let b = 1 + 2 * i as u32;
            bound.push((b, &s.src, s.src_bind.0, s.src_bind.1));
            bound.push((b + 1, &s.dst, s.dst_bind.0, s.dst_bind.1));
            widest = widest.max(u64::from(s.words));
        }
        if !self.copy_dispatch(enc, &format!("copy{}", segs.len()), p, &bound, widest) {
            // The kernel could not be recorded (its pipeline failed to build): copy commands, in order.
            let raw = self.raw_encoder(enc);
            for s in &segs {
                let (from, to) = (s.src_bytes.0, s.dst_bytes.0);
                raw.copy_buffer_to_buffer(&s.src, from, &s.dst, to, s.src_bytes.1 - from);
            }
        }
    }

    /// Records one dispatch of `copy.wgsl`'s `entry` over `words` words; `false` where it could not.
    fn copy_dispatch(
        &self,
        enc: &mut Enc,
        entry: &str,
        p: CopyParams,
        bound: &[(u32, &wgpu::Buffer, u64, u64)],
        words: u64,
    ) -> bool {
        let Some(groups) = self.grid(words) else { return false };
        let Ok(pl) = self.pipeline_lazy("copy", entry, || ds4_shaders_wgsl::copy_source().into()) else { return false };
        let ub = self.uniform("copy", &p);
        let mut all = vec![(0, &ub, 0, 0)];
        all.extend_from_slice(bound);
        let ok = self.record(enc, &pl, &all, [groups, 1, 1]).is_ok();
        if ok {
            self.copy_kernels.fetch_add(1, Ordering::Relaxed);
        }
        ok
    }

    /// How many segments one copy dispatch binds: two storage bindings each, within the adapter's limit.
    fn copy_segments(&self) -> usize {
        (self.limits.max_storage_buffers_per_shader_stage as usize / 2).clamp(1, CopyParams::SEGMENTS)
    }

    /// Workgroups of 64 for `words` words, where the grid allows.
    fn grid(&self, words: u64) -> Option<u32> {
        let g = words.div_ceil(64);
        (g <= u64::from(self.limits.max_compute_workgroups_per_dimension)).then_some(g as u32)
    }

    /// The copy as a kernel segment; `None` where a copy command must do it.
    fn segment(&self, src: &wgpu::Buffer, src_at: u64, dst: &wgpu::Buffer, dst_at: u64, bytes: u64) -> Option<Segment> {
        let aligned = bytes.is_multiple_of(4) && src_at.is_multiple_of(4) && dst_at.is_multiple_of(4);
        if src == dst || !aligned {
            return None;
        }
        self.grid(bytes / 4)?;
        Some(Segment {
            src_bind: self.window(src, src_at, bytes)?,
            dst_bind: self.window(dst, dst_at, bytes)?,
            src: src.clone(),
            src_bytes: (src_at, src_at + bytes),
            dst: dst.clone(),
            dst_bytes: (dst_at, dst_at + bytes),
            words: u32::try_from(bytes / 4).ok()?,
        })
    }

    /// The binding of `bytes` bytes of `b` at `at`: `(offset, size, first word within it)`, size 0 for the whole
    /// buffer (when it fits a binding); `None` when the range does not fit one or its word offset overflows u32.
    fn window(&self, b: &wgpu::Buffer, at: u64, bytes: u64) -> Option<(u64, u64, u32)> {
        if !b.usage().contains(wgpu::BufferUsages::STORAGE) {
            return None;
        }
        if b.size() <= self.max_binding {
            return u32::try_from(at / 4).ok().map(|w| (0, 0, w));
        }
        let align = u64::from(self.limits.min_storage_buffer_offset_alignment.max(4));
        let start = at / align * align;
        let size = (at - start + bytes).next_multiple_of(4);
        (size <= self.max_binding && start + size <= b.size()).then_some((start, size, ((at - start) / 4) as u32))
    }
}
