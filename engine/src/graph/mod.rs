//! The per-step job graph, as plain data.
//!
//! A tick's [`Batch`] covers several sessions, each contributing a run of consecutive tokens (a prefill chunk or
//! one decode token); rows of the batch are `(session, position, token)` triples, grouped by session in
//! [`Run`]s. The [`Graph`] lists [`Job`]s — one coarse [`Op`] each, at the level of `shared/spec/model.md` — with
//! the named buffers ([`BufId`]) and tables each reads and writes. Dependency counts are derived from those
//! declarations (read-after-write, write-after-read and write-after-write on the same resource), so an executor
//! may run any job whose count has dropped to zero.
//!
//! [`Graph::build`] reuses the graph's vectors: building a tick allocates nothing once capacities are reached.

/// Named activation buffers (and state tables) an op reads or writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BufId {
    /// mHC streams `[rows, hc·d]`.
    Streams,
    /// Sublayer input `[rows, d]` (collapsed streams).
    Collapsed,
    /// mHC `post` and `comb` of the current sublayer.
    HcWeights,
    /// Sublayer output `[rows, d]`.
    SublayerOut,
    /// Head output `[rows, d]` (normed).
    HeadOut,
    /// Output logits `[logit_rows, vocab]`.
    Logits,
    /// The per-session KV tables of layer `l`.
    Kv(usize),
}

/// Which sublayer an mHC site wraps.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Sub {
    Attn,
    Ffn,
}

/// One coarse op.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Embedding rows copied into every mHC stream.
    Embed,
    /// mHC pre-mix of a sublayer: pre/post/comb from the streams, collapsed sublayer input.
    HcPre { layer: usize, sub: Sub },
    /// Attention of a layer: norm, q/kv projections, rope, compressor, indexer, windowed + compressed attention
    /// with sinks, inverse rope, grouped output projection. Updates the layer's KV tables.
    Attention { layer: usize },
    /// mHC post-mix: streams ← post·f + combᵀ·streams.
    HcPost { layer: usize, sub: Sub },
    /// MoE FFN: norm, router (learned or hash), routed experts, shared expert.
    Moe { layer: usize },
    /// Final mHC collapse and output norm.
    HcHead,
    /// Output projection for the rows that want logits.
    Logits,
}

impl Op {
    /// Names of the op kinds, indexed by [`Op::kind`] (`hc_pre`/`hc_post` cover both sublayers).
    pub const KINDS: [&'static str; 7] = ["embed", "hc_pre", "attention", "hc_post", "moe", "hc_head", "logits"];

    /// The op's kind, an index into [`Op::KINDS`] (layers and sublayers folded together).
    pub fn kind(&self) -> usize {
        match self {
            Op::Embed => 0,
            Op::HcPre { .. } => 1,
            Op::Attention { .. } => 2,
            Op::HcPost { .. } => 3,
            Op::Moe { .. } => 4,
            Op::HcHead => 5,
            Op::Logits => 6,
        }
    }

    /// Buffers read and written by the op.
    pub fn access(&self) -> (&'static [BufId], &'static [BufId], Option<usize>) {
        use BufId::*;
        match *self {
            Op::Embed => (&[], &[Streams], None),
            Op::HcPre { .. } => (&[Streams], &[Collapsed, HcWeights], None),
            // Kv(layer) is returned separately (it is parameterised).
            Op::Attention { layer } => (&[Collapsed], &[SublayerOut], Some(layer)),
            Op::HcPost { .. } => (&[SublayerOut, HcWeights, Streams], &[Streams], None),
            Op::Moe { .. } => (&[Collapsed], &[SublayerOut], None),
            Op::HcHead => (&[Streams], &[HeadOut], None),
            Op::Logits => (&[HeadOut], &[Logits], None),
        }
    }
}

/// One row of a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Row {
    /// Index of the row's run in [`Batch::runs`].
    pub run: usize,
    /// Absolute position of the token in its session.
    pub pos: usize,
    pub token: u32,
}

/// The rows one session contributes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Run {
    /// Session slot.
    pub slot: usize,
    /// First row in the batch.
    pub start: usize,
    /// Number of rows (consecutive positions).
    pub len: usize,
    /// Whether every row wants logits (prefill logits), else only the last row.
    pub all_logits: bool,
}

/// A tick's batch.
#[derive(Clone, Debug, Default)]
pub struct Batch {
    pub rows: Vec<Row>,
    pub runs: Vec<Run>,
    /// Rows whose logits are computed, in output order.
    pub logit_rows: Vec<usize>,
}

impl Batch {
    /// Empties the batch, keeping capacity.
    pub fn clear(&mut self) {
        self.rows.clear();
        self.runs.clear();
        self.logit_rows.clear();
    }

