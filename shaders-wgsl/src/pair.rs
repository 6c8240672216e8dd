//! Two independent dispatches of one kernel as one dispatch.
//!
//! A kernel file marks its bindings and per-row code between `// @rows-begin` and `// @rows-end`.
//! [`PairKernel::source`] appends to the file a copy of that region with the listed identifiers renamed (suffix
//! `_b`) and its bindings shifted past the file's, then an entry point (`wgsl/pair_*.wgsl`) that runs the
//! original code where the workgroup's z is 0 and the copy where it is 1: the pair of two dispatches with grids
//! `(x₁, y₁, 1)` and `(x₂, y₂, 1)` has the grid `(max x, max y, 2)`, each half bounds-checking its own range. Both halves run the same
//! code, so each computes exactly what it computes dispatched alone. The host pairs only dispatches that do not
//! depend on each other (the engine's `backend::wgpu::pairs`).

/// A kernel that can run two of its dispatches as one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PairKernel {
    /// Pipeline name of the pair.
    pub name: &'static str,
    /// The kernel's own source (with the marked region).
    pub base: &'static str,
    /// Identifiers of the region that the copy renames: its bindings and functions.
    pub names: &'static [&'static str],
    /// Added to each binding number of the copy.
    pub shift: u32,
    /// The pair's entry point and its source.
    pub entry: &'static str,
    pub entry_source: &'static str,
    /// Storage buffers one half binds (a pair binds twice as many).
    pub storage_bindings: u32,
}

impl PairKernel {
    /// `norm.wgsl`'s `norm_rope` twice: workgroup (x, y, h) is workgroup (x, y) of half h.
    pub const NORM_ROPE: PairKernel = PairKernel {
        name: "rms_norm_pair",
        base: crate::RMS_NORM,
        names: &["x", "y", "g", "p", "cs", "row_scale", "normed", "norm_row", "norm_rope_row"],
        shift: 5,
        entry: "norm_rope_pair",
        entry_source: include_str!("wgsl/pair_norm_rope.wgsl"),
        storage_bindings: 4,
    };

    /// `kvdev.wgsl`'s `front_push` twice: invocation (c, r, h) is value c of row r of half h.
    pub const FRONT_PUSH: PairKernel = PairKernel {
        name: "kvdev_pair",
        base: crate::KVDEV,
        names: &["ape", "p", "kv", "gate", "fkv", "fgate", "front_push_at"],
        shift: 6,
        entry: "front_push_pair",
        entry_source: include_str!("wgsl/pair_front_push.wgsl"),
        storage_bindings: 5,
    };

    /// Every pairable kernel.
    pub const ALL: [PairKernel; 2] = [PairKernel::NORM_ROPE, PairKernel::FRONT_PUSH];

    /// The pair's module: the kernel, the renamed copy of its marked region, the pair entry.
    pub fn source(&self) -> String {
        let (begin, end) = ("// @rows-begin", "// @rows-end");
        let region = self.base.find(begin).and_then(|a| self.base[a..].find(end).map(|b| &self.base[a..a + b]));
        let copy = rename_idents(region.unwrap_or_default(), self.names, "_b");
        let mut out = format!("{}\n", self.base);
        for line in copy.lines() {
            match line.strip_prefix("@group(0) @binding(").and_then(|r| r.split_once(')')) {
                Some((n, rest)) => {
                    let n: u32 = n.parse().unwrap_or(u32::MAX - self.shift);
                    out.push_str(&format!("@group(0) @binding({}){rest}\n", n + self.shift));
                }
                None => {
                    out.push_str(line);
                    out.push('\n');
                }
            }
        }
        out.push_str(self.entry_source);
        out
    }
}

/// `src` with each identifier in `names` (not after a `.`: members keep their names) given `suffix`.
fn rename_idents(src: &str, names: &[&str], suffix: &str) -> String {
    let mut out = String::with_capacity(src.len() + 64);
    let mut rest = src;
    let mut prev: Option<char> = None;
    while let Some(c) = rest.chars().next() {
        if c.is_ascii_alphabetic() || c == '_' {
            let len = rest.find(|ch: char| !(ch.is_ascii_alphanumeric() || ch == '_')).unwrap_or(rest.len());
            let word = &rest[..len];
            out.push_str(word);
            if prev != Some('.') && names.contains(&word) {
                out.push_str(suffix);
            }
            prev = word.chars().last();
            rest = &rest[len..];
        } else {
            out.push(c);
            prev = Some(c);
            rest = &rest[c.len_utf8()..];
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renaming_keeps_members_and_longer_names() {
        let got = rename_idents("let v = p.x + x[xb] + px;\nfn x() {}", &["x", "p"], "_b");
        assert_eq!(got, "let v = p_b.x + x_b[xb] + px;\nfn x_b() {}");
    }

    /// The copy of each pairable kernel's region binds only numbers past the kernel's own, each the shift past
    /// one of them.
    #[test]
    fn a_pair_binds_a_second_set_past_the_first() {
        let bindings = |src: &str| -> Vec<u32> {
            src.lines().filter_map(|l| l.strip_prefix("@group(0) @binding(")?.split_once(')')?.0.parse().ok()).collect()
        };
        for k in PairKernel::ALL {
            let (own, all) = (bindings(k.base), bindings(&k.source()));
            let added: Vec<u32> = all[own.len()..].to_vec();
            assert!(!added.is_empty(), "{}", k.name);
            let max = own.iter().max().copied().unwrap_or(0);
            assert!(added.iter().all(|&b| b > max && own.contains(&(b - k.shift))), "{}: {all:?}", k.name);
            assert!(k.source().contains(&format!("fn {}(", k.entry)));
        }
    }
}
