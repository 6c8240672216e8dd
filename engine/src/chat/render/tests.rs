//! Renderer tests: the four golden chat-template cases (from `../shared`, failing in CI when absent) and the rules
//! the golden cases do not cover.

use super::*;

pub(crate) fn golden_dir() -> Option<std::path::PathBuf> {
    crate::testdata::shared("golden/chat-template", "case1.input.json")
}

/// Case number → mode, from the cases' README.
pub(crate) const CASE_MODES: [(u32, Mode); 4] =
    [(1, Mode::Thinking), (2, Mode::Thinking), (3, Mode::Thinking), (4, Mode::Chat)];

#[test]
fn golden_cases_render_byte_exact() {
    let Some(dir) = golden_dir() else { return };
    for (n, mode) in CASE_MODES {
        let input = std::fs::read_to_string(dir.join(format!("case{n}.input.json"))).unwrap();
        let expected = std::fs::read_to_string(dir.join(format!("case{n}.expected.txt"))).unwrap();
        let got = render(&RenderInput::from_json(&input).unwrap(), mode, ReasoningEffort::High).unwrap();
        if got != expected {
            let at =
                got.bytes().zip(expected.bytes()).position(|(a, b)| a != b).unwrap_or(got.len().min(expected.len()));
            let lo = at.saturating_sub(60);
            panic!(
                "case {n} differs at byte {at}:\n got: {:?}\nwant: {:?}",
                String::from_utf8_lossy(&got.as_bytes()[lo..(at + 60).min(got.len())]),
                String::from_utf8_lossy(&expected.as_bytes()[lo..(at + 60).min(expected.len())])
            );
        }
    }
}

fn msgs(json: &str) -> RenderInput {
    RenderInput::from_json(json).unwrap()
}

#[test]
fn generation_prompt_and_effort() {
    let input = msgs(r#"[{"role":"user","content":"Hi"}]"#);
    assert_eq!(
        render(&input, Mode::Chat, ReasoningEffort::High).unwrap(),
        "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜></think>"
    );
    assert_eq!(
        render(&input, Mode::Thinking, ReasoningEffort::High).unwrap(),
        "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜><think>"
    );
    // Effort max only matters in thinking mode, and goes before the first message.
    assert_eq!(
        render(&input, Mode::Chat, ReasoningEffort::Max).unwrap(),
        "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜></think>"
    );
    let max = render(&input, Mode::Thinking, ReasoningEffort::Max).unwrap();
    assert!(max.starts_with("<｜begin▁of▁sentence｜>Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"));
    assert!(max.ends_with("unchecked.\n\n<｜User｜>Hi<｜Assistant｜><think>"));
}

#[test]
fn tool_results_merge_in_call_order() {
    let input = msgs(
        r#"[{"role":"user","content":"q"},
            {"role":"assistant","reasoning_content":"r","tool_calls":[
               {"id":"a","function":{"name":"f","arguments":"{\"x\": 1, \"s\": \"t\"}"}},
               {"id":"b","function":{"name":"g","arguments":"not json"}}]},
            {"role":"tool","tool_call_id":"b","content":"B"},
            {"role":"tool","tool_call_id":"a","content":"A"},
            {"role":"user","content":"more"}]"#,
    );
    let got = render(&input, Mode::Chat, ReasoningEffort::High).unwrap();
    let want = "<｜begin▁of▁sentence｜><｜User｜>q<｜Assistant｜></think>\n\n<｜DSML｜tool_calls>\n\
<｜DSML｜invoke name=\"f\">\n<｜DSML｜parameter name=\"x\" string=\"false\">1</｜DSML｜parameter>\n\
<｜DSML｜parameter name=\"s\" string=\"true\">t</｜DSML｜parameter>\n</｜DSML｜invoke>\n\
<｜DSML｜invoke name=\"g\">\n<｜DSML｜parameter name=\"arguments\" string=\"true\">not json</｜DSML｜parameter>\n</｜DSML｜invoke>\n\
</｜DSML｜tool_calls><｜end▁of▁sentence｜><｜User｜><tool_result>A</tool_result>\n\n<tool_result>B</tool_result>\n\nmore<｜Assistant｜></think>";
    assert_eq!(got, want);
}

