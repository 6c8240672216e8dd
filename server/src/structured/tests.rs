use std::sync::OnceLock;

use serde_json::json;

use super::*;
use ds4_engine::chat::{parse_completion, Mode};
use ds4_engine::sampler::Rng;
use ds4_engine::tokenizer::Tokenizer;

fn demo() -> &'static (Tokenizer, ConstraintFactory) {
    static F: OnceLock<(Tokenizer, ConstraintFactory)> = OnceLock::new();
    F.get_or_init(|| {
        let tok = Tokenizer::bundled().unwrap();
        let f = ConstraintFactory::new(&tok, 129280).unwrap();
        (tok, f)
    })
}

fn tool(name: &str, parameters: Value) -> ToolSpec {
    ToolSpec { name: name.into(), description: String::new(), parameters }
}

fn tools() -> Vec<ToolSpec> {
    vec![
        tool("shell", json!({"type": "object", "properties": {"cmd": {"type": "string"}}})),
        tool(
            "move",
            json!({
                "type": "object",
                "properties": {
                    "to": {"$ref": "#/$defs/point"},
                    "speed": {"type": "integer", "minimum": 1, "maximum": 9},
                    "note": {"type": "string"}
                },
                "required": ["to"],
                "additionalProperties": false,
                "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["x"], "additionalProperties": false}}
            }),
        ),
    ]
}

fn grammar(strict: &[&str], answer: Option<&str>) -> Constraint {
    let (tok, f) = demo();
    let strict: Vec<String> = strict.iter().map(|s| s.to_string()).collect();
    let g = tool_grammar(&tools(), &strict, answer, tok.special().dsml.unwrap());
    f.compile(&GrammarSpec::Lark(g.clone())).unwrap_or_else(|e| panic!("{e}\n{g}"))
}

/// Feeds `text` (tokenized as the model's tokenizer does, DSML markers as their token) and reports whether the
/// grammar took all of it.
fn accepts(c: &mut Constraint, text: &str) -> bool {
    let (tok, _) = demo();
    let ids = tok.encode(text).unwrap();
    for (i, &t) in ids.iter().enumerate() {
        if !c.mask().unwrap().allows(t) || c.consume(t).is_err() {
            eprintln!("refused after {:?}: {:?}", tok.decode(&ids[..i]).unwrap(), tok.decode(&[t]).unwrap());
            return false;
        }
    }
    true
}

const D: &str = "｜DSML｜";

fn call(name: &str, params: &[(&str, bool, &str)]) -> String {
    let mut s = format!("<{D}invoke name=\"{name}\">\n");
    let p: Vec<String> = params
        .iter()
        .map(|(k, is_str, v)| format!("<{D}parameter name=\"{k}\" string=\"{is_str}\">{v}</{D}parameter>"))
        .collect();
    s.push_str(&p.join("\n"));
    s.push_str(&format!("\n</{D}invoke>"));
    s
}

fn block(calls: &[String]) -> String {
    format!("\n\n<{D}tool_calls>\n{}\n</{D}tool_calls>", calls.join("\n"))
}

