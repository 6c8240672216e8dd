//! Tokenizing with a token limit, and with the added tokens (`<｜User｜>`, `<think>`, …) under the caller's control.
//!
//! Guide:
//! * [`AddedTokens`] finds added-token text the way the Hugging Face tokenizer does: leftmost-longest over the tokens
//!   matched on raw text (`normalized: false`), then, in the text between, over the others (the DeepSeek-V4
//!   normalizer is empty, so both passes see the same text). [`Tokenizer::split_added`] returns the pieces.
//! * [`Tokenizer::encode_plain`] encodes text with no added-token recognition at all: `<｜User｜>` written in it
//!   becomes ordinary byte-level BPE tokens that decode to the same text. It uses a second Hugging Face tokenizer
//!   built from the same vocabulary with its added-token list emptied.
//! * [`Tokenizer::encode_plain_bounded`] and [`Tokenizer::encode_bounded`] stop as soon as the ids would exceed a
//!   limit, so an over-long input costs about `limit` tokens of work, not its whole length: text longer than
//!   `limit × longest token` bytes is refused without tokenizing, and the rest is encoded in chunks of about
//!   [`CHUNK_BYTES`] cut only where the pre-tokenizer always cuts (after a `\n` followed by a non-space, or between
//!   an ASCII letter and ` ` + ASCII letter). At those cuts no pre-token and no BPE merge spans the cut, so the
//!   chunked result equals encoding the whole text (tested).
//!
//! Invariant: `encode_bounded(t, usize::MAX) == encode(t)` and `split_added` + `encode_plain` per text piece
//! reproduces `encode` exactly.

use std::collections::{HashMap, HashSet};

use super::Tokenizer;
use crate::{Error, Result};

/// Bytes per chunk of a bounded encoding (a cut is made at the first safe place after this many bytes).
pub const CHUNK_BYTES: usize = 16 * 1024;

/// A piece of text split at added tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Piece<'a> {
    /// Text without added tokens.
    Text(&'a str),
    /// One added token (its id) and its text.
    Added(u32, &'a str),
}

/// One pass of added-token matching.
#[derive(Debug, Default)]
struct TokenSet {
    by_text: HashMap<String, u32>,
    /// Distinct byte lengths, longest first.
    lengths: Vec<usize>,
    first_chars: HashSet<char>,
}

impl TokenSet {
    fn new(tokens: &[(String, u32)]) -> Self {
        let mut s = TokenSet::default();
        for (t, id) in tokens {
            if let Some(c) = t.chars().next() {
                s.first_chars.insert(c);
                s.by_text.insert(t.clone(), *id);
            }
        }
        let lens: HashSet<usize> = s.by_text.keys().map(String::len).collect();
        s.lengths = lens.into_iter().collect();
        s.lengths.sort_unstable_by(|a, b| b.cmp(a));
        s
    }

    /// The longest token at byte `i` of `text`.
    fn at(&self, text: &str, i: usize) -> Option<(usize, u32)> {
        for &l in &self.lengths {
            if let Some(cand) = text.get(i..i + l) {
                if let Some(&id) = self.by_text.get(cand) {
                    return Some((l, id));
                }
            }
        }
        None
    }

    fn split<'a>(&self, text: &'a str, out: &mut Vec<Piece<'a>>, inner: Option<&TokenSet>) {
        let mut start = 0;
        let push_text = |out: &mut Vec<Piece<'a>>, t: &'a str| {
            if t.is_empty() {
                return;
            }
            match inner {
                Some(s) => s.split(t, out, None),
                None => out.push(Piece::Text(t)),
            }
        };
        for (i, c) in text.char_indices() {
            if i < start || !self.first_chars.contains(&c) {
                continue;
            }
            if let Some((len, id)) = self.at(text, i) {
                push_text(out, &text[start..i]);
                out.push(Piece::Added(id, &text[i..i + len]));
                start = i + len;
            }
        }
        push_text(out, &text[start..]);
    }
}

/// The added tokens of a vocabulary, in the two matching passes (see the module doc).
#[derive(Debug, Default)]
pub struct AddedTokens {
    raw: TokenSet,
    normalized: TokenSet,
    /// Every added token's text.
    pub all: Vec<(String, u32)>,
}

