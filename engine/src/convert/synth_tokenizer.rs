//! A complete, valid `tokenizer.ggml.*` section for a converted model that has no `tokenizer.json` (tiny test
//! checkpoints), so that every GGUF reader — this engine's and llama.cpp's, which refuses a file without
//! `tokenizer.ggml.model` and needs all 256 byte tokens — can load it.
//!
//! The vocabulary is a synthetic byte-level BPE of exactly `vocab_size` tokens: BOS
//! ([`BOS_TOKEN`](crate::tokenizer::BOS_TOKEN)) and EOS ([`EOS_TOKEN`](crate::tokenizer::EOS_TOKEN)) at
//! config.json's `bos_token_id` / `eos_token_id` (control tokens), the 256 GPT-2 byte-level characters, then merged
//! tokens of lowercase ASCII letters (`"a b"` → `ab`, ..., then `"ab c"` → `abc`, ..., `"abc d"` → `abcd`, ...) in
//! rank order, until the vocabulary is full. Keys written: `model` `gpt2`, `pre` [`GGUF_PRE`](crate::tokenizer::GGUF_PRE) (the shipped
//! files' name), `tokens`, `token_type` (3 control, 1 normal), `merges`, `bos_token_id`, `eos_token_id`,
//! `add_bos_token` / `add_eos_token` false — the same set a real `tokenizer.json` gives.
//!
//! A vocabulary of 256 or 257 has room for the byte tokens only: then there are no special tokens and
//! `bos_token_id` / `eos_token_id` name byte tokens. A vocabulary smaller than 256 or larger than the generated
//! merges can fill is refused with [`Error::Convert`] asking for `--tokenizer`; so are BOS/EOS ids outside the
//! vocabulary or equal.

use crate::gguf::{MetaValue, ValueType};
use crate::{Error, Result};

/// GGUF `token_type` of a normal and a control token (as `tokenizer::gguf_meta` writes them).
const TOKEN_TYPE_NORMAL: i32 = 1;
const TOKEN_TYPE_CONTROL: i32 = 3;

const LETTERS: &[u8; 26] = b"abcdefghijklmnopqrstuvwxyz";

/// The largest vocabulary the synthetic tokenizer can fill: 2 specials + 256 bytes + 26² + 26³ + 26⁴ merges (enough
/// for Flash's 129280).
pub const MAX_SYNTH_VOCAB: usize = 2 + 256 + 26 * 26 + 26 * 26 * 26 + 26 * 26 * 26 * 26;

