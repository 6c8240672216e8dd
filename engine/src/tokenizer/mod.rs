//! The DeepSeek-V4 byte-level BPE tokenizer, from `tokenizer.json` or GGUF `tokenizer.ggml.*` metadata, and an
//! incremental detokenizer for streaming.
//!
//! Guide:
//! * [`Tokenizer`] wraps the Hugging Face `tokenizers` crate (pure Rust, `fancy-regex` for the look-ahead in the
//!   pre-tokenizer). Construct it with [`Tokenizer::from_json_file`], [`Tokenizer::from_json_bytes`],
//!   [`Tokenizer::from_gguf`] or [`Tokenizer::bundled`] (the vendored `engine/assets/tokenizer.json`).
//!   Cloning is cheap (shared handle).
//! * [`Tokenizer::encode`] never adds BOS; every added token (`<｜User｜>`, `<think>`, `｜DSML｜`, …) written in
//!   the text is recognised, longest first. The chat renderer writes `<｜begin▁of▁sentence｜>` itself.
//! * [`Tokenizer::decode`] is exact: ids → bytes (byte-level alphabet, added tokens as their text) → UTF-8, invalid
//!   sequences replaced by U+FFFD. Unknown ids are an error, never skipped silently.
//! * [`Tokenizer::encode_bounded`] stops once a limit is exceeded; [`Tokenizer::encode_plain`] recognises no added
//!   tokens (text that spells `<｜User｜>` stays text); see [`bounded`].
//! * [`StreamDecoder`] emits text as ids arrive and never splits a UTF-8 character.
//! * [`gguf_metadata_from_tokenizer_json`] (converter) and [`Tokenizer::from_gguf`] are inverse: the round trip
//!   tokenizer.json → metadata → GGUF → tokenizer reproduces every golden case (tested in `tests`).
//!
//! Invariants: ids are dense `0..vocab_size()`; BOS id 0, EOS id 1 for DeepSeek-V4 (looked up by name, not assumed).
//! Nothing here panics on bad input.

mod bounded;
pub(crate) mod bytelevel;
mod gguf_meta;
mod stream;

use std::path::Path;
use std::sync::Arc;

pub use bounded::{AddedTokens, Piece, CHUNK_BYTES};
pub use gguf_meta::{
    gguf_metadata_from_tokenizer_json, gguf_metadata_from_tokenizer_json_bytes, tokenizer_json_from_gguf,
    tokenizer_json_from_parts, GGUF_PRE, GGUF_PRE_ALIASES,
};
pub use stream::StreamDecoder;

use crate::gguf::GgufFile;
use crate::{Error, Result};

/// `<｜begin▁of▁sentence｜>` (id 0).
pub const BOS_TOKEN: &str = "<｜begin▁of▁sentence｜>";
/// `<｜end▁of▁sentence｜>` (id 1).
pub const EOS_TOKEN: &str = "<｜end▁of▁sentence｜>";
/// `<｜▁pad▁｜>` (id 2).
pub const PAD_TOKEN: &str = "<｜▁pad▁｜>";
/// `<｜User｜>`.
pub const USER_TOKEN: &str = "<｜User｜>";
/// `<｜Assistant｜>`.
pub const ASSISTANT_TOKEN: &str = "<｜Assistant｜>";
/// `<｜latest_reminder｜>`.
pub const LATEST_REMINDER_TOKEN: &str = "<｜latest_reminder｜>";
/// `<think>`.
pub const THINK_START_TOKEN: &str = "<think>";
/// `</think>`.
pub const THINK_END_TOKEN: &str = "</think>";
/// `｜DSML｜`: one token; DSML tags are `<` + this + `invoke …`.
pub const DSML_TOKEN: &str = "｜DSML｜";

/// The bundled DeepSeek-V4 `tokenizer.json` (the release's file, vendored so the demo model needs no other files).
pub fn bundled_tokenizer_json() -> &'static [u8] {
    include_bytes!("../../assets/tokenizer.json")
}