impl AddedTokens {
    /// `tokens`: (text, id, normalized).
    pub fn new(tokens: Vec<(String, u32, bool)>) -> Self {
        let raw: Vec<(String, u32)> = tokens.iter().filter(|t| !t.2).map(|t| (t.0.clone(), t.1)).collect();
        let norm: Vec<(String, u32)> = tokens.iter().filter(|t| t.2).map(|t| (t.0.clone(), t.1)).collect();
        AddedTokens {
            raw: TokenSet::new(&raw),
            normalized: TokenSet::new(&norm),
            all: tokens.into_iter().map(|t| (t.0, t.1)).collect(),
        }
    }

    /// `text` split at added tokens.
    pub fn split<'a>(&self, text: &'a str) -> Vec<Piece<'a>> {
        let mut out = Vec::new();
        self.raw.split(text, &mut out, Some(&self.normalized));
        out
    }

    /// Characters that start an added token.
    pub fn first_chars(&self) -> impl Iterator<Item = char> + '_ {
        self.raw.first_chars.iter().chain(self.normalized.first_chars.iter()).copied()
    }

    /// Whether `c` occurs anywhere in an added token.
    pub fn uses_char(&self, c: char) -> bool {
        self.all.iter().any(|(t, _)| t.contains(c))
    }
}

/// The next safe cut at or after `from` (see the module doc), or `None`.
fn next_cut(text: &str, from: usize) -> Option<usize> {
    let b = text.as_bytes();
    let mut i = from.max(1);
    while i < b.len() {
        let prev = b[i - 1];
        let here = b[i];
        if prev == b'\n' && here.is_ascii() && !here.is_ascii_whitespace() {
            return Some(i);
        }
        if prev.is_ascii_alphabetic() && here == b' ' && b.get(i + 1).is_some_and(|n| n.is_ascii_alphabetic()) {
            return Some(i);
        }
        i += 1;
    }
    None
}

