//! Residency: where each tensor's current value is during a run with a fallback backend, and the copies that
//! keep it where the next node runs (see [`super`]'s docs).

use super::exec_err;
use crate::backend::{Backend, StepCtx};
use crate::graph::{BufId, Op};
use crate::Result;

/// Where each tensor's current value is during a run with a fallback backend (see the module docs).
#[derive(Debug, Default)]
pub(super) struct Residency {
    /// Per tensor ([`BufId::index`]): bit 0 set when the primary backend holds the current value, bit 1 the
    /// fallback; 0 before the tick writes it.
    valid: Vec<u8>,
    /// The KV pages are host memory both sides use (the primary keeps no device KV): always valid on both.
    host_kv: bool,
    /// Host staging of one copied tensor.
    host: Vec<f32>,
    /// Copies inserted by the last run.
    pub(super) copies: usize,
    /// Bytes those copies moved (f32 values), to the primary and to the fallback.
    pub(super) bytes: CopiedBytes,
}

/// Bytes the residency copies of one run moved between the two backends (see [`super::Executor::copied_bytes`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CopiedBytes {
    /// Into the primary backend (uploads: on a device primary, host to device).
    pub to_primary: u64,
    /// Into the fallback backend (downloads from the primary: device to host).
    pub to_fallback: u64,
    /// Rows of the tick (tokens): the copies scale with them.
    pub rows: usize,
}

impl CopiedBytes {
    /// `(to_primary, to_fallback)` per row (token) of the tick.
    pub fn per_row(&self) -> (f64, f64) {
        let r = self.rows.max(1) as f64;
        (self.to_primary as f64 / r, self.to_fallback as f64 / r)
    }
}

/// The two backends of a run (the fallback, if any, as host fallback or forced placement).
#[derive(Clone, Copy)]
pub(super) struct Pair<'a> {
    pub(super) primary: &'a dyn Backend,
    pub(super) fallback: Option<&'a dyn Backend>,
}

impl Pair<'_> {
    /// The backend of side `s` (0 primary, 1 fallback).
    pub(super) fn side(&self, s: usize) -> Result<&dyn Backend> {
        match s {
            0 => Ok(self.primary),
            _ => self.fallback.ok_or_else(|| exec_err("a node is placed on the fallback, but none is given")),
        }
    }
}

impl Residency {
    /// Starts a tick over `nbuf` tensors: only the KV pages have a value, and they live with the primary backend
    /// (`host_kv`: in host memory, where both backends use them).
    pub(super) fn begin(&mut self, nbuf: usize, rows: usize, host_kv: bool) {
        self.valid.clear();
        self.valid.resize(nbuf, 0);
        self.host_kv = host_kv;
        self.valid[BufId::FIXED..].fill(if host_kv { 3 } else { 1 });
        self.copies = 0;
        self.bytes = CopiedBytes { rows, ..CopiedBytes::default() };
    }

    /// Makes the current value of every input of `op` present on side `s`, copying from the other side where it
    /// is not.
    pub(super) fn inputs_on(&mut self, op: &Op, s: usize, be: Pair<'_>, cx: &mut StepCtx<'_>) -> Result<()> {
        let bit = 1u8 << s;
        let mut need = [None; 8];
        let mut n = 0;
        op.inputs(|b| {
            if n < need.len() && !need[..n].contains(&Some(b)) {
                need[n] = Some(b);
                n += 1;
            }
        });
        for b in need[..n].iter().flatten() {
            let v = self.valid[b.index()];
            if v == 0 || v & bit != 0 {
                continue;
            }
            let width = b.host_width(&cx.model.config).ok_or_else(|| {
                exec_err(format!("{} needs {b:?} on the other backend, and it has no host layout", op.name()))
            })?;
            self.host.clear();
            self.host.resize(cx.batch.rows.len() * width, 0.0);
            be.side(1 - s)?.download(*b, cx, &mut self.host)?;
            be.side(s)?.upload(*b, cx, &self.host)?;
            self.valid[b.index()] |= bit;
            self.copies += 1;
            let bytes = (self.host.len() * std::mem::size_of::<f32>()) as u64;
            match s {
                0 => self.bytes.to_primary += bytes,
                _ => self.bytes.to_fallback += bytes,
            }
        }
        Ok(())
    }

    /// Whether the current value of `b` lives on the fallback only (written there, never copied back).
    pub(super) fn only_on_fallback(&self, b: BufId) -> bool {
        self.valid.get(b.index()).is_some_and(|&v| v == 2)
    }

    /// Records that `op` ran on side `s`: what it wrote now lives there only.
    pub(super) fn wrote(&mut self, op: &Op, s: usize) {
        let (valid, host_kv) = (&mut self.valid, self.host_kv);
        op.access(|_| {}, |b| valid[b.index()] = if host_kv && matches!(b, BufId::Kv(_)) { 3 } else { 1 << s });
    }
}