/// Ids of the special tokens the engine needs. `bos`/`eos` are required; the chat tokens are `None` for a
/// vocabulary that lacks them (tiny test vocabularies).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpecialTokens {
    pub bos: u32,
    pub eos: u32,
    pub pad: Option<u32>,
    pub user: Option<u32>,
    pub assistant: Option<u32>,
    pub latest_reminder: Option<u32>,
    pub think_start: Option<u32>,
    pub think_end: Option<u32>,
    pub dsml: Option<u32>,
}

struct Inner {
    hf: tokenizers::Tokenizer,
    /// Vocabulary string per id ("Ġthe", "<｜User｜>").
    pieces: Vec<String>,
    /// Bytes per id: offsets into `bytes`.
    offsets: Vec<u32>,
    bytes: Vec<u8>,
    special: SpecialTokens,
    /// Added tokens and a copy of `hf` without them (see [`bounded`]).
    added: AddedTokens,
    plain: tokenizers::Tokenizer,
    max_token_bytes: usize,
}

/// The tokenizer; see the module doc. Cheap to clone.
#[derive(Clone)]
pub struct Tokenizer {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer").field("vocab_size", &self.vocab_size()).field("special", &self.special()).finish()
    }
}

fn tok_err(msg: impl Into<String>) -> Error {
    Error::Tokenizer(msg.into())
}