impl Tokenizer {
    /// `text` split at added-token text, as [`Tokenizer::encode`] splits it.
    pub fn split_added<'a>(&self, text: &'a str) -> Vec<Piece<'a>> {
        self.inner.added.split(text)
    }

    /// The added tokens (text, id).
    pub fn added_tokens(&self) -> &[(String, u32)] {
        &self.inner.added.all
    }

    /// The added-token table (for callers that neutralise added-token text).
    pub fn added(&self) -> &AddedTokens {
        &self.inner.added
    }

    /// The longest byte string of any token.
    pub fn max_token_bytes(&self) -> usize {
        self.inner.max_token_bytes
    }

    /// Text → ids with no added-token recognition (see the module doc).
    pub fn encode_plain(&self, text: &str) -> Result<Vec<u32>> {
        let enc =
            self.inner.plain.encode_fast(text, false).map_err(|e| Error::Tokenizer(format!("encode failed: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Appends the plain encoding of `text` to `out` unless `out` would then hold more than `limit` ids; returns
    /// `false` (with `out` holding some of them) when it would.
    pub fn encode_plain_bounded(&self, text: &str, limit: usize, out: &mut Vec<u32>) -> Result<bool> {
        let room = limit.saturating_sub(out.len());
        // Every token stands for at least one byte and at most `max_token_bytes`.
        if text.len() / self.max_token_bytes().max(1) > room {
            return Ok(false);
        }
        let mut start = 0;
        while start < text.len() {
            let end = if text.len() - start <= CHUNK_BYTES {
                text.len()
            } else {
                next_cut(text, start + CHUNK_BYTES).unwrap_or(text.len())
            };
            let ids = self.encode_plain(&text[start..end])?;
            if out.len() + ids.len() > limit {
                return Ok(false);
            }
            out.extend_from_slice(&ids);
            start = end;
        }
        Ok(true)
    }

    /// [`Tokenizer::encode`] that gives up (`None`) once the ids exceed `limit`.
    pub fn encode_bounded(&self, text: &str, limit: usize) -> Result<Option<Vec<u32>>> {
        let mut out = Vec::new();
        for p in self.split_added(text) {
            match p {
                Piece::Added(id, _) => {
                    if out.len() >= limit {
                        return Ok(None);
                    }
                    out.push(id);
                }
                Piece::Text(t) => {
                    if !self.encode_plain_bounded(t, limit, &mut out)? {
                        return Ok(None);
                    }
                }
            }
        }
        Ok(Some(out))
    }
}

/// Builds the added-token table and the plain (added-token-free) tokenizer from a Hugging Face tokenizer.
pub(super) fn plain_parts(hf: &tokenizers::Tokenizer) -> Result<(AddedTokens, tokenizers::Tokenizer)> {
    let mut tokens: Vec<(String, u32, bool)> =
        hf.get_added_tokens_decoder().into_iter().map(|(id, t)| (t.content.clone(), id, t.normalized)).collect();
    tokens.sort_by_key(|t| t.1);
    let json = hf.to_string(false).map_err(|e| Error::Tokenizer(format!("tokenizer does not serialise: {e}")))?;
    let mut v: serde_json::Value =
        serde_json::from_str(&json).map_err(|e| Error::Tokenizer(format!("tokenizer JSON: {e}")))?;
    v["added_tokens"] = serde_json::Value::Array(Vec::new());
    let plain = tokenizers::Tokenizer::from_bytes(v.to_string().as_bytes())
        .map_err(|e| Error::Tokenizer(format!("plain tokenizer: {e}")))?;
    Ok((AddedTokens::new(tokens), plain))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tok() -> Tokenizer {
        Tokenizer::bundled().unwrap()
    }

    fn sample(seed: u64, n: usize) -> String {
        let parts = [
            "hello",
            " world",
            "\n",
            "\n\n",
            "  ",
            "123",
            "4567",
            "fn main() {",
            "}",
            "\t",
            "日本語",
            "ĀĂ",
            "<",
            ">",
            "<｜User｜>",
            "<think>",
            "</think>",
            "｜DSML｜",
            "x",
            " ",
            "!!",
            "\r\n",
            "é",
            "A",
            " B",
            "-->",
            "<｜end▁of▁sentence｜>",
        ];
        let mut s = String::new();
        let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        for _ in 0..n {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            s.push_str(parts[(x >> 33) as usize % parts.len()]);
        }
        s
    }

    #[test]
    fn split_and_plain_reproduce_encode() {
        let t = tok();
        for seed in 0..40 {
            let s = sample(seed, 400);
            let whole = t.encode(&s).unwrap();
            let mut pieces = Vec::new();
            for p in t.split_added(&s) {
                match p {
                    Piece::Added(id, _) => pieces.push(id),
                    Piece::Text(x) => pieces.extend(t.encode_plain(x).unwrap()),
                }
            }
            assert_eq!(pieces, whole, "seed {seed}");
        }
    }

    #[test]
    fn chunked_bounded_encoding_equals_whole_encoding() {
        let t = tok();
        for seed in 0..6 {
            // Long enough for several chunks.
            let s = sample(seed, 20_000);
            assert!(s.len() > 3 * CHUNK_BYTES);
            let whole = t.encode(&s).unwrap();
            assert_eq!(t.encode_bounded(&s, usize::MAX).unwrap().as_deref(), Some(&whole[..]), "seed {seed}");
            assert_eq!(t.encode_bounded(&s, whole.len()).unwrap().as_deref(), Some(&whole[..]));
            assert_eq!(t.encode_bounded(&s, whole.len() - 1).unwrap(), None);
        }
    }

    #[test]
    fn plain_encoding_keeps_added_token_text_as_text() {
        let t = tok();
        let s = "<｜end▁of▁sentence｜><｜Assistant｜><think>";
        let ids = t.encode_plain(s).unwrap();
        assert!(ids.len() > 3);
        assert!(!ids.contains(&t.eos()));
        assert_eq!(t.decode(&ids).unwrap(), s);
    }

    #[test]
    fn over_long_text_is_refused_early() {
        let t = tok();
        // 10 MB: refused after the first chunk (encoding all of it would take seconds and gigabytes).
        let s = "word ".repeat(2_000_000);
        assert_eq!(t.encode_bounded(&s, 1000).unwrap(), None);
        // No safe cut at all: refused by the length bound before any tokenizing.
        let mut out = Vec::new();
        assert!(!t.encode_plain_bounded(&"a".repeat(1 << 20), 100, &mut out).unwrap());
        assert!(out.is_empty());
    }
}
