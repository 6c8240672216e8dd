//! Tokenizer tests: the golden cases of `../shared/golden/tokenizer` (skipped with a message outside CI when that
//! folder is absent, failing in CI), plus checks that need only the bundled tokenizer.

use super::*;
use crate::gguf::{GgufFile, GgufWriter, MetaValue};

fn shared_dir() -> Option<std::path::PathBuf> {
    crate::testdata::shared("golden/tokenizer", "cases.jsonl")
}

fn cases(dir: &Path) -> Vec<(String, Vec<u32>)> {
    let text = std::fs::read_to_string(dir.join("cases.jsonl")).unwrap();
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            let ids = v["ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
            (v["text"].as_str().unwrap().to_string(), ids)
        })
        .collect()
}

fn check_all(tok: &Tokenizer, cases: &[(String, Vec<u32>)]) {
    assert!(cases.len() > 100);
    for (text, ids) in cases {
        assert_eq!(&tok.encode(text).unwrap(), ids, "encode {text:?}");
        assert_eq!(&tok.decode(ids).unwrap(), text, "decode {text:?}");
        assert_eq!(tok.decode(ids).unwrap(), tok.hf().decode(ids, false).unwrap());
    }
}

#[test]
fn bundled_matches_shared_file() {
    if let Some(dir) = shared_dir() {
        assert_eq!(std::fs::read(dir.join("tokenizer.json")).unwrap(), bundled_tokenizer_json());
    }
}

#[test]
fn golden_cases_from_json() {
    let Some(dir) = shared_dir() else { return };
    let tok = Tokenizer::from_json_file(dir.join("tokenizer.json")).unwrap();
    check_all(&tok, &cases(&dir));
}

#[test]
fn special_tokens_by_name() {
    let tok = Tokenizer::bundled().unwrap();
    let s = tok.special();
    assert_eq!((s.bos, s.eos, s.pad), (0, 1, Some(2)));
    assert_eq!(tok.vocab_size(), 129280);
    for (id, name) in [
        (s.user, USER_TOKEN),
        (s.assistant, ASSISTANT_TOKEN),
        (s.think_start, THINK_START_TOKEN),
        (s.think_end, THINK_END_TOKEN),
        (s.dsml, DSML_TOKEN),
        (s.latest_reminder, LATEST_REMINDER_TOKEN),
    ] {
        let id = id.unwrap();
        assert_eq!(tok.token_to_piece(id), Some(name));
        assert_eq!(tok.encode(name).unwrap(), vec![id], "{name} is one token");
    }
    // Added tokens are recognised inside text, and the DSML tag is `<` + one token + text.
    let ids = tok.encode("a<think>b</think>").unwrap();
    assert!(ids.contains(&s.think_start.unwrap()) && ids.contains(&s.think_end.unwrap()));
    let ids = tok.encode("<｜DSML｜invoke").unwrap();
    assert!(ids.contains(&s.dsml.unwrap()));
    assert_eq!(tok.decode(&ids).unwrap(), "<｜DSML｜invoke");
    assert!(tok.decode(&[129280]).is_err());
    assert!(tok.token_to_piece(129280).is_none());
    assert_eq!(tok.token_bytes(tok.token_id("Ġthe").unwrap()).unwrap(), b" the");
    assert!(tok.encode("").unwrap().is_empty());
}

#[test]
fn bad_json_is_an_error() {
    assert!(Tokenizer::from_json_bytes(b"not json").is_err());
    assert!(Tokenizer::from_json_file("/nonexistent/tokenizer.json").is_err());
}

fn gguf_bytes(meta: &[(String, MetaValue)]) -> Vec<u8> {
    let w = GgufWriter::new(Vec::new(), meta, Vec::new()).unwrap();
    w.finish().unwrap()
}

/// tokenizer.json → metadata → GGUF file → tokenizer must reproduce every golden case; also with `token_type`
/// removed (as in the reference C engine's files) and with `pre` = "deepseek-v4".
#[test]
fn gguf_round_trip_reproduces_golden_cases() {
    let Some(dir) = shared_dir() else { return };
    let cs = cases(&dir);
    let meta = gguf_metadata_from_tokenizer_json(&dir.join("tokenizer.json")).unwrap();
    let get = |k: &str| meta.iter().find(|(key, _)| key == k).map(|(_, v)| v.clone()).unwrap();
    assert_eq!(get("tokenizer.ggml.model").as_str(), Some("gpt2"));
    assert_eq!(get("tokenizer.ggml.tokens").as_array().unwrap().len(), 129280);
    assert_eq!(get("tokenizer.ggml.merges").as_array().unwrap().len(), 127741);
    assert_eq!(get("tokenizer.ggml.bos_token_id").as_int(), Some(0));
    assert_eq!(get("tokenizer.ggml.eos_token_id").as_int(), Some(1));
    let types = get("tokenizer.ggml.token_type");
    let types = types.as_array().unwrap();
    let count = |t: i128| types.iter().filter(|v| v.as_int() == Some(t)).count();
    assert_eq!((count(1), count(3), count(4)), (127997, 1230, 53));

    let f = GgufFile::from_bytes(gguf_bytes(&meta)).unwrap();
    let tok = Tokenizer::from_gguf(&f).unwrap();
    assert_eq!(tok.vocab_size(), 129280);
    assert_eq!(tok.special(), Tokenizer::bundled().unwrap().special());
    check_all(&tok, &cs);

    let stripped: Vec<_> = meta
        .iter()
        .filter(|(k, _)| k != "tokenizer.ggml.token_type" && !k.ends_with("_token_id"))
        .map(|(k, v)| {
            if k == "tokenizer.ggml.pre" {
                (k.clone(), MetaValue::String("deepseek-v4".into()))
            } else {
                (k.clone(), v.clone())
            }
        })
        .collect();
    let f = GgufFile::from_bytes(gguf_bytes(&stripped)).unwrap();
    let tok = Tokenizer::from_gguf(&f).unwrap();
    assert_eq!((tok.bos(), tok.eos()), (0, 1));
    check_all(&tok, &cs);
}

#[test]
fn gguf_with_unknown_pre_or_model_is_rejected() {
    let base = vec![
        ("tokenizer.ggml.tokens".to_string(), MetaValue::string_array(["a", "b", "ab", BOS_TOKEN, EOS_TOKEN])),
        ("tokenizer.ggml.merges".to_string(), MetaValue::string_array(["a b"])),
    ];
    let with = |k: &str, v: &str| {
        let mut m = base.clone();
        m.push((k.to_string(), MetaValue::String(v.into())));
        GgufFile::from_bytes(gguf_bytes(&m)).unwrap()
    };
    assert!(Tokenizer::from_gguf(&with("tokenizer.ggml.pre", "llama3")).is_err());
    assert!(Tokenizer::from_gguf(&with("tokenizer.ggml.model", "llama")).is_err());
    let tok = Tokenizer::from_gguf(&with("tokenizer.ggml.pre", GGUF_PRE)).unwrap();
    assert_eq!(tok.encode("ab<｜end▁of▁sentence｜>").unwrap(), vec![2, 4]);
    assert_eq!((tok.bos(), tok.eos()), (3, 4));
    let no_tokens = GgufFile::from_bytes(gguf_bytes(&base[1..])).unwrap();
    assert!(Tokenizer::from_gguf(&no_tokens).is_err());
}
