//! [`StreamDecoder`]: turns token ids into text one id at a time without ever emitting half a UTF-8 character.
//!
//! Byte-level BPE tokens may end in the middle of a multi-byte character; the decoder keeps such trailing bytes until
//! the next token completes them. Invalid byte sequences become U+FFFD exactly as `String::from_utf8_lossy` would
//! replace them in the whole text, so the concatenation of everything [`StreamDecoder::push`] and
//! [`StreamDecoder::finish`] return equals [`super::Tokenizer::decode`] of all ids.

use super::Tokenizer;
use crate::Result;

/// Incremental detokenizer; see the module doc. Cheap to create; holds a clone of the tokenizer handle.
#[derive(Clone)]
pub struct StreamDecoder {
    tok: Tokenizer,
    pending: Vec<u8>,
}

impl StreamDecoder {
    /// A decoder with nothing pending.
    pub fn new(tok: &Tokenizer) -> Self {
        StreamDecoder { tok: tok.clone(), pending: Vec::new() }
    }

    /// Adds one token; returns the text that became complete (often empty or one token's worth).
    /// Errors on an id outside the vocabulary (nothing is consumed then).
    pub fn push(&mut self, id: u32) -> Result<String> {
        let tok = self.tok.clone();
        let bytes = tok.token_bytes(id)?;
        Ok(self.push_bytes(bytes))
    }

    /// Adds raw bytes; returns the text that became complete.
    pub fn push_bytes(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        let mut start = 0;
        loop {
            match std::str::from_utf8(&self.pending[start..]) {
                Ok(s) => {
                    out.push_str(s);
                    start = self.pending.len();
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // SAFETY-free: from_utf8 said these bytes are valid UTF-8.
                    out.push_str(std::str::from_utf8(&self.pending[start..start + valid]).unwrap_or_default());
                    match e.error_len() {
                        Some(bad) => {
                            out.push('\u{FFFD}');
                            start += valid + bad;
                        }
                        None => {
                            // An incomplete character at the end: keep it for the next token.
                            start += valid;
                            break;
                        }
                    }
                }
            }
        }
        self.pending.drain(..start);
        out
    }

    /// Bytes held back (an incomplete character).
    pub fn pending(&self) -> &[u8] {
        &self.pending
    }

    /// Flushes what is held back (an incomplete character at the very end becomes U+FFFD) and resets.
    pub fn finish(&mut self) -> String {
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_split_anywhere_match_lossy() {
        let tok = crate::tokenizer::Tokenizer::bundled().unwrap();
        let samples: [&[u8]; 4] =
            ["héllo 世界 🎉".as_bytes(), b"\xff\xfeabc\xe4\xb8", b"\xe4\xb8\x96\xe7", "ab\u{1F600}".as_bytes()];
        for s in samples {
            for cut in 0..=s.len() {
                let mut d = StreamDecoder::new(&tok);
                let mut out = d.push_bytes(&s[..cut]);
                out += &d.push_bytes(&s[cut..]);
                out += &d.finish();
                assert_eq!(out, String::from_utf8_lossy(s), "cut {cut} of {s:?}");
            }
            let mut d = StreamDecoder::new(&tok);
            let mut out = String::new();
            for b in s {
                let piece = d.push_bytes(std::slice::from_ref(b));
                assert!(!piece.contains('\u{FFFD}') || String::from_utf8_lossy(s).contains('\u{FFFD}'));
                out += &piece;
            }
            out += &d.finish();
            assert_eq!(out, String::from_utf8_lossy(s));
        }
    }

    #[test]
    fn random_ids_stream_equals_decode() {
        use rand::{Rng, SeedableRng};
        let tok = crate::tokenizer::Tokenizer::bundled().unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        // Mostly single-byte tokens (ids below 256 hold the byte alphabet), so characters get split across ids.
        for _ in 0..200 {
            let ids: Vec<u32> = (0..rng.gen_range(1..40))
                .map(|_| if rng.gen_bool(0.7) { rng.gen_range(3..259) } else { rng.gen_range(0..129280) })
                .collect();
            let mut d = tok.stream_decoder();
            let mut out = String::new();
            for &id in &ids {
                out += &d.push(id).unwrap();
            }
            out += &d.finish();
            assert_eq!(out, tok.decode(&ids).unwrap(), "{ids:?}");
            assert_eq!(out, tok.hf().decode(&ids, false).unwrap());
        }
    }

    #[test]
    fn tokens_stream_equals_decode() {
        let tok = crate::tokenizer::Tokenizer::bundled().unwrap();
        let text = "Ciao 世界! 🎉🎉 naïve — <think>x</think><｜end▁of▁sentence｜>";
        let ids = tok.encode(text).unwrap();
        let mut d = tok.stream_decoder();
        let mut out = String::new();
        for &id in &ids {
            out += &d.push(id).unwrap();
        }
        out += &d.finish();
        assert_eq!(out, text);
        assert!(d.push(u32::MAX).is_err());
    }
}
