//! Keeping the store within its budgets: removing entries and subtrees, the eviction order over candidates
//! ([`crate::policy`]), and the pins of live sessions (retain / release).

use super::*;

impl KvStore {
    /// Removes the entry `key` and everything below it, deleting files.
    pub(super) fn remove_subtree(&self, g: &mut Inner, key: &Key) {
        let Some(i) = g.t.find(key) else { return };
        for r in g.t.subtree_post_order(i) {
            self.remove_row(g, r);
        }
    }

    pub(super) fn remove_row(&self, g: &mut Inner, r: u32) {
        let u = r as usize;
        match &g.t.storage[u] {
            Storage::Disk => {
                let path = self.dir.join(disk::file_name(&g.t.key[u], g.t.kind[u]));
                if let Err(e) = fs::remove_file(&path) {
                    if e.kind() != std::io::ErrorKind::NotFound {
                        tracing::warn!(file = %path.display(), error = %e, "could not remove KV file");
                    }
                }
                g.st.files -= 1;
                g.st.bytes -= g.t.bytes[u];
            }
            Storage::Host(_) => {
                g.st.host_entries -= 1;
                g.st.host_bytes -= g.t.bytes[u];
            }
        }
        g.t.remove(r);
    }

    /// Evicts (see [`crate::policy`]) until the disk (or host) tier is within budget.
    pub(super) fn enforce_budget(&self, g: &mut Inner, host: bool) {
        let budget = if host { self.opts.host_budget_bytes } else { self.opts.disk_budget_bytes };
        let now = SystemTime::now();
        loop {
            let used = if host { g.st.host_bytes } else { g.st.bytes };
            if used <= budget {
                return;
            }
            let below = self.checkpoints_below(g);
            let cands: Vec<Candidate> =
                g.t.rows()
                    .filter(|&r| matches!(g.t.storage[r as usize], Storage::Host(_)) == host)
                    .map(|r| {
                        let u = r as usize;
                        let sharers = match g.t.kind[u] {
                            EntryKind::Page => below.get(&g.t.key[u]).copied().unwrap_or(0),
                            EntryKind::Checkpoint => below.get(&g.t.parent[u]).copied().unwrap_or(1).saturating_sub(1),
                        };
                        Candidate {
                            id: r as usize,
                            bytes: g.t.bytes[u],
                            hits: g.t.hits[u],
                            sharers,
                            age_secs: now.duration_since(g.t.last_use[u]).map(|d| d.as_secs_f64()).unwrap_or(0.0),
                            pinned: g.t.refcount[u] > 0,
                            children: g.t.children(&g.t.key[u]).len() as u32,
                        }
                    })
                    .collect();
            let Some(v) = policy::pick_victim(&cands, self.opts.half_life_secs) else {
                tracing::warn!(used, budget, host, "KV tier over budget but every entry is pinned or shared");
                return;
            };
            tracing::debug!(key = %g.t.key[v], "evicting KV entry");
            self.remove_row(g, v as u32);
            g.st.evicted += 1;
        }
    }

    /// For every page key (and the root): how many checkpoints hang in its subtree.
    pub(super) fn checkpoints_below(&self, g: &Inner) -> HashMap<Key, u32> {
        let mut below: HashMap<Key, u32> = HashMap::new();
        for r in g.t.rows() {
            let u = r as usize;
            if g.t.kind[u] != EntryKind::Checkpoint {
                continue;
            }
            let mut k = g.t.parent[u];
            loop {
                *below.entry(k).or_default() += 1;
                match g.t.find(&k) {
                    Some(p) => k = g.t.parent[p as usize],
                    None => break,
                }
            }
        }
        below
    }

    /// Pins entries for a live session: they are not evicted until [`KvStore::release`]. Stale ids are ignored;
    /// returns how many were pinned.
    pub fn retain(&self, session: u64, ids: &[EntryId]) -> usize {
        let mut g = self.inner.lock();
        let mut n = 0;
        for &id in ids {
            if let Some(i) = g.t.resolve(id) {
                g.t.refcount[i as usize] += 1;
                g.sessions.entry(session).or_default().push(id);
                n += 1;
            }
        }
        n
    }

    /// Drops every pin of `session`, then enforces the budgets.
    pub fn release(&self, session: u64) {
        let mut g = self.inner.lock();
        for id in g.sessions.remove(&session).unwrap_or_default() {
            if let Some(i) = g.t.resolve(id) {
                g.t.refcount[i as usize] -= 1;
            }
        }
        self.enforce_budget(&mut g, false);
        self.enforce_budget(&mut g, true);
    }
}
