//! Constrained decoding: JSON schemas, regular expressions and Lark grammars turned into per-token masks, with
//! [`llguidance`].
//!
//! Guide:
//! * [`ConstraintFactory`] is built once per model from the tokenizer's byte-level vocabulary: every added token
//!   (`<｜end▁of▁sentence｜>`, `</think>`, `｜DSML｜`, …) is marked special (llguidance's 0xFF prefix), so free text
//!   in a grammar can never produce one — a grammar names them explicitly (`<[128825]>`); the vocabulary is padded
//!   with empty (never allowed) entries up to the logits size, so a mask covers every logit.
//!   [`ConstraintFactory::from_vocab`] builds one over any other vocabulary (the server's byte-token test model).
//! * [`ConstraintFactory::compile`] turns a [`GrammarSpec`] into a [`Constraint`] (one per request). Compilation is
//!   bounded by llguidance's fuel limits and by [`MAX_GRAMMAR_BYTES`]; an unsupported keyword, a malformed schema,
//!   regex or grammar, or a grammar that admits nothing is a [`GrammarError`] naming the problem. JSON schemas are
//!   compiled with fixed separators (`", "`, `": "`) and no free whitespace, so the output is one canonical JSON
//!   text and a model that rambles still has to make progress through the schema.
//! * [`Constraint`]: [`Constraint::mask`] (the ids allowed next, a bit set over the logits), [`Constraint::consume`]
//!   (advance by the sampled id), [`Constraint::validate`] (how many of a draft's ids the grammar accepts, for
//!   speculative decoding), [`Constraint::is_accepting`]. Once the grammar is complete the mask holds only EOS.
//! * [`TokenMask`] is what the sampler applies ([`crate::sampler::Sampler::sample_masked`]).
//!
//! Nothing here panics on bad input: llguidance catches its own internal panics and reports them as errors.

use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;
use toktrie::{TokEnv, TokRxInfo, TokTrie, TokenizerEnv};

use crate::tokenizer::Tokenizer;
use crate::{Error, Result};

/// The largest schema or grammar text accepted (bytes of its JSON or source text).
pub const MAX_GRAMMAR_BYTES: usize = 256 * 1024;

/// What a request constrains its output to.
#[derive(Clone, Debug, PartialEq)]
pub enum GrammarSpec {
    /// A JSON Schema (draft 2020-12 subset: types, `properties`, `required`, `additionalProperties`, `items`,
    /// `prefixItems`, `enum`, `const`, `anyOf`/`oneOf`/`allOf`, `$ref` to `#/$defs/…`, string and array bounds,
    /// `pattern`, `format`, number bounds). `true` / `{}` is any JSON value.
    JsonSchema(Value),
    /// A regular expression the whole output must match.
    Regex(String),
    /// A Lark grammar (llguidance's dialect: `%json { … }`, special tokens as `<[id]>`).
    Lark(String),
}

impl GrammarSpec {
    /// Any JSON object (OpenAI's `json_object` mode).
    pub fn any_json_object() -> Self {
        GrammarSpec::JsonSchema(serde_json::json!({"type": "object"}))
    }

    fn size(&self) -> usize {
        match self {
            GrammarSpec::JsonSchema(v) => serde_json::to_string(v).map_or(usize::MAX, |s| s.len()),
            GrammarSpec::Regex(s) | GrammarSpec::Lark(s) => s.len(),
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            GrammarSpec::JsonSchema(_) => "JSON schema",
            GrammarSpec::Regex(_) => "regex",
            GrammarSpec::Lark(_) => "Lark grammar",
        }
    }
}

/// Why a schema or grammar was refused (phrased for the client: a 400).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GrammarError(pub String);

impl fmt::Display for GrammarError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for GrammarError {}

/// The JSON compile options put into every schema: fixed separators, no free whitespace.
fn json_options() -> Value {
    serde_json::json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "})
}

/// `schema` with llguidance's compile options added (as `x-guidance`) where it is an object.
pub fn with_json_options(schema: Value) -> Value {
    match schema {
        Value::Object(mut m) => {
            m.entry("x-guidance").or_insert_with(json_options);
            Value::Object(m)
        }
        // `true` is any value; `false` admits nothing (compiling it reports that).
        Value::Bool(true) => serde_json::json!({"x-guidance": json_options()}),
        other => other,
    }
}

/// The token environment llguidance works in: our vocabulary as a trie, greedy tokenization for grammar literals.
struct Env {
    trie: TokTrie,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        self.trie.greedy_tokenize(s)
    }

    fn tokenize_is_canonical(&self) -> bool {
        false
    }
}