#[test]
fn thinking_keeps_reasoning_when_tools_are_declared() {
    let base = r#"{"role":"system","content":"s"},{"role":"user","content":"u1"},
        {"role":"assistant","reasoning_content":"R1","content":"A1"},{"role":"user","content":"u2"}"#;
    let without = render(&msgs(&format!("[{base}]")), Mode::Thinking, ReasoningEffort::High).unwrap();
    assert_eq!(without, "<｜begin▁of▁sentence｜>s<｜User｜>u1<｜Assistant｜></think>A1<｜end▁of▁sentence｜><｜User｜>u2<｜Assistant｜><think>");
    let with = render(
        &msgs(&format!(r#"{{"tools":[{{"type":"function","function":{{"name":"f"}}}}],"messages":[{base}]}}"#)),
        Mode::Thinking,
        ReasoningEffort::High,
    )
    .unwrap();
    assert!(with.contains("<｜User｜>u1<｜Assistant｜><think>R1</think>A1<｜end▁of▁sentence｜>"), "{with}");
    assert!(with.contains("### Available Tool Schemas\n\n{\"name\": \"f\"}\n\nYou MUST"));
}

#[test]
fn tasks_wo_eos_and_errors() {
    let input = msgs(r#"[{"role":"user","content":"t","task":"title"}]"#);
    assert_eq!(
        render(&input, Mode::Thinking, ReasoningEffort::High).unwrap(),
        "<｜begin▁of▁sentence｜><｜User｜>t<｜title｜>"
    );
    let input = msgs(r#"[{"role":"user","content":"t","task":"action"}]"#);
    assert_eq!(
        render(&input, Mode::Thinking, ReasoningEffort::High).unwrap(),
        "<｜begin▁of▁sentence｜><｜User｜>t<｜Assistant｜><think><｜action｜>"
    );
    let input = msgs(r#"[{"role":"user","content":"u"},{"role":"assistant","content":"par","wo_eos":true}]"#);
    assert_eq!(
        render(&input, Mode::Chat, ReasoningEffort::High).unwrap(),
        "<｜begin▁of▁sentence｜><｜User｜>u<｜Assistant｜></think>par"
    );
    assert!(
        render(&msgs(r#"[{"role":"user","content":"t","task":"nope"}]"#), Mode::Chat, ReasoningEffort::High).is_err()
    );
    assert!(render(&msgs(r#"[{"role":"developer","content":""}]"#), Mode::Chat, ReasoningEffort::High).is_err());
    assert_eq!(render(&RenderInput::default(), Mode::Chat, ReasoningEffort::High).unwrap(), "<｜begin▁of▁sentence｜>");
    assert!("chat".parse::<Mode>().is_ok() && "x".parse::<Mode>().is_err());
    assert!("max".parse::<ReasoningEffort>().is_ok() && "low".parse::<ReasoningEffort>().is_ok());
    assert!("medium".parse::<ReasoningEffort>().is_err() && "".parse::<ReasoningEffort>().is_err());
}

#[test]
fn a_system_message_after_a_user_turn_joins_it() {
    // Claude Code's shape: the official encoder would glue `s` to `u` and never hand the turn to the assistant.
    let input =
        msgs(r#"[{"role":"system","content":"top"},{"role":"user","content":"u"},{"role":"system","content":"s"}]"#);
    assert_eq!(
        render(&input, Mode::Thinking, ReasoningEffort::High).unwrap(),
        "<｜begin▁of▁sentence｜>top<｜User｜>u\n\ns<｜Assistant｜><think>"
    );
    // The next turn extends it: the assistant reply follows the same transition.
    let turn2 = msgs(
        r#"[{"role":"system","content":"top"},{"role":"user","content":"u"},{"role":"system","content":"s"},
            {"role":"assistant","content":"a"},{"role":"user","content":"u2"}]"#,
    );
    let t2 = render(&turn2, Mode::Chat, ReasoningEffort::High).unwrap();
    let t1 = render(&input, Mode::Chat, ReasoningEffort::High).unwrap();
    assert!(t2.starts_with(&t1), "{t2}");
    assert_eq!(t2, format!("{t1}a<｜end▁of▁sentence｜><｜User｜>u2<｜Assistant｜></think>"));
    // After tool results too; after a developer turn it opens a user turn.
    let input = msgs(
        r#"[{"role":"user","content":"q"},{"role":"assistant","tool_calls":[{"id":"a","name":"f","arguments":"{}"}]},
            {"role":"tool","tool_call_id":"a","content":"R"},{"role":"system","content":"s"}]"#,
    );
    assert!(render(&input, Mode::Chat, ReasoningEffort::High)
        .unwrap()
        .ends_with("<｜User｜><tool_result>R</tool_result>\n\ns<｜Assistant｜></think>"));
    let input = msgs(r#"[{"role":"developer","content":"d"},{"role":"system","content":"s"}]"#);
    assert_eq!(
        render(&input, Mode::Chat, ReasoningEffort::High).unwrap(),
        "<｜begin▁of▁sentence｜><｜User｜>d<｜User｜>s<｜Assistant｜></think>"
    );
    // A system message after an assistant turn stays where the official encoder puts it.
    let input = msgs(
        r#"[{"role":"user","content":"u"},{"role":"assistant","content":"a"},{"role":"system","content":"s"},
            {"role":"user","content":"v"}]"#,
    );
    assert_eq!(
        render(&input, Mode::Chat, ReasoningEffort::High).unwrap(),
        "<｜begin▁of▁sentence｜><｜User｜>u<｜Assistant｜></think>a<｜end▁of▁sentence｜>s<｜User｜>v<｜Assistant｜></think>"
    );
}

#[test]
fn render_prompt_always_ends_in_the_assistant_transition() {
    let opt = |mode| RenderOptions { mode, ..RenderOptions::default() };
    // Where the official render already ends in it, nothing changes.
    for json in
        [r#"[{"role":"user","content":"Hi"}]"#, r#"[{"role":"system","content":"s"},{"role":"user","content":"u"}]"#]
    {
        let m = msgs(json).messages;
        for mode in [Mode::Chat, Mode::Thinking] {
            assert_eq!(render_prompt(&m, &opt(mode)).unwrap(), render_with(&m, &opt(mode)).unwrap());
        }
    }
    // A conversation ending in an assistant or system turn gets it.
    let m = msgs(r#"[{"role":"user","content":"u"},{"role":"assistant","content":"a"}]"#).messages;
    assert_eq!(
        render_prompt(&m, &opt(Mode::Thinking)).unwrap(),
        "<｜begin▁of▁sentence｜><｜User｜>u<｜Assistant｜><think></think>a<｜end▁of▁sentence｜><｜Assistant｜><think>"
    );
    let m = msgs(r#"[{"role":"system","content":"s"}]"#).messages;
    assert_eq!(render_prompt(&m, &opt(Mode::Chat)).unwrap(), "<｜begin▁of▁sentence｜>s<｜Assistant｜></think>");
    // A task token is the transition of its own kind.
    let m = msgs(r#"[{"role":"user","content":"t","task":"title"}]"#).messages;
    assert_eq!(render_prompt(&m, &opt(Mode::Chat)).unwrap(), "<｜begin▁of▁sentence｜><｜User｜>t<｜title｜>");
}