impl Tokenizer {
    /// Loads a Hugging Face `tokenizer.json`.
    pub fn from_json_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
        Self::from_json_bytes(&bytes).map_err(|e| tok_err(format!("{}: {e}", path.display())))
    }

    /// Parses a Hugging Face `tokenizer.json` from memory.
    pub fn from_json_bytes(bytes: &[u8]) -> Result<Self> {
        let hf =
            tokenizers::Tokenizer::from_bytes(bytes).map_err(|e| tok_err(format!("invalid tokenizer.json: {e}")))?;
        Self::from_hf(hf, None, None)
    }

    /// The bundled DeepSeek-V4 tokenizer ([`bundled_tokenizer_json`]).
    pub fn bundled() -> Result<Self> {
        Self::from_json_bytes(bundled_tokenizer_json())
    }

    /// Rebuilds the tokenizer from a GGUF file's `tokenizer.ggml.*` metadata (see [`tokenizer_json_from_gguf`]).
    /// BOS/EOS come from `tokenizer.ggml.bos_token_id`/`eos_token_id` when present, else by name.
    pub fn from_gguf(f: &GgufFile) -> Result<Self> {
        let json = tokenizer_json_from_gguf(f)?;
        let hf = tokenizers::Tokenizer::from_bytes(&json)
            .map_err(|e| tok_err(format!("GGUF tokenizer metadata does not form a valid tokenizer: {e}")))?;
        let id_of = |key: &str| -> Result<Option<u32>> {
            match f.get(key) {
                None => Ok(None),
                Some(v) => v
                    .as_int()
                    .and_then(|x| u32::try_from(x).ok())
                    .map(Some)
                    .ok_or_else(|| tok_err(format!("{key} is not a valid token id: {v}"))),
            }
        };
        Self::from_hf(hf, id_of("tokenizer.ggml.bos_token_id")?, id_of("tokenizer.ggml.eos_token_id")?)
    }

    fn from_hf(hf: tokenizers::Tokenizer, bos: Option<u32>, eos: Option<u32>) -> Result<Self> {
        let n = hf.get_vocab_size(true);
        let mut pieces = Vec::with_capacity(n);
        let mut offsets = Vec::with_capacity(n + 1);
        let mut bytes = Vec::with_capacity(n * 8);
        offsets.push(0u32);
        for id in 0..n as u32 {
            let piece = hf
                .id_to_token(id)
                .ok_or_else(|| tok_err(format!("vocabulary has {n} entries but no token with id {id}")))?;
            bytes.extend_from_slice(&bytelevel::token_bytes(&piece));
            offsets.push(u32::try_from(bytes.len()).map_err(|_| tok_err("vocabulary too large"))?);
            pieces.push(piece);
        }
        let find = |s: &str| hf.token_to_id(s).filter(|&id| (id as usize) < n);
        let check = |id: Option<u32>, name: &str| -> Result<u32> {
            match id.or_else(|| find(name)) {
                Some(id) if (id as usize) < n => Ok(id),
                Some(id) => Err(tok_err(format!("{name} id {id} is outside the vocabulary of {n}"))),
                None => Err(tok_err(format!("vocabulary has no {name} token"))),
            }
        };
        let special = SpecialTokens {
            bos: check(bos, BOS_TOKEN)?,
            eos: check(eos, EOS_TOKEN)?,
            pad: find(PAD_TOKEN),
            user: find(USER_TOKEN),
            assistant: find(ASSISTANT_TOKEN),
            latest_reminder: find(LATEST_REMINDER_TOKEN),
            think_start: find(THINK_START_TOKEN),
            think_end: find(THINK_END_TOKEN),
            dsml: find(DSML_TOKEN),
        };
        tracing::debug!(vocab = n, ?special, "tokenizer loaded");
        let (added, plain) = bounded::plain_parts(&hf)?;
        let max_token_bytes = offsets.windows(2).map(|w| (w[1] - w[0]) as usize).max().unwrap_or(1).max(1);
        Ok(Tokenizer { inner: Arc::new(Inner { hf, pieces, offsets, bytes, special, added, plain, max_token_bytes }) })
    }

    /// Number of ids (base vocabulary plus added tokens).
    pub fn vocab_size(&self) -> usize {
        self.inner.pieces.len()
    }

    /// Special-token ids.
    pub fn special(&self) -> SpecialTokens {
        self.inner.special
    }

    /// BOS id.
    pub fn bos(&self) -> u32 {
        self.inner.special.bos
    }

    /// EOS id.
    pub fn eos(&self) -> u32 {
        self.inner.special.eos
    }

    /// The id of a token given its vocabulary string (e.g. `"<think>"`, `"Ġthe"`).
    pub fn token_id(&self, piece: &str) -> Option<u32> {
        self.inner.hf.token_to_id(piece).filter(|&id| (id as usize) < self.vocab_size())
    }

    /// Text → ids. No BOS is added; added tokens written in the text are recognised.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.inner.hf.encode_fast(text, false).map_err(|e| tok_err(format!("encode failed: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Ids → text, exactly (invalid UTF-8 across tokens becomes U+FFFD). Errors on an unknown id.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        let mut buf = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            buf.extend_from_slice(self.token_bytes(id)?);
        }
        Ok(match String::from_utf8(buf) {
            Ok(s) => s,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        })
    }

    /// The vocabulary string of a token (`"Ġthe"`, `"<｜User｜>"`), or `None` for an unknown id.
    pub fn token_to_piece(&self, id: u32) -> Option<&str> {
        self.inner.pieces.get(id as usize).map(String::as_str)
    }

    /// The bytes a token decodes to (may be part of a UTF-8 character). Errors on an unknown id.
    pub fn token_bytes(&self, id: u32) -> Result<&[u8]> {
        let i = id as usize;
        if i >= self.vocab_size() {
            return Err(tok_err(format!("token id {id} is outside the vocabulary of {}", self.vocab_size())));
        }
        let (a, b) = (self.inner.offsets[i] as usize, self.inner.offsets[i + 1] as usize);
        Ok(&self.inner.bytes[a..b])
    }

    /// A fresh incremental detokenizer.
    pub fn stream_decoder(&self) -> StreamDecoder {
        StreamDecoder::new(self)
    }

    /// The wrapped Hugging Face tokenizer (for checks against its own `decode`).
    pub fn hf(&self) -> &tokenizers::Tokenizer {
        &self.inner.hf
    }
}

#[cfg(test)]
mod tests;