/// Compiles grammars for one model (see the module doc). Cheap to share (`Arc` inside).
#[derive(Clone)]
pub struct ConstraintFactory {
    inner: Arc<ParserFactory>,
    logits: usize,
    eos: u32,
}

impl fmt::Debug for ConstraintFactory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConstraintFactory").field("logits", &self.logits).field("eos", &self.eos).finish()
    }
}

impl ConstraintFactory {
    /// The factory for `tok`'s vocabulary, padded to `logits` entries (the model's output width; at least the
    /// tokenizer's vocabulary).
    pub fn new(tok: &Tokenizer, logits: usize) -> Result<Self> {
        let n = tok.vocab_size();
        if logits < n {
            return Err(Error::InvalidArgument(format!(
                "the logits row has {logits} entries, fewer than the tokenizer's {n} tokens"
            )));
        }
        let mut special: HashSet<u32> = tok.added_tokens().iter().map(|(_, id)| *id).collect();
        special.insert(tok.eos());
        special.insert(tok.bos());
        let tokens = (0..n as u32).map(|id| tok.token_bytes(id).map(<[u8]>::to_vec)).collect::<Result<Vec<_>>>()?;
        Self::build(&tokens, &special, tok.eos(), Some(tok.bos()), tok.special().pad, logits)
    }

    /// A factory over an explicit vocabulary (a stand-in model's): `tokens[i]` is the bytes of id `i`, the ids in
    /// `special` are marked special (a grammar names them as `<[id]>`; free text never produces them), `eos` ends
    /// the output, and masks cover `logits` ids (at least `tokens.len()`).
    pub fn from_vocab(tokens: &[Vec<u8>], special: &[u32], eos: u32, logits: usize) -> Result<Self> {
        if logits < tokens.len() || eos as usize >= logits {
            return Err(Error::InvalidArgument(format!(
                "a vocabulary of {} tokens with EOS {eos} does not fit {logits} logits",
                tokens.len()
            )));
        }
        let special: HashSet<u32> = special.iter().copied().chain([eos]).collect();
        Self::build(tokens, &special, eos, None, None, logits)
    }

    fn build(
        tokens: &[Vec<u8>],
        special: &HashSet<u32>,
        eos: u32,
        bos: Option<u32>,
        pad: Option<u32>,
        logits: usize,
    ) -> Result<Self> {
        let mut words = Vec::with_capacity(logits);
        for (id, bytes) in tokens.iter().enumerate() {
            if special.contains(&(id as u32)) {
                let mut w = Vec::with_capacity(bytes.len() + 1);
                w.push(TokTrie::SPECIAL_TOKEN_MARKER);
                w.extend_from_slice(bytes);
                words.push(w);
            } else {
                words.push(bytes.clone());
            }
        }
        words.resize(logits, Vec::new());
        let mut info = TokRxInfo::new(logits as u32, eos);
        info.tok_bos = bos;
        info.tok_pad = pad;
        let trie = TokTrie::from(&info, &words);
        let env: TokEnv = Arc::new(Env { trie });
        let mut factory = ParserFactory::new_simple(&env)
            .map_err(|e| Error::InvalidArgument(format!("cannot build the grammar factory: {e}")))?;
        factory.quiet();
        Ok(ConstraintFactory { inner: Arc::new(factory), logits, eos })
    }

    /// Entries of a mask (the logits width).
    pub fn logits(&self) -> usize {
        self.logits
    }

    /// Compile `spec` into a fresh constraint; see the module doc for what is refused.
    pub fn compile(&self, spec: &GrammarSpec) -> std::result::Result<Constraint, GrammarError> {
        let size = spec.size();
        if size > MAX_GRAMMAR_BYTES {
            return Err(GrammarError(format!(
                "the {} is {size} bytes; at most {MAX_GRAMMAR_BYTES} are accepted",
                spec.kind()
            )));
        }
        let grammar = match spec {
            GrammarSpec::JsonSchema(v) => {
                if !(v.is_object() || v.is_boolean()) {
                    return Err(GrammarError("a JSON schema must be an object or a boolean".into()));
                }
                TopLevelGrammar::from_json_schema(with_json_options(v.clone()))
            }
            GrammarSpec::Regex(r) => TopLevelGrammar::from_regex(r),
            GrammarSpec::Lark(l) => TopLevelGrammar::from_lark(l.clone()),
        };
        let parser = self.inner.create_parser(grammar).map_err(|e| GrammarError(tidy(spec.kind(), &e.to_string())))?;
        let mut c = Constraint { matcher: Matcher::new(Ok(parser)), logits: self.logits, eos: self.eos };
        // The first mask also proves the grammar admits something (an unsatisfiable schema is refused here).
        let first = c.mask().map_err(|e| GrammarError(tidy(spec.kind(), &e.to_string())))?;
        if first.count() == 0 {
            return Err(GrammarError(format!("the {} admits no output", spec.kind())));
        }
        Ok(c)
    }
}

