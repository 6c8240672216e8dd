use std::sync::OnceLock;

use serde_json::{json, Value};

use super::*;
use crate::sampler::{Rng, Sampler, SamplerConfig};

/// The demo model's tokenizer (the bundled one) padded to the demo model's 129280 logits.
fn demo() -> &'static (Tokenizer, ConstraintFactory) {
    static F: OnceLock<(Tokenizer, ConstraintFactory)> = OnceLock::new();
    F.get_or_init(|| {
        let tok = Tokenizer::bundled().unwrap();
        let f = ConstraintFactory::new(&tok, 129280).unwrap();
        (tok, f)
    })
}

/// Drives `c` like a noisy model: each step takes a uniformly random allowed id (EOS only once nothing else is
/// allowed, so the walk explores as long as it may). Returns the text before EOS; `None` when `limit` ids were
/// not enough.
fn random_walk(tok: &Tokenizer, c: &mut Constraint, seed: u64, limit: usize) -> Option<String> {
    let mut rng = Rng::new(seed);
    let mut ids = Vec::new();
    for _ in 0..limit {
        let mask = c.mask().unwrap();
        let allowed: Vec<u32> = mask.ids().collect();
        assert!(!allowed.is_empty(), "empty mask after {:?}", tok.decode(&ids));
        let others: Vec<u32> = allowed.iter().copied().filter(|&t| t != tok.eos()).collect();
        if others.is_empty() {
            c.consume(tok.eos()).unwrap();
            return Some(tok.decode(&ids).unwrap());
        }
        // Stop early half of the time when the grammar may end here (EOS allowed).
        if mask.allows(tok.eos()) && rng.next_f64() < 0.5 {
            return Some(tok.decode(&ids).unwrap());
        }
        let t = others[(rng.next_f64() * others.len() as f64) as usize % others.len()];
        c.consume(t).unwrap();
        ids.push(t);
    }
    None
}

fn compile(spec: GrammarSpec) -> Constraint {
    demo().1.compile(&spec).unwrap_or_else(|e| panic!("{spec:?}: {e}"))
}

#[test]
fn added_tokens_are_special_and_the_vocabulary_is_padded() {
    let (tok, f) = demo();
    assert_eq!(f.logits(), 129280);
    let mut c = compile(GrammarSpec::Regex("[a-z]+".into()));
    let m = c.mask().unwrap();
    assert_eq!(m.len(), 129280);
    // Special tokens (EOS, `</think>`, `｜DSML｜`) are never free text.
    for id in [tok.eos(), tok.special().think_end.unwrap(), tok.special().dsml.unwrap()] {
        assert!(!m.allows(id), "{id}");
    }
    // Logits past the vocabulary are padding: never allowed, even by a grammar that allows any text.
    let n = tok.vocab_size();
    let padded = ConstraintFactory::new(tok, n + 40).unwrap();
    let pm = padded.compile(&GrammarSpec::Regex("(?s:.*)".into())).unwrap().mask().unwrap();
    assert_eq!(pm.len(), n + 40);
    assert!(pm.allows(tok.encode("a").unwrap()[0]) && pm.allows(tok.eos()));
    assert!((n as u32..n as u32 + 40).all(|id| !pm.allows(id)));
    let a = tok.encode("abc").unwrap();
    assert!(m.allows(a[0]));
    assert!(!m.allows(tok.encode("A").unwrap()[0]));
    // A Lark grammar names a special token by id.
    let think_end = tok.special().think_end.unwrap();
    let mut c = compile(GrammarSpec::Lark(format!("start: /[a-z]{{1,5}}/ <[{think_end}]> \"ok\"")));
    for t in tok.encode("ab").unwrap() {
        c.consume(t).unwrap();
    }
    assert!(c.mask().unwrap().allows(think_end));
    c.consume(think_end).unwrap();
    for t in tok.encode("ok").unwrap() {
        c.consume(t).unwrap();
    }
    assert!(c.is_accepting());
    assert_eq!(c.mask().unwrap().ids().collect::<Vec<_>>(), vec![tok.eos()]);
}

#[test]
fn random_walks_through_a_json_schema_give_valid_json() {
    let (tok, _) = demo();
    let schema = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "kind": {"enum": ["a", "b", 3]},
            "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "maxItems": 3},
            "n": {"type": "integer", "minimum": -5, "maximum": 99},
            "ok": {"type": "boolean"}
        },
        "required": ["name", "kind", "tags"],
        "additionalProperties": false,
        "$defs": {"tag": {"type": "string", "pattern": "^[a-z]{1,4}$"}}
    });
    for seed in 0..20 {
        let mut c = compile(GrammarSpec::JsonSchema(schema.clone()));
        let text = random_walk(tok, &mut c, seed, 400).expect("the walk terminates");
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        let o = v.as_object().unwrap();
        assert!(o["name"].as_str().unwrap().chars().count() <= 8, "{text}");
        assert!([json!("a"), json!("b"), json!(3)].contains(&o["kind"]), "{text}");
        let tags = o["tags"].as_array().unwrap();
        assert!(tags.len() <= 3);
        for t in tags {
            let t = t.as_str().unwrap();
            assert!((1..=4).contains(&t.len()) && t.bytes().all(|b| b.is_ascii_lowercase()), "{text}");
        }
        if let Some(n) = o.get("n") {
            assert!((-5..=99).contains(&n.as_i64().unwrap()), "{text}");
        }
        assert!(o.keys().all(|k| ["name", "kind", "tags", "n", "ok"].contains(&k.as_str())), "{text}");
        // Canonical separators, no free whitespace.
        assert!(text.starts_with("{\"name\": "), "{text}");
    }
}

