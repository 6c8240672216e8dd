//! Parser tests: golden assistant turns parse back into their messages; bounded fuzzing (random splits give the
//! same result as one piece; random mutations never panic and keep the invariants); malformed DSML cases.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;
use crate::chat::render::tests::{golden_dir, CASE_MODES};
use crate::chat::types::RenderInput;
use crate::tokenizer::ASSISTANT_TOKEN;

/// The assistant completions inside a rendered conversation: (mode it was generated in, text incl. EOS).
fn completions(rendered: &str) -> Vec<(Mode, String)> {
    let mut out = Vec::new();
    for seg in rendered.split(ASSISTANT_TOKEN).skip(1) {
        let (mode, rest) = if let Some(r) = seg.strip_prefix(THINK_START_TOKEN) {
            (Mode::Thinking, r)
        } else if let Some(r) = seg.strip_prefix(THINK_END_TOKEN) {
            (Mode::Chat, r)
        } else {
            panic!("assistant turn without <think> or </think>: {seg:?}")
        };
        let rest = crate::chat::render::TASK_TOKENS.iter().fold(rest, |r, (_, t)| r.strip_prefix(t).unwrap_or(r));
        if let Some(end) = rest.find(EOS_TOKEN) {
            out.push((mode, rest[..end + EOS_TOKEN.len()].to_string()));
        }
    }
    out
}

fn golden_completions() -> Vec<(Mode, String, Message)> {
    let Some(dir) = golden_dir() else { return Vec::new() };
    let mut all = Vec::new();
    for (n, _) in CASE_MODES {
        let input =
            RenderInput::from_json(&std::fs::read_to_string(dir.join(format!("case{n}.input.json"))).unwrap()).unwrap();
        let expected = std::fs::read_to_string(dir.join(format!("case{n}.expected.txt"))).unwrap();
        let assistants: Vec<&Message> = input.messages.iter().filter(|m| m.role == Role::Assistant).collect();
        let comps = completions(&expected);
        assert_eq!(comps.len(), assistants.len(), "case {n}");
        for ((mode, text), m) in comps.into_iter().zip(assistants) {
            all.push((mode, text, m.clone()));
        }
    }
    all
}

#[test]
fn golden_assistant_turns_parse_back() {
    let all = golden_completions();
    if all.is_empty() {
        return;
    }
    assert_eq!(all.len(), 8);
    for (mode, text, m) in all {
        let p = parse_completion(&text, mode);
        assert!(p.errors.is_empty() && p.finished, "{text:?}: {:?}", p.errors);
        assert_eq!(p.content, m.content.clone().unwrap_or_default(), "{text:?}");
        let want_reasoning =
            if mode == Mode::Thinking { m.reasoning_content.clone().unwrap_or_default() } else { String::new() };
        assert_eq!(p.reasoning_content, want_reasoning);
        assert_eq!(p.tool_calls.len(), m.tool_calls.len());
        for (got, want) in p.tool_calls.iter().zip(&m.tool_calls) {
            assert_eq!(got.name, want.name);
            // The official decoder writes arguments exactly like this; the inputs are already in that form.
            assert_eq!(got.arguments, want.arguments);
        }
    }
}

/// Concatenated deltas per kind plus the final result: what must not depend on the split.
#[derive(Debug, PartialEq)]
struct Summary {
    reasoning: String,
    content: String,
    calls: Vec<(String, String)>,
    errors: usize,
    result: ParsedMessage,
}

