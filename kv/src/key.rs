//! Keys: 20-byte SHA1 digests naming pages and checkpoints, chained over token ids.
//!
//! * [`ModelIdentity`]: the caller's description of everything that changes KV values (architecture, sizes, quant
//!   recipe, activation-simulation flag). Only its hash enters keys; the text is kept in file headers for humans.
//! * Root key = `SHA1("ds4-kv/root" ‖ identity hash ‖ span_tokens)`: different models or page spans never share keys.
//! * Page key = `SHA1("ds4-kv/page" ‖ parent key ‖ token ids as u32 LE)` over exactly one span of tokens.
//! * Checkpoint key = `SHA1("ds4-kv/ckpt" ‖ prefix page key ‖ tail token ids)`; the tail (tokens after the last full
//!   page, possibly none) is part of the key, so one prefix can have checkpoints at several positions.
//!
//! Keys only name content; the store still compares stored token ids on lookup, so a hash collision cannot hand a
//! session the wrong rows.

use std::fmt;

use sha1::{Digest, Sha1};

/// A SHA1 digest naming a page, a checkpoint or a chain root.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Key(pub [u8; 20]);

impl Key {
    /// Lowercase hex, 40 characters (the file name stem).
    pub fn hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Parses 40 hex characters.
    pub fn from_hex(s: &str) -> Option<Key> {
        if s.len() != 40 || !s.is_ascii() {
            return None;
        }
        let mut k = [0u8; 20];
        for (i, slot) in k.iter_mut().enumerate() {
            *slot = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
        }
        Some(Key(k))
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.hex())
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Key({})", &self.hex()[..12])
    }
}

fn digest(parts: &[&[u8]]) -> Key {
    let mut h = Sha1::new();
    for p in parts {
        h.update(p);
    }
    Key(h.finalize().into())
}

fn token_bytes(h: &mut Sha1, tokens: &[u32]) {
    for t in tokens {
        h.update(t.to_le_bytes());
    }
}

/// What makes KV values of one model configuration differ from another's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelIdentity {
    text: String,
    hash: Key,
}

impl ModelIdentity {
    /// From a caller-built description, e.g. `"deepseek4-flash layers=43 dim=4096 quant=q2-imatrix sim=1"`.
    /// Any byte change gives a different identity.
    pub fn new(text: impl Into<String>) -> ModelIdentity {
        let text = text.into();
        let hash = digest(&[b"ds4-kv/model", text.as_bytes()]);
        ModelIdentity { text, hash }
    }

    /// The description text.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// The identity hash written into every file header.
    pub fn hash(&self) -> Key {
        self.hash
    }

    /// The root of the key chain for pages of `span_tokens` tokens.
    pub fn root(&self, span_tokens: u32) -> Key {
        digest(&[b"ds4-kv/root", &self.hash.0, &span_tokens.to_le_bytes()])
    }
}

/// The key of the page holding `tokens` (one full span) after the page keyed `parent`.
pub fn page_key(parent: &Key, tokens: &[u32]) -> Key {
    let mut h = Sha1::new();
    h.update(b"ds4-kv/page");
    h.update(parent.0);
    token_bytes(&mut h, tokens);
    Key(h.finalize().into())
}

/// The key of the checkpoint taken after the page chain ending at `prefix` plus `tail` tokens.
pub fn checkpoint_key(prefix: &Key, tail: &[u32]) -> Key {
    let mut h = Sha1::new();
    h.update(b"ds4-kv/ckpt");
    h.update(prefix.0);
    token_bytes(&mut h, tail);
    Key(h.finalize().into())
}

/// Incremental page-key chain over a token stream: feed tokens, read the key of every completed span.
#[derive(Clone, Debug)]
pub struct PrefixHasher {
    span: usize,
    key: Key,
    pending: Vec<u32>,
    pages: usize,
}

impl PrefixHasher {
    /// Starts a chain for `identity` with pages of `span_tokens` tokens (must be > 0).
    pub fn new(identity: &ModelIdentity, span_tokens: u32) -> PrefixHasher {
        PrefixHasher {
            span: span_tokens.max(1) as usize,
            key: identity.root(span_tokens),
            pending: Vec::new(),
            pages: 0,
        }
    }

    /// Feeds tokens; returns the keys of the pages completed by them, in order.
    pub fn push(&mut self, tokens: &[u32]) -> Vec<Key> {
        let mut done = Vec::new();
        for &t in tokens {
            self.pending.push(t);
            if self.pending.len() == self.span {
                self.key = page_key(&self.key, &self.pending);
                self.pending.clear();
                self.pages += 1;
                done.push(self.key);
            }
        }
        done
    }

    /// Key of the last completed page (the root when none).
    pub fn key(&self) -> Key {
        self.key
    }

    /// Full pages hashed so far.
    pub fn pages(&self) -> usize {
        self.pages
    }

    /// Tokens after the last full page.
    pub fn tail(&self) -> &[u32] {
        &self.pending
    }

    /// Key of a checkpoint at the current position.
    pub fn checkpoint_key(&self) -> Key {
        checkpoint_key(&self.key, &self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_matches_direct_keys_and_depends_on_everything() {
        let id = ModelIdentity::new("m sim=1");
        let toks: Vec<u32> = (0..10).collect();
        let mut h = PrefixHasher::new(&id, 4);
        let keys = h.push(&toks[..3]);
        assert!(keys.is_empty());
        let keys2 = h.push(&toks[3..]);
        let k1 = page_key(&id.root(4), &toks[0..4]);
        let k2 = page_key(&k1, &toks[4..8]);
        assert_eq!(keys2, vec![k1, k2]);
        assert_eq!(h.tail(), &[8, 9]);
        assert_eq!(h.checkpoint_key(), checkpoint_key(&k2, &[8, 9]));
        assert_ne!(ModelIdentity::new("m sim=0").root(4), id.root(4));
        assert_ne!(id.root(8), id.root(4));
        assert_ne!(page_key(&k1, &[1, 2, 3, 4]), page_key(&k1, &[1, 2, 3, 5]));
        assert_ne!(checkpoint_key(&k1, &[]), k1);
    }

    #[test]
    fn hex_round_trip() {
        let k = page_key(&Key::default(), &[7]);
        assert_eq!(Key::from_hex(&k.hex()), Some(k));
        assert_eq!(Key::from_hex("xyz"), None);
        assert_eq!(Key::from_hex(&"g".repeat(40)), None);
        assert_eq!(Key::from_hex(&"é".repeat(20)), None);
    }
}
