//! Eviction policy: which entry goes first when a tier is over its byte budget.
//!
//! Rules, in order:
//! 1. **Pinned entries are never evicted**: pages and checkpoints retained by a live session.
//! 2. **Leaves first**: an entry that is the parent of another entry (a page followed by pages or checkpoints) is never
//!    evicted before its children. A shared system-prompt prefix is the parent of every conversation built on it, so it
//!    stays as long as any of them does; removing interior pages would also orphan their (then useless) children.
//! 3. Among leaves, the lowest **value** goes first:
//!    `value = (1 + hits + sharers) · 2^(−age / half_life) / bytes`, where `hits` counts lookups that reused the entry
//!    (in this process), `sharers` counts the *other* checkpoints in the subtree of the entry's prefix (a structural
//!    measure of sharing that survives restarts: a checkpoint at the end of a shared system prompt has every
//!    conversation's checkpoint below it), `age` is the time since last use (file mtime across restarts) and `bytes` the
//!    stored size. Ties go to the least recently used, then to the lower id.
//!
//! The reference C engine scores whole-session files by `(hits·2^(−age/6h) + 1) · tokens / bytes` with no structure, so a
//! small shared prefix loses to long one-off sessions; here the prefix cannot lose while anything built on it remains.
//! The loop in [`pick_victim`] is O(n) per eviction; the store recomputes sharers once per eviction round.

/// One entry as the policy sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct Candidate {
    /// Caller's id (returned by [`pick_victim`]).
    pub id: usize,
    /// Stored bytes.
    pub bytes: u64,
    /// Lookups that reused it.
    pub hits: u32,
    /// Other checkpoints below its prefix.
    pub sharers: u32,
    /// Seconds since last use.
    pub age_secs: f64,
    /// Retained by a live session.
    pub pinned: bool,
    /// Number of entries whose parent it is.
    pub children: u32,
}

/// The value of keeping `c` (higher = keep longer).
pub fn value(c: &Candidate, half_life_secs: f64) -> f64 {
    let decay = (-c.age_secs.max(0.0) / half_life_secs.max(1.0)).exp2();
    (1.0 + c.hits as f64 + c.sharers as f64) * decay / c.bytes.max(1) as f64
}

/// The evictable candidate (unpinned leaf) with the lowest value, if any.
pub fn pick_victim(cands: &[Candidate], half_life_secs: f64) -> Option<usize> {
    cands
        .iter()
        .filter(|c| !c.pinned && c.children == 0)
        .map(|c| (value(c, half_life_secs), c))
        .min_by(|(va, a), (vb, b)| va.total_cmp(vb).then(b.age_secs.total_cmp(&a.age_secs)).then(a.id.cmp(&b.id)))
        .map(|(_, c)| c.id)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(id: usize, bytes: u64, hits: u32, sharers: u32, age: f64) -> Candidate {
        Candidate { id, bytes, hits, sharers, age_secs: age, pinned: false, children: 0 }
    }

    #[test]
    fn interior_and_pinned_entries_are_never_picked() {
        let mut v = vec![c(0, 100, 0, 0, 1e9), c(1, 100, 50, 0, 0.0)];
        v[0].children = 1;
        assert_eq!(pick_victim(&v, 3600.0), Some(1));
        v[1].pinned = true;
        assert_eq!(pick_victim(&v, 3600.0), None);
    }

    #[test]
    fn shared_hits_and_recency_keep_entries() {
        let v = vec![c(0, 100, 0, 9, 0.0), c(1, 100, 0, 0, 0.0), c(2, 100, 3, 0, 0.0)];
        assert_eq!(pick_victim(&v, 3600.0), Some(1));
        let v = vec![c(0, 100, 0, 0, 10.0), c(1, 100, 0, 0, 7200.0)];
        assert_eq!(pick_victim(&v, 3600.0), Some(1));
        // equal value: the older one goes, then the lower id
        let v = vec![c(4, 100, 0, 0, 0.0), c(3, 100, 0, 0, 0.0)];
        assert_eq!(pick_victim(&v, 3600.0), Some(3));
        // bigger entries cost more to keep
        let v = vec![c(0, 100, 0, 0, 0.0), c(1, 1000, 0, 0, 0.0)];
        assert_eq!(pick_victim(&v, 3600.0), Some(1));
    }
}