#[test]
fn formats_of_each_api() {
    let schema = json!({"type": "object"});
    let f = openai_response_format(Some(
        &json!({"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": true}}),
    ));
    assert_eq!(f.unwrap(), Some(Format::JsonSchema { name: Some("x".into()), schema: schema.clone(), strict: true }));
    assert_eq!(openai_response_format(Some(&json!({"type": "text"}))).unwrap(), None);
    assert_eq!(openai_response_format(Some(&json!({"type": "json_object"}))).unwrap(), Some(Format::JsonObject));
    assert_eq!(
        openai_response_format(Some(&json!({"type": "regex", "pattern": "a+"}))).unwrap(),
        Some(Format::Regex("a+".into()))
    );
    let e = openai_response_format(Some(&json!({"type": "xml"}))).unwrap_err();
    assert!(e.message.contains("`xml`"), "{}", e.message);
    let e = openai_response_format(Some(&json!({"type": "json_schema", "json_schema": {"name": "x"}}))).unwrap_err();
    assert!(e.message.contains("schema"), "{}", e.message);
    let f = responses_text_format(Some(
        &json!({"format": {"type": "json_schema", "name": "codex_output_schema", "schema": schema, "strict": true}}),
    ));
    assert!(matches!(f.unwrap(), Some(Format::JsonSchema { strict: true, .. })));
    assert_eq!(responses_text_format(Some(&json!({"verbosity": "low"}))).unwrap(), None);
    let f = anthropic_output_format(
        Some(&json!({"effort": "high", "format": {"type": "json_schema", "schema": schema}})),
        None,
    );
    assert!(matches!(f.unwrap(), Some(Format::JsonSchema { .. })));
    let f = anthropic_output_format(None, Some(&json!({"type": "json_schema", "schema": schema})));
    assert!(matches!(f.unwrap(), Some(Format::JsonSchema { .. })));
    assert_eq!(anthropic_output_format(Some(&json!({"effort": "high"})), None).unwrap(), None);
    let e = anthropic_output_format(Some(&json!({"format": {"type": "json_schema", "schema": 5}})), None).unwrap_err();
    assert!(e.message.contains("object"), "{}", e.message);
    assert_eq!(
        strict_names(&[json!({"type": "function", "name": "a", "strict": true}), json!({"name": "b"})], None),
        vec!["a".to_string()]
    );
}

#[test]
fn the_tool_grammar_takes_what_the_renderer_writes_and_refuses_what_cannot_parse() {
    // Free text, then calls to offered tools with JSON or plain-text values.
    let mut c = grammar(&[], None);
    let text = format!(
        "Let me look.{}",
        block(&[call("shell", &[("cmd", true, "ls -la </tmp>")]), call("move", &[("to", false, "{\"x\": 3}")])])
    );
    assert!(accepts(&mut c, &text));
    assert!(c.is_complete() || c.mask().unwrap().ids().collect::<Vec<_>>() == vec![demo().0.eos()]);
    // Plain text alone is an answer.
    let mut c = grammar(&[], None);
    assert!(accepts(&mut c, "Just text, no tools.") && c.is_accepting());
    // An unknown tool, a value that is not JSON under string="false".
    let mut c = grammar(&[], None);
    assert!(!accepts(&mut c, &block(&[call("rm", &[])])));
    let mut c = grammar(&[], None);
    assert!(!accepts(&mut c, &block(&[call("shell", &[("cmd", false, "not json")])])));
    // Strict: schema order, required present, values valid against the property.
    let ok = block(&[call("move", &[("to", false, "{\"x\": 3}"), ("speed", false, "4"), ("note", true, "hi")])]);
    assert!(accepts(&mut grammar(&["move"], None), &ok));
    let ok = block(&[call("move", &[("to", false, "{\"x\": 3}"), ("note", true, "hi")])]);
    assert!(accepts(&mut grammar(&["move"], None), &ok));
    for bad in [
        block(&[call("move", &[("speed", false, "4")])]),         // `to` missing
        block(&[call("move", &[("to", false, "{\"x\": 300}")])]), // out of range
        block(&[call("move", &[("to", false, "{\"x\": 3}"), ("other", false, "1")])]), // unknown name
    ] {
        assert!(!accepts(&mut grammar(&["move"], None), &bad), "{bad}");
    }
    // With a format, the answer is the format (no free text before calls).
    let answer = json_block(&json!({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}));
    assert!(accepts(&mut grammar(&[], Some(&answer)), "{\"a\": 5}"));
    assert!(!accepts(&mut grammar(&[], Some(&answer)), "hello"));
    assert!(accepts(&mut grammar(&[], Some(&answer)), &block(&[call("shell", &[("cmd", true, "ls")])])[2..]));
}