/// The `tokenizer.ggml.*` metadata of the synthetic tokenizer (see the module docs).
pub fn synthetic_tokenizer_metadata(vocab: usize, bos: u32, eos: u32) -> Result<Vec<(String, MetaValue)>> {
    let refuse = |why: String| Err(Error::Convert(format!("{why}; pass --tokenizer tokenizer.json")));
    if !(256..=MAX_SYNTH_VOCAB).contains(&vocab) {
        return refuse(format!(
            "no tokenizer given and vocab_size {vocab} is outside 256..={MAX_SYNTH_VOCAB}, the range a synthetic \
             byte-level tokenizer covers"
        ));
    }
    let specials = vocab >= 258;
    if bos as usize >= vocab || eos as usize >= vocab || bos == eos {
        return refuse(format!("bos_token_id {bos} / eos_token_id {eos} do not fit a vocabulary of {vocab}"));
    }
    let bytes = crate::tokenizer::bytelevel::byte_to_char_table();
    // Non-special tokens in order, with the merge that makes each merged one.
    let mut normal: Vec<String> = bytes.iter().map(|c| c.to_string()).collect();
    let mut merges: Vec<String> = Vec::new();
    let need = if specials { vocab - 2 } else { vocab };
    'fill: for &a in LETTERS {
        for &b in LETTERS {
            if normal.len() == need {
                break 'fill;
            }
            let (a, b) = (a as char, b as char);
            merges.push(format!("{a} {b}"));
            normal.push(format!("{a}{b}"));
        }
    }
    'fill3: for &a in LETTERS {
        for &b in LETTERS {
            for &c in LETTERS {
                if normal.len() == need {
                    break 'fill3;
                }
                let (a, b, c) = (a as char, b as char, c as char);
                merges.push(format!("{a}{b} {c}"));
                normal.push(format!("{a}{b}{c}"));
            }
        }
    }
    'fill4: for &a in LETTERS {
        for &b in LETTERS {
            for &c in LETTERS {
                for &d in LETTERS {
                    if normal.len() == need {
                        break 'fill4;
                    }
                    let (a, b, c, d) = (a as char, b as char, c as char, d as char);
                    merges.push(format!("{a}{b}{c} {d}"));
                    normal.push(format!("{a}{b}{c}{d}"));
                }
            }
        }
    }
    let mut normal = normal.into_iter();
    let mut tokens = Vec::with_capacity(vocab);
    let mut types = Vec::with_capacity(vocab);
    for id in 0..vocab as u32 {
        let (t, ty) = if !specials {
            (normal.next().unwrap_or_default(), TOKEN_TYPE_NORMAL)
        } else if id == bos {
            (crate::tokenizer::BOS_TOKEN.to_string(), TOKEN_TYPE_CONTROL)
        } else if id == eos {
            (crate::tokenizer::EOS_TOKEN.to_string(), TOKEN_TYPE_CONTROL)
        } else {
            // `normal` holds exactly the non-special count (the fill loops' bound).
            (normal.next().unwrap_or_default(), TOKEN_TYPE_NORMAL)
        };
        tokens.push(t);
        types.push(MetaValue::I32(ty));
    }
    let s = |k: &str| format!("tokenizer.ggml.{k}");
    Ok(vec![
        (s("model"), MetaValue::String("gpt2".into())),
        (s("pre"), MetaValue::String(crate::tokenizer::GGUF_PRE.into())),
        (s("tokens"), MetaValue::string_array(tokens)),
        (s("token_type"), MetaValue::Array(ValueType::I32, types)),
        (s("merges"), MetaValue::string_array(merges)),
        (s("bos_token_id"), MetaValue::U32(bos)),
        (s("eos_token_id"), MetaValue::U32(eos)),
        (s("add_bos_token"), MetaValue::Bool(false)),
        (s("add_eos_token"), MetaValue::Bool(false)),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::{GgufFile, GgufWriter};
    use crate::tokenizer::Tokenizer;

    fn file_with(meta: Vec<(String, MetaValue)>) -> GgufFile {
        let bytes = GgufWriter::new(Vec::new(), &meta, Vec::new()).unwrap().finish().unwrap();
        GgufFile::from_bytes(bytes).unwrap()
    }

    #[test]
    fn fills_the_vocabulary_and_loads_as_a_tokenizer() {
        for vocab in [256usize, 258, 512, 1000, 20_000] {
            let meta = synthetic_tokenizer_metadata(vocab, 0, 1).unwrap();
            let f = file_with(meta);
            let toks = f.get_str_array("tokenizer.ggml.tokens").unwrap();
            assert_eq!(toks.len(), vocab);
            let uniq: std::collections::HashSet<_> = toks.iter().collect();
            assert_eq!(uniq.len(), vocab, "tokens are distinct");
            assert_eq!(f.get_str("tokenizer.ggml.model").unwrap(), "gpt2");
            let merges = f.get_str_array("tokenizer.ggml.merges").unwrap();
            assert_eq!(merges.len(), vocab.saturating_sub(258));
            let tok = Tokenizer::from_gguf(&f).unwrap();
            assert_eq!(tok.vocab_size(), vocab);
            assert_eq!((tok.bos(), tok.eos()), (0, 1));
            assert_eq!(toks[0] == crate::tokenizer::BOS_TOKEN, vocab >= 258);
            for text in ["hello world\n", "ab cd", "ünïcødé 12"] {
                let ids = tok.encode(text).unwrap();
                assert!(ids.iter().all(|&i| (i as usize) < vocab));
                assert_eq!(tok.decode(&ids).unwrap(), text);
            }
            if vocab >= 260 {
                // "ab" is a merged token: one id.
                assert_eq!(tok.encode("ab").unwrap().len(), 1);
            }
        }
    }

    #[test]
    fn refuses_what_it_cannot_fill() {
        for (v, b, e) in [(255, 0, 1), (MAX_SYNTH_VOCAB + 1, 0, 1), (512, 0, 0), (512, 600, 1)] {
            let err = synthetic_tokenizer_metadata(v, b, e).unwrap_err().to_string();
            assert!(err.contains("--tokenizer"), "{err}");
        }
        assert_eq!(
            synthetic_tokenizer_metadata(MAX_SYNTH_VOCAB, 5, 7).unwrap()[2].1.as_array().unwrap().len(),
            MAX_SYNTH_VOCAB
        );
    }
}