/// One line, prefixed with what was being compiled.
fn tidy(kind: &str, msg: &str) -> String {
    let msg = msg.trim();
    let msg: String = msg.chars().take(2000).collect();
    format!("invalid {kind}: {msg}")
}

/// The ids allowed next: a bit set over the logits (bit `i % 32` of word `i / 32`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TokenMask {
    words: Vec<u32>,
    len: usize,
}

impl TokenMask {
    /// A mask over `len` ids allowing exactly `ids`.
    pub fn from_ids(len: usize, ids: impl IntoIterator<Item = u32>) -> Self {
        let mut m = TokenMask { words: vec![0; len.div_ceil(32)], len };
        for id in ids {
            if (id as usize) < len {
                m.words[id as usize / 32] |= 1 << (id % 32);
            }
        }
        m
    }

    /// Whether `id` is allowed.
    pub fn allows(&self, id: u32) -> bool {
        let i = id as usize;
        i < self.len && self.words[i / 32] & (1 << (i % 32)) != 0
    }

    /// Number of ids allowed.
    pub fn count(&self) -> usize {
        self.words.iter().map(|w| w.count_ones() as usize).sum()
    }

    /// Ids covered.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Covers no ids.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The allowed ids, ascending.
    pub fn ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.words
            .iter()
            .enumerate()
            .flat_map(|(w, &bits)| (0..32u32).filter(move |b| bits & (1 << b) != 0).map(move |b| w as u32 * 32 + b))
    }

    /// `logits` with every disallowed entry set to −∞ (entries past the mask are disallowed too).
    pub fn apply(&self, logits: &mut [f32]) {
        for (i, x) in logits.iter_mut().enumerate() {
            if i >= self.len || self.words[i / 32] & (1 << (i % 32)) == 0 {
                *x = f32::NEG_INFINITY;
            }
        }
    }
}

/// One request's grammar state (see the module doc).
#[derive(Clone)]
pub struct Constraint {
    matcher: Matcher,
    logits: usize,
    eos: u32,
}

impl fmt::Debug for Constraint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Constraint").field("stopped", &self.matcher.is_stopped()).finish()
    }
}

fn grammar_err(e: impl fmt::Display) -> Error {
    Error::InvalidArgument(format!("grammar: {e}"))
}

impl Constraint {
    /// The ids allowed next (only EOS once the grammar is complete).
    pub fn mask(&mut self) -> Result<TokenMask> {
        let v = self.matcher.compute_mask_or_eos().map_err(grammar_err)?;
        let mut words = v.as_slice().to_vec();
        words.resize(self.logits.div_ceil(32), 0);
        Ok(TokenMask { words, len: self.logits })
    }

    /// Advance by the sampled id; an id the grammar does not allow is an error.
    pub fn consume(&mut self, id: u32) -> Result<()> {
        if self.matcher.is_stopped() {
            return if id == self.eos {
                Ok(())
            } else {
                Err(grammar_err("the grammar is complete; only EOS may follow"))
            };
        }
        self.matcher.consume_token(id).map_err(grammar_err)
    }

    /// How many leading ids of `draft` the grammar accepts (the state is unchanged).
    pub fn validate(&mut self, draft: &[u32]) -> Result<usize> {
        self.matcher.validate_tokens(draft).map_err(grammar_err)
    }

    /// Undo the last `n` consumed ids.
    pub fn rollback(&mut self, n: usize) -> Result<()> {
        self.matcher.rollback(n).map_err(grammar_err)
    }

    /// The output so far is complete for the grammar (EOS is allowed).
    pub fn is_accepting(&mut self) -> bool {
        self.matcher.is_accepting().unwrap_or(false)
    }

    /// Nothing but EOS can follow.
    pub fn is_complete(&self) -> bool {
        self.matcher.is_stopped()
    }
}

#[cfg(test)]
mod tests;