#[test]
fn random_tool_calls_parse_back_with_json_arguments() {
    let (tok, _) = demo();
    let mut checked = 0;
    for seed in 0..12 {
        let mut rng = Rng::new(seed);
        let mut c = grammar(if seed % 2 == 0 { &["move"] } else { &[] }, None);
        // Start the block, then let noise choose everything else (EOS only once nothing else is allowed; a value
        // that runs long is cut by forcing the closing markup through the mask when it is allowed).
        let mut text =
            format!("ok\n\n<{D}tool_calls>\n<{D}invoke name=\"{}\">\n", if seed % 3 == 0 { "shell" } else { "move" });
        assert!(accepts(&mut c, &text), "{text}");
        let mut done = false;
        for _ in 0..600 {
            let mask = c.mask().unwrap();
            let ids: Vec<u32> = mask.ids().filter(|&t| t != tok.eos()).collect();
            if ids.is_empty() {
                done = true;
                break;
            }
            // Prefer special tokens (markup) when allowed, a quarter of the time, so values end.
            let dsml = tok.special().dsml.unwrap();
            let t = if mask.allows(dsml) && rng.next_f64() < 0.25 {
                dsml
            } else {
                ids[(rng.next_f64() * ids.len() as f64) as usize % ids.len()]
            };
            c.consume(t).unwrap();
            text.push_str(&tok.decode(&[t]).unwrap());
        }
        if !done {
            continue; // noise ran long: nothing to check
        }
        let parsed = parse_completion(&text, Mode::Chat);
        assert!(parsed.errors.is_empty(), "{text:?}: {:?}", parsed.errors);
        assert!(!parsed.tool_calls.is_empty(), "{text:?}");
        for call in &parsed.tool_calls {
            assert!(["shell", "move"].contains(&call.name.as_str()), "{text:?}");
            let args: Value = serde_json::from_str(&call.arguments).unwrap();
            assert!(args.is_object(), "{text:?}");
            if seed % 2 == 0 && call.name == "move" {
                assert!(args["to"]["x"].as_i64().is_some_and(|x| (0..=99).contains(&x)), "{text:?}");
                assert!(args.as_object().unwrap().keys().all(|k| ["to", "speed", "note"].contains(&k.as_str())));
            }
        }
        checked += 1;
    }
    assert!(checked >= 6, "only {checked} walks ended");
}

const PATCH_GRAMMAR: &str = r#"start: "*** Begin Patch\n" hunk hunk? "*** End Patch\n"
hunk: "*** Add File: " PATH "\n" line line? line?
PATH: /[a-z]{1,8}\.txt/
line: "+" /[a-z ]{0,20}/ "\n"
"#;

/// The demo tools plus a custom `apply_patch` tool in `format`.
fn custom_grammar(format: CustomFormat, force: Option<Force>, single: bool) -> Result<Constraint, String> {
    let (tok, f) = demo();
    let mut ts = tools();
    ts.push(tool("apply_patch", custom_parameters()));
    let rules = ToolRules {
        custom: vec![CustomTool { name: "apply_patch".into(), format, param: "tools[2].format".into() }],
        force,
        single,
        ..ToolRules::default()
    };
    let g = tool_grammar_with(&ts, &rules, None, tok.special().dsml.unwrap());
    f.compile(&GrammarSpec::Lark(g.clone())).map_err(|e| format!("{e}\n{g}"))
}

fn patch_call(input: &str) -> String {
    call("apply_patch", &[("input", true, input)])
}

