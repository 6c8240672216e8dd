//! The tokenizer as GGUF metadata, both ways.
//!
//! * [`gguf_metadata_from_tokenizer_json`] (used by the converter) turns a Hugging Face `tokenizer.json` into the
//!   `tokenizer.ggml.*` keys: `model` = `"gpt2"`, `pre` = [`GGUF_PRE`], `tokens` (one string per id, dense),
//!   `merges` (`"a b"`, rank = index), `token_type` (1 normal, 3 control = special added token, 4 user-defined =
//!   non-special added token), `bos_token_id`, `eos_token_id`, `padding_token_id`.
//! * [`tokenizer_json_from_gguf`] rebuilds an equivalent `tokenizer.json` from those keys, with the DeepSeek-V4
//!   pre-tokenizer and byte-level decoder fixed in code (GGUF only names them through `tokenizer.ggml.pre`).
//!
//! Files made by other tools may lack `token_type` (the DS4 files of the reference C engine do). Then a token counts
//! as "added" (matched in raw text before BPE) when it is neither a single byte-level character nor the result of a
//! merge: BPE can never produce such a token, so it can only come from added-token matching. For the DeepSeek-V4
//! vocabulary this reproduces exactly the 1283 added tokens of `tokenizer.json`.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use serde_json::{json, Value};

use super::bytelevel::is_single_byte_char;
use crate::gguf::{GgufFile, MetaValue, ValueType};
use crate::{Error, Result};

/// `tokenizer.ggml.pre` written by the converter: the name the existing DS4 GGUF files use for this pre-tokenizer.
pub const GGUF_PRE: &str = "joyai-llm";
/// Other accepted spellings of `tokenizer.ggml.pre` for the same pre-tokenizer.
pub const GGUF_PRE_ALIASES: &[&str] = &["joyai-llm", "deepseek-v4"];

/// GGUF `token_type` values.
pub const TOKEN_TYPE_NORMAL: i32 = 1;
/// A special (control) added token.
pub const TOKEN_TYPE_CONTROL: i32 = 3;
/// A non-special added token.
pub const TOKEN_TYPE_USER_DEFINED: i32 = 4;

/// DeepSeek-V4's pre-tokenizer (three isolating splits, then byte-level without regex), as in its tokenizer.json.
const PRE_TOKENIZER_JSON: &str = r##"{"type": "Sequence", "pretokenizers": [{"type": "Split", "pattern": {"Regex": "\\p{N}{1,3}"}, "behavior": "Isolated", "invert": false}, {"type": "Split", "pattern": {"Regex": "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"}, "behavior": "Isolated", "invert": false}, {"type": "Split", "pattern": {"Regex": "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"}, "behavior": "Isolated", "invert": false}, {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}]}"##;
const POST_PROCESSOR_JSON: &str =
    r#"{"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true}"#;
const DECODER_JSON: &str =
    r#"{"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true}"#;

fn tok_err(msg: impl Into<String>) -> Error {
    Error::Tokenizer(msg.into())
}

fn parse_const(s: &str) -> Value {
    // The constants above are valid JSON; a failure would be a programming error caught by the tests.
    serde_json::from_str(s).unwrap_or(Value::Null)
}

/// The DeepSeek-V4 pre-tokenizer as a JSON value (for comparing with a tokenizer.json).
pub fn deepseek_v4_pre_tokenizer() -> Value {
    parse_const(PRE_TOKENIZER_JSON)
}

/// Reads `tokenizer.json` and returns the `tokenizer.ggml.*` metadata for it (see the module doc).
///
/// Errors: unreadable file, not a BPE tokenizer, a pre-tokenizer other than DeepSeek-V4's, ids with gaps or clashes.
pub fn gguf_metadata_from_tokenizer_json(path: &Path) -> Result<Vec<(String, MetaValue)>> {
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    gguf_metadata_from_tokenizer_json_bytes(&bytes)
        .map_err(|e| tok_err(format!("{}: {}", path.display(), e.to_string().trim_start_matches("tokenizer: "))))
}