fn run_chunks(chunks: &[&str], mode: Mode) -> Summary {
    let mut p = StreamParser::new(mode);
    let mut ev = Vec::new();
    for c in chunks {
        ev.extend(p.push(c));
    }
    let (last, result) = p.finish();
    ev.extend(last);
    let mut s = Summary { reasoning: String::new(), content: String::new(), calls: Vec::new(), errors: 0, result };
    for e in ev {
        match e {
            ParseEvent::ReasoningDelta(d) => s.reasoning += &d,
            ParseEvent::ContentDelta(d) => s.content += &d,
            ParseEvent::ToolCallStart { index, name } => {
                if index >= s.calls.len() {
                    s.calls.resize(index + 1, Default::default());
                }
                s.calls[index] = (name, String::new());
            }
            ParseEvent::ToolArgsDelta { index, delta } => s.calls[index].1 += &delta,
            ParseEvent::ToolCallEnd { .. } => {}
            ParseEvent::Error(_) => s.errors += 1,
        }
    }
    // Invariants: deltas agree with the result; every finished call has valid JSON arguments.
    assert_eq!(s.reasoning, s.result.reasoning_content);
    assert_eq!(s.content, s.result.content);
    assert_eq!(s.errors, s.result.errors.len());
    for (i, c) in s.result.tool_calls.iter().enumerate() {
        assert_eq!((&s.calls[i].0, &s.calls[i].1), (&c.name, &c.arguments));
        assert!(serde_json::from_str::<serde_json::Value>(&c.arguments).is_ok(), "{:?}", c.arguments);
    }
    s
}

fn random_split<'a>(text: &'a str, rng: &mut StdRng) -> Vec<&'a str> {
    let bounds: Vec<usize> = (0..=text.len()).filter(|&i| text.is_char_boundary(i)).collect();
    let mut cuts: Vec<usize> = (0..rng.gen_range(0..12)).map(|_| bounds[rng.gen_range(0..bounds.len())]).collect();
    if rng.gen_bool(0.2) {
        cuts = bounds.clone(); // one character at a time
    }
    cuts.push(0);
    cuts.push(text.len());
    cuts.sort_unstable();
    cuts.dedup();
    cuts.windows(2).map(|w| &text[w[0]..w[1]]).collect()
}

fn samples() -> Vec<(Mode, String)> {
    let mut v: Vec<(Mode, String)> = golden_completions().into_iter().map(|(m, t, _)| (m, t)).collect();
    let d = DSML_TOKEN;
    v.push((Mode::Thinking, format!(
        "plan</think>Sure.\n\n<{d}tool_calls>\n<{d}invoke name=\"f\">\n<{d}parameter name=\"a\" string=\"false\">[1, {{\"b\": null}}]</{d}parameter>\n\
<{d}parameter name=\"q\" string=\"true\">say \"hi\"\n\\ now</{d}parameter>\n</{d}invoke>\n<{d}invoke name=\"g\">\n</{d}invoke>\n</{d}tool_calls>{EOS_TOKEN}"
    )));
    v.push((Mode::Chat, "plain answer with <｜DSML｜ in it and \n\n newline".to_string()));
    v.push((Mode::Thinking, "<think>unfinished reasoning".to_string()));
    v
}

#[test]
fn splits_do_not_change_the_result() {
    let mut rng = StdRng::seed_from_u64(7);
    for (mode, text) in samples() {
        let whole = run_chunks(&[&text], mode);
        for _ in 0..60 {
            let chunks = random_split(&text, &mut rng);
            assert_eq!(run_chunks(&chunks, mode), whole, "split {chunks:?}");
        }
    }
}

#[test]
fn mutations_never_panic_and_keep_invariants() {
    let mut rng = StdRng::seed_from_u64(11);
    let alphabet = ['<', '>', '/', '"', '\n', ' ', '｜', 'D', 'S', 'M', 'L', '=', 'x', '{', '}', '\\'];
    let pieces =
        ["｜DSML｜", "</think>", EOS_TOKEN, "<｜DSML｜parameter name=\"", "\" string=\"", "\">", "</｜DSML｜invoke>"];
    for (mode, text) in samples() {
        for _ in 0..150 {
            let mut chars: Vec<String> = text.chars().map(String::from).collect();
            for _ in 0..rng.gen_range(1..6) {
                let i = rng.gen_range(0..=chars.len());
                match rng.gen_range(0..4) {
                    0 if i < chars.len() => {
                        chars.remove(i);
                    }
                    1 => chars.insert(i, alphabet[rng.gen_range(0..alphabet.len())].to_string()),
                    2 => chars.insert(i, pieces[rng.gen_range(0..pieces.len())].to_string()),
                    _ if i < chars.len() => chars[i] = alphabet[rng.gen_range(0..alphabet.len())].to_string(),
                    _ => {}
                }
            }
            let mutated: String = chars.concat();
            let whole = run_chunks(&[&mutated], mode);
            let chunks = random_split(&mutated, &mut rng);
            assert_eq!(run_chunks(&chunks, mode), whole, "mutated {mutated:?}");
        }
    }
}