#[test]
fn custom_tool_inputs_follow_their_grammar() {
    let patch = "*** Begin Patch\n*** Add File: a.txt\n+hello world\n*** End Patch\n";
    let lark = || CustomFormat::Lark(PATCH_GRAMMAR.into());
    // What the renderer writes for a call with that input is accepted; off-grammar input is not.
    let mut c = custom_grammar(lark(), None, false).unwrap();
    assert!(accepts(&mut c, &format!("Patching.{}", block(&[patch_call(patch)]))));
    assert!(c.is_complete() || c.is_accepting());
    assert!(!accepts(&mut custom_grammar(lark(), None, false).unwrap(), &block(&[patch_call("hello")])));
    assert!(!accepts(
        &mut custom_grammar(lark(), None, false).unwrap(),
        &block(&[patch_call("*** Begin Patch\n*** Add File: A.txt\n+x\n*** End Patch\n")])
    ));
    // JSON arguments are not what a custom tool takes.
    let json_args = block(&[call("apply_patch", &[("input", false, "\"x\"")])]);
    assert!(!accepts(&mut custom_grammar(lark(), None, false).unwrap(), &json_args));
    // Other tools keep their rules beside it.
    let both = block(&[call("shell", &[("cmd", true, "ls")]), patch_call(patch)]);
    assert!(accepts(&mut custom_grammar(lark(), None, false).unwrap(), &both));
    // A regex (with a `/` in it) is matched whole.
    let rx = || CustomFormat::Regex("[0-9]{3}/[a-z]{2,4}".into());
    assert!(accepts(&mut custom_grammar(rx(), None, false).unwrap(), &block(&[patch_call("123/abc")])));
    assert!(!accepts(&mut custom_grammar(rx(), None, false).unwrap(), &block(&[patch_call("12/abc")])));
    assert!(!accepts(&mut custom_grammar(rx(), None, false).unwrap(), &block(&[patch_call("123/abcde")])));
    // Free text: any input, even with `<` in it.
    let text = CustomFormat::Text;
    assert!(accepts(&mut custom_grammar(text, None, false).unwrap(), &block(&[patch_call("a </b> c")])));
}

#[test]
fn a_forced_call_admits_no_text_and_one_call_when_asked() {
    let patch = "*** Begin Patch\n*** Add File: a.txt\n+x\n*** End Patch\n";
    let lark = || CustomFormat::Lark(PATCH_GRAMMAR.into());
    let any = || Some(Force::Any);
    assert!(!accepts(&mut custom_grammar(lark(), any(), false).unwrap(), "Just text."));
    let mut c = custom_grammar(lark(), any(), false).unwrap();
    assert!(accepts(&mut c, &block(&[call("shell", &[("cmd", true, "ls")])])));
    let named = || Some(Force::Tool("apply_patch".into()));
    assert!(!accepts(&mut custom_grammar(lark(), named(), false).unwrap(), &block(&[call("shell", &[])])));
    assert!(accepts(&mut custom_grammar(lark(), named(), false).unwrap(), &block(&[patch_call(patch)])));
    // Without leading newlines too.
    assert!(accepts(&mut custom_grammar(lark(), named(), false).unwrap(), &block(&[patch_call(patch)])[2..]));
    // One call only.
    let two = block(&[patch_call(patch), patch_call(patch)]);
    assert!(accepts(&mut custom_grammar(lark(), named(), false).unwrap(), &two));
    assert!(!accepts(&mut custom_grammar(lark(), named(), true).unwrap(), &two));
}

#[test]
fn custom_inputs_come_back_from_the_arguments() {
    assert_eq!(custom_input(r#"{"input": "a\nb"}"#), "a\nb");
    assert_eq!(custom_input(r#"{"patch": "x"}"#), "x");
    assert_eq!(custom_input(r#"{"a": 1}"#), r#"{"a": 1}"#);
    assert_eq!(custom_input("not json"), "not json");
    assert!(custom_description("Edit files.", &CustomFormat::Lark("start: \"a\"".into())).contains("start: \"a\""));
    assert_eq!(custom_description("Edit files.", &CustomFormat::Text), "Edit files.");
    assert_eq!(lark_regex("a/b\\/c"), "a\\/b\\/c");
}