/// [`gguf_metadata_from_tokenizer_json`] on the file's bytes.
pub fn gguf_metadata_from_tokenizer_json_bytes(bytes: &[u8]) -> Result<Vec<(String, MetaValue)>> {
    let v: Value = serde_json::from_slice(bytes).map_err(|e| tok_err(format!("invalid tokenizer.json: {e}")))?;
    let model = v.get("model").ok_or_else(|| tok_err("tokenizer.json has no \"model\""))?;
    if model.get("type").and_then(Value::as_str) != Some("BPE") {
        return Err(tok_err("tokenizer.json model is not BPE"));
    }
    if v.get("pre_tokenizer") != Some(&deepseek_v4_pre_tokenizer()) {
        return Err(tok_err("tokenizer.json pre-tokenizer is not DeepSeek-V4's; no GGUF `pre` name fits it"));
    }
    let vocab = model.get("vocab").and_then(Value::as_object).ok_or_else(|| tok_err("model.vocab missing"))?;
    let mut by_id: HashMap<u32, (String, i32)> = HashMap::with_capacity(vocab.len() + 2048);
    for (tok, id) in vocab {
        let id =
            id.as_u64().and_then(|x| u32::try_from(x).ok()).ok_or_else(|| tok_err(format!("bad id for {tok:?}")))?;
        if by_id.insert(id, (tok.clone(), TOKEN_TYPE_NORMAL)).is_some() {
            return Err(tok_err(format!("two vocabulary entries share id {id}")));
        }
    }
    for at in v.get("added_tokens").and_then(Value::as_array).map(Vec::as_slice).unwrap_or(&[]) {
        let id = at
            .get("id")
            .and_then(Value::as_u64)
            .and_then(|x| u32::try_from(x).ok())
            .ok_or_else(|| tok_err("added token without a valid id"))?;
        let content =
            at.get("content").and_then(Value::as_str).ok_or_else(|| tok_err("added token without content"))?;
        let special = at.get("special").and_then(Value::as_bool).unwrap_or(false);
        let ty = if special { TOKEN_TYPE_CONTROL } else { TOKEN_TYPE_USER_DEFINED };
        match by_id.get(&id) {
            Some((existing, _)) if existing != content => {
                return Err(tok_err(format!("added token {content:?} clashes with {existing:?} at id {id}")))
            }
            _ => {
                by_id.insert(id, (content.to_string(), ty));
            }
        }
    }
    let n = by_id.keys().max().map(|m| *m as usize + 1).unwrap_or(0);
    if n != by_id.len() {
        return Err(tok_err(format!(
            "token ids are not dense: {} tokens, highest id {}",
            by_id.len(),
            n.saturating_sub(1)
        )));
    }
    let mut tokens = Vec::with_capacity(n);
    let mut types = Vec::with_capacity(n);
    for id in 0..n as u32 {
        let (t, ty) = by_id.remove(&id).ok_or_else(|| tok_err(format!("id {id} missing")))?;
        tokens.push(t);
        types.push(MetaValue::I32(ty));
    }
    let merges = model.get("merges").and_then(Value::as_array).ok_or_else(|| tok_err("model.merges missing"))?;
    let mut merge_strs = Vec::with_capacity(merges.len());
    for m in merges {
        let s = match m {
            Value::String(s) => s.clone(),
            Value::Array(p) if p.len() == 2 => match (p[0].as_str(), p[1].as_str()) {
                (Some(a), Some(b)) => format!("{a} {b}"),
                _ => return Err(tok_err("merge pair is not two strings")),
            },
            _ => return Err(tok_err("merge is neither \"a b\" nor [a, b]")),
        };
        merge_strs.push(s);
    }
    let find = |s: &str| tokens.iter().position(|t| t == s).map(|p| p as u32);
    let mut meta = vec![
        ("tokenizer.ggml.model".to_string(), MetaValue::String("gpt2".into())),
        ("tokenizer.ggml.pre".to_string(), MetaValue::String(GGUF_PRE.into())),
    ];
    let bos = find(super::BOS_TOKEN);
    let eos = find(super::EOS_TOKEN);
    let pad = find(super::PAD_TOKEN);
    meta.push(("tokenizer.ggml.tokens".to_string(), MetaValue::string_array(tokens)));
    meta.push(("tokenizer.ggml.token_type".to_string(), MetaValue::Array(ValueType::I32, types)));
    meta.push(("tokenizer.ggml.merges".to_string(), MetaValue::string_array(merge_strs)));
    if let Some(b) = bos {
        meta.push(("tokenizer.ggml.bos_token_id".to_string(), MetaValue::U32(b)));
    }
    if let Some(e) = eos {
        meta.push(("tokenizer.ggml.eos_token_id".to_string(), MetaValue::U32(e)));
    }
    if let Some(p) = pad {
        meta.push(("tokenizer.ggml.padding_token_id".to_string(), MetaValue::U32(p)));
    }
    meta.push(("tokenizer.ggml.add_bos_token".to_string(), MetaValue::Bool(false)));
    meta.push(("tokenizer.ggml.add_eos_token".to_string(), MetaValue::Bool(false)));
    Ok(meta)
}