    /// Appends a run of `tokens` for session `slot`, starting at position `pos0`.
    pub fn push_run(&mut self, slot: usize, pos0: usize, tokens: impl IntoIterator<Item = u32>, all_logits: bool) {
        let run = self.runs.len();
        let start = self.rows.len();
        for (i, token) in tokens.into_iter().enumerate() {
            self.rows.push(Row { run, pos: pos0 + i, token });
        }
        let len = self.rows.len() - start;
        self.runs.push(Run { slot, start, len, all_logits });
        if all_logits {
            self.logit_rows.extend(start..start + len);
        } else if len > 0 {
            self.logit_rows.push(start + len - 1);
        }
    }
}

/// A job: an op plus its dependency bookkeeping.
#[derive(Clone, Debug, PartialEq)]
pub struct Job {
    pub op: Op,
    /// Number of jobs this one waits for.
    pub deps: usize,
}

/// The job graph of one tick. See the module docs.
#[derive(Clone, Debug, Default)]
pub struct Graph {
    pub jobs: Vec<Job>,
    /// Edges `(from, to)`: `to` depends on `from`.
    pub edges: Vec<(usize, usize)>,
    last_writer: Vec<(BufId, usize)>,
    readers: Vec<(BufId, usize)>,
}

impl Graph {
    /// Builds the forward graph for `n_layers` layers.
    pub fn build(&mut self, n_layers: usize) {
        self.jobs.clear();
        self.edges.clear();
        self.last_writer.clear();
        self.readers.clear();
        self.push(Op::Embed);
        for layer in 0..n_layers {
            self.push(Op::HcPre { layer, sub: Sub::Attn });
            self.push(Op::Attention { layer });
            self.push(Op::HcPost { layer, sub: Sub::Attn });
            self.push(Op::HcPre { layer, sub: Sub::Ffn });
            self.push(Op::Moe { layer });
            self.push(Op::HcPost { layer, sub: Sub::Ffn });
        }
        self.push(Op::HcHead);
        self.push(Op::Logits);
    }

    fn add_edge(&mut self, from: usize, to: usize) {
        if from != to && !self.edges.contains(&(from, to)) {
            self.edges.push((from, to));
            self.jobs[to].deps += 1;
        }
    }

    /// Appends a job, deriving its dependencies from the declared accesses.
    pub fn push(&mut self, op: Op) -> usize {
        let id = self.jobs.len();
        self.jobs.push(Job { op, deps: 0 });
        let (reads, writes, kv) = op.access();
        let kv_buf = kv.map(BufId::Kv);
        let reads_it = reads.iter().copied();
        let writes_it = writes.iter().copied().chain(kv_buf);
        // Read after write.
        for b in reads_it.clone().chain(kv_buf) {
            if let Some(&(_, w)) = self.last_writer.iter().find(|(x, _)| *x == b) {
                self.add_edge(w, id);
            }
        }
        for b in writes_it {
            // Write after read / write after write.
            let mut i = 0;
            while i < self.readers.len() {
                let (x, r) = self.readers[i];
                if x == b {
                    self.add_edge(r, id);
                }
                i += 1;
            }
            if let Some(&(_, w)) = self.last_writer.iter().find(|(x, _)| *x == b) {
                self.add_edge(w, id);
            }
            self.readers.retain(|(x, _)| *x != b);
            match self.last_writer.iter_mut().find(|(x, _)| *x == b) {
                Some(e) => e.1 = id,
                None => self.last_writer.push((b, id)),
            }
        }
        for b in reads_it {
            self.readers.push((b, id));
        }
        id
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forward_graph_is_a_chain_in_op_order() {
        let mut g = Graph::default();
        g.build(2);
        assert_eq!(g.jobs.len(), 1 + 2 * 6 + 2);
        assert_eq!(g.jobs[0].deps, 0);
        // Every job after the first depends on its predecessor (directly or via buffers).
        for j in 1..g.jobs.len() {
            assert!(g.jobs[j].deps >= 1, "job {j} {:?} has no deps", g.jobs[j].op);
            assert!(g.edges.iter().all(|&(a, b)| a < b), "edges go forward");
        }
        // HcPost (attn) of layer 0 waits for the attention and the HcPre.
        let post = g.jobs.iter().position(|j| j.op == Op::HcPost { layer: 0, sub: Sub::Attn }).unwrap();
        assert!(g.edges.contains(&(2, post)) && g.edges.contains(&(1, post)));
    }

    #[test]
    fn batch_rows_and_logit_rows() {
        let mut b = Batch::default();
        b.push_run(3, 10, [7, 8, 9], false);
        b.push_run(1, 0, [5, 6], true);
        assert_eq!(b.rows.len(), 5);
        assert_eq!(b.rows[2], Row { run: 0, pos: 12, token: 9 });
        assert_eq!(b.runs[1], Run { slot: 1, start: 3, len: 2, all_logits: true });
        assert_eq!(b.logit_rows, vec![2, 3, 4]);
    }
}