#[test]
fn malformed_dsml_is_reported_not_lost() {
    let d = DSML_TOKEN;
    // Garbage inside the block: an error, the rest becomes content.
    let p = parse_completion(&format!("hi\n\n<{d}tool_calls>\nnonsense{EOS_TOKEN}"), Mode::Chat);
    assert_eq!(p.content, "hinonsense");
    assert!(p.tool_calls.is_empty() && p.finished && p.errors.len() == 1);
    // Bad string flag: error, the call is dropped.
    let p = parse_completion(
        &format!("<{d}tool_calls>\n<{d}invoke name=\"f\">\n<{d}parameter name=\"a\" string=\"maybe\">1</{d}parameter>\n</{d}invoke>\n</{d}tool_calls>"),
        Mode::Chat,
    );
    assert!(p.tool_calls.is_empty() && !p.errors.is_empty());
    // Non-JSON value with string="false": kept as a string, reported.
    let p = parse_completion(
        &format!("<{d}tool_calls>\n<{d}invoke name=\"f\">\n<{d}parameter name=\"a\" string=\"false\">not json</{d}parameter>\n</{d}invoke>\n</{d}tool_calls>{EOS_TOKEN}"),
        Mode::Chat,
    );
    assert_eq!(p.tool_calls, vec![ParsedToolCall { name: "f".into(), arguments: "{\"a\": \"not json\"}".into() }]);
    assert_eq!(p.errors.len(), 1);
    // Truncated mid-call: the call is dropped, an error says so.
    let p = parse_completion(
        &format!("x\n\n<{d}tool_calls>\n<{d}invoke name=\"f\">\n<{d}parameter name=\"a\" string=\"true\">abc"),
        Mode::Chat,
    );
    assert_eq!(p.content, "x");
    assert!(p.tool_calls.is_empty() && p.errors.len() == 1 && !p.finished);
    // Text after EOS is ignored but reported.
    let p = parse_completion(&format!("done{EOS_TOKEN}more"), Mode::Chat);
    assert_eq!((p.content.as_str(), p.finished, p.errors.len()), ("done", true, 1));
}

#[test]
fn streaming_events_and_tool_syntax_flag() {
    let d = DSML_TOKEN;
    let mut p = StreamParser::new(Mode::Thinking);
    assert_eq!(p.push("think"), vec![ParseEvent::ReasoningDelta("think".into())]);
    assert_eq!(p.push("ing</th"), vec![ParseEvent::ReasoningDelta("ing".into())]);
    assert_eq!(p.push("ink>Hello\n"), vec![ParseEvent::ContentDelta("Hello".into())]);
    assert!(!p.in_tool_syntax());
    let ev = p.push(&format!("\n<{d}tool_calls>\n<{d}invoke name=\"get\">\n"));
    assert!(ev.is_empty() || !ev.iter().any(|e| matches!(e, ParseEvent::ContentDelta(_))), "{ev:?}");
    assert!(ev.contains(&ParseEvent::ToolCallStart { index: 0, name: "get".into() }));
    assert!(p.in_tool_syntax());
    let ev = p.push(&format!("<{d}parameter name=\"city\" string=\"true\">Par"));
    assert!(!p.in_tool_syntax());
    assert_eq!(
        ev,
        vec![
            ParseEvent::ToolArgsDelta { index: 0, delta: "\"city\": \"".into() },
            ParseEvent::ToolArgsDelta { index: 0, delta: "Par".into() }
        ]
    );
    p.push(&format!("is</{d}parameter>\n</{d}invoke>\n</{d}tool_calls>"));
    let ev = p.push(EOS_TOKEN);
    assert!(ev.is_empty() && p.is_done());
    let (_, r) = p.finish();
    assert_eq!(r.tool_calls, vec![ParsedToolCall { name: "get".into(), arguments: "{\"city\": \"Paris\"}".into() }]);
    assert_eq!((r.reasoning_content.as_str(), r.content.as_str()), ("thinking", "Hello"));
    assert_eq!(r.to_message().tool_calls[0].name, "get");
}