/// Builds a `tokenizer.json` (bytes) from GGUF tokenizer metadata. `types` is `tokenizer.ggml.token_type` if present.
pub fn tokenizer_json_from_parts(tokens: &[&str], merges: &[&str], types: Option<&[i64]>) -> Result<Vec<u8>> {
    if let Some(t) = types {
        if t.len() != tokens.len() {
            return Err(tok_err(format!("token_type has {} entries for {} tokens", t.len(), tokens.len())));
        }
    }
    if tokens.len() > u32::MAX as usize {
        return Err(tok_err("too many tokens"));
    }
    let merge_results: HashSet<String> =
        if types.is_none() { merges.iter().map(|m| m.replacen(' ', "", 1)).collect() } else { HashSet::new() };
    let mut vocab = serde_json::Map::new();
    let mut added = Vec::new();
    let mut seen: HashSet<&str> = HashSet::with_capacity(tokens.len());
    for (id, &tok) in tokens.iter().enumerate() {
        if !seen.insert(tok) {
            return Err(tok_err(format!("token string {tok:?} appears twice (second at id {id})")));
        }
        // 1 normal, 6 byte: BPE vocabulary. 3 control: special added. 2 unknown, 4 user-defined, 5 unused: added.
        let kind = match types.map(|t| t[id]) {
            Some(1) | Some(6) => None,
            Some(3) => Some(true),
            Some(_) => Some(false),
            None if is_single_byte_char(tok) || merge_results.contains(tok) => None,
            None => Some(true),
        };
        // Every token is in the model vocabulary so that added tokens keep their ids (the `tokenizers` crate
        // looks added tokens up in the model first and appends unknown ones after it).
        vocab.insert(tok.to_string(), json!(id));
        match kind {
            None => {}
            Some(special) => added.push(json!({
                "id": id, "content": tok, "single_word": false, "lstrip": false, "rstrip": false,
                "normalized": !special, "special": special,
            })),
        }
    }
    for m in merges {
        let mut parts = m.splitn(2, ' ');
        match (parts.next(), parts.next()) {
            (Some(a), Some(b)) if !a.is_empty() && !b.is_empty() => {}
            _ => return Err(tok_err(format!("merge {m:?} is not \"a b\""))),
        }
    }
    let doc = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": {"type": "Sequence", "normalizers": []},
        "pre_tokenizer": deepseek_v4_pre_tokenizer(),
        "post_processor": parse_const(POST_PROCESSOR_JSON),
        "decoder": parse_const(DECODER_JSON),
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": merges,
        },
    });
    serde_json::to_vec(&doc).map_err(|e| tok_err(format!("building tokenizer.json: {e}")))
}

/// Reads the `tokenizer.ggml.*` keys of a GGUF file and builds the equivalent `tokenizer.json` bytes.
///
/// Errors: missing tokens/merges, a `model` other than `gpt2`, a `pre` other than [`GGUF_PRE_ALIASES`].
pub fn tokenizer_json_from_gguf(f: &GgufFile) -> Result<Vec<u8>> {
    if let Some(m) = f.get("tokenizer.ggml.model") {
        if m.as_str() != Some("gpt2") {
            return Err(tok_err(format!("tokenizer.ggml.model is {m}, only \"gpt2\" (byte-level BPE) is supported")));
        }
    }
    match f.get("tokenizer.ggml.pre").and_then(MetaValue::as_str) {
        Some(p) if GGUF_PRE_ALIASES.contains(&p) => {}
        Some(p) => {
            return Err(tok_err(format!(
                "tokenizer.ggml.pre is {p:?}; supported: {GGUF_PRE_ALIASES:?} (the DeepSeek-V4 pre-tokenizer)"
            )))
        }
        None => tracing::warn!("GGUF has no tokenizer.ggml.pre; assuming the DeepSeek-V4 pre-tokenizer"),
    }
    let tokens = f.get_str_array("tokenizer.ggml.tokens")?;
    let merges = f.get_str_array("tokenizer.ggml.merges")?;
    let types = match f.get("tokenizer.ggml.token_type") {
        Some(_) => Some(f.get_int_array("tokenizer.ggml.token_type")?),
        None => None,
    };
    tokenizer_json_from_parts(&tokens, &merges, types.as_deref())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constants_parse() {
        for s in [PRE_TOKENIZER_JSON, POST_PROCESSOR_JSON, DECODER_JSON] {
            assert!(serde_json::from_str::<Value>(s).is_ok());
        }
    }

    #[test]
    fn small_vocab_round_trip_without_types() {
        // a, b, ab (merge result), and an added token: the rule must classify them without token_type.
        let tokens = ["a", "b", "ab", "<｜x｜>"];
        let json = tokenizer_json_from_parts(&tokens, &["a b"], None).unwrap();
        let v: Value = serde_json::from_slice(&json).unwrap();
        assert_eq!(v["model"]["vocab"].as_object().unwrap().len(), 4);
        assert_eq!(v["added_tokens"].as_array().unwrap().len(), 1);
        assert_eq!(v["added_tokens"][0]["content"], "<｜x｜>");
        assert_eq!(v["added_tokens"][0]["id"], 3);
    }

    #[test]
    fn rejects_bad_input() {
        assert!(tokenizer_json_from_parts(&["a", "a"], &[], None).is_err());
        assert!(tokenizer_json_from_parts(&["a"], &["ab"], None).is_err());
        assert!(tokenizer_json_from_parts(&["a"], &[], Some(&[1, 1])).is_err());
        assert!(gguf_metadata_from_tokenizer_json_bytes(b"{").is_err());
        assert!(gguf_metadata_from_tokenizer_json_bytes(b"{\"model\": {\"type\": \"WordPiece\"}}").is_err());
    }
}