#[test]
fn regex_and_lark_walks_match() {
    let (tok, _) = demo();
    for seed in 0..10 {
        let mut c = compile(GrammarSpec::Regex("[A-Z]{2}-[0-9]{2,4}".into()));
        let text = random_walk(tok, &mut c, seed, 50).unwrap();
        let (a, b) = text.split_once('-').unwrap();
        assert!(a.len() == 2 && a.bytes().all(|x| x.is_ascii_uppercase()), "{text}");
        assert!((2..=4).contains(&b.len()) && b.bytes().all(|x| x.is_ascii_digit()), "{text}");
        let lark = r#"
            start: greeting " " name ("!" | ".")
            greeting: "hi" | "hello"
            name: /[a-z]{1,6}/
        "#;
        let mut c = compile(GrammarSpec::Lark(lark.into()));
        let text = random_walk(tok, &mut c, seed, 50).unwrap();
        let rest = text.strip_prefix("hi ").or_else(|| text.strip_prefix("hello ")).unwrap();
        let name = rest.strip_suffix('!').or_else(|| rest.strip_suffix('.')).unwrap();
        assert!((1..=6).contains(&name.len()) && name.bytes().all(|x| x.is_ascii_lowercase()), "{text}");
    }
}

#[test]
fn bad_schemas_and_grammars_are_named_errors() {
    let f = &demo().1;
    let err = |spec: GrammarSpec| f.compile(&spec).err().unwrap_or_else(|| panic!("{spec:?} compiled")).0;
    let e = err(GrammarSpec::JsonSchema(json!({"type": "nonsense"})));
    assert!(e.contains("JSON schema") && e.contains("nonsense"), "{e}");
    let e = err(GrammarSpec::JsonSchema(
        json!({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}, "required": ["a"]}),
    ));
    assert!(e.contains("missing"), "{e}");
    let e = err(GrammarSpec::JsonSchema(json!(["not", "a", "schema"])));
    assert!(e.contains("object or a boolean"), "{e}");
    let e = err(GrammarSpec::JsonSchema(json!(false)));
    assert!(e.contains("JSON schema"), "{e}");
    let e = err(GrammarSpec::JsonSchema(json!({"type": "integer", "minimum": 5, "maximum": 2})));
    assert!(e.contains("JSON schema"), "{e}");
    let e = err(GrammarSpec::Regex("(abc".into()));
    assert!(e.starts_with("invalid regex"), "{e}");
    let e = err(GrammarSpec::Lark("start: undefined_rule".into()));
    assert!(e.starts_with("invalid Lark grammar") && e.contains("undefined_rule"), "{e}");
    let e = err(GrammarSpec::Regex("a".repeat(MAX_GRAMMAR_BYTES + 1)));
    assert!(e.contains("at most"), "{e}");
}

#[test]
fn the_sampler_only_draws_allowed_ids() {
    let mask = TokenMask::from_ids(10, [2, 7]);
    assert_eq!(mask.count(), 2);
    let logits: Vec<f32> = (0..10).map(|i| i as f32).collect();
    let mut greedy = Sampler::new(SamplerConfig::greedy()).unwrap();
    assert_eq!(greedy.sample_masked(&logits, &mask, false).unwrap(), 7);
    let mut s = Sampler::new(SamplerConfig { temperature: 5.0, seed: 3, ..Default::default() }).unwrap();
    let mut seen = [0; 10];
    for _ in 0..200 {
        seen[s.sample_masked(&logits, &mask, false).unwrap() as usize] += 1;
    }
    assert!(seen[2] > 0 && seen[7] > 0 && seen[2] + seen[7] == 200, "{seen:?}");
    // Allowed ids with no finite logit: the lowest allowed one; an empty mask is an error.
    let mut l = logits.clone();
    l[2] = f32::NEG_INFINITY;
    l[7] = f32::NEG_INFINITY;
    assert_eq!(greedy.sample_masked(&l, &mask, false).unwrap(), 2);
    assert!(greedy.sample_masked(&logits, &TokenMask::from_ids(10, []), false).is_err());
}

#[test]
fn validate_counts_the_accepted_prefix_of_a_draft() {
    let (tok, _) = demo();
    let mut c = compile(GrammarSpec::Regex("[0-9]{1,3}x".into()));
    let good = tok.encode("12x").unwrap();
    assert_eq!(c.validate(&good).unwrap(), good.len());
    let mut bad = tok.encode("1").unwrap();
    bad.extend(tok.encode("Q").unwrap());
    assert_eq!(c.validate(&bad).unwrap(), 1);
    // Validation does not move the state.
    assert!(!c.mask().unwrap().allows(tok.eos()));
}

#[test]
fn the_golden_tokenizer_builds_a_factory_with_its_special_tokens_marked() {
    let Some(dir) = crate::testdata::shared("golden/tokenizer", "tokenizer.json") else { return };
    let tok = Tokenizer::from_json_file(dir.join("tokenizer.json")).unwrap();
    let f = ConstraintFactory::new(&tok, tok.vocab_size()).unwrap();
    let mut c = f.compile(&GrammarSpec::JsonSchema(json!({"type": "object", "properties": {"x": {"type": "integer", "maximum": 9, "minimum": 0}}, "required": ["x"], "additionalProperties": false}))).unwrap();
    let m = c.mask().unwrap();
    for (_, id) in tok.added_tokens() {
        assert!(!m.allows(*id), "added token {id} allowed as JSON text");
    }
    let text = random_walk(&tok, &mut c, 7, 40).unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    assert!((0..=9).contains(&v["x"].as_i64().unwrap()), "{text}");
    assert!(ConstraintFactory::new(&tok, tok.vocab_size() - 1).is_err());
}
