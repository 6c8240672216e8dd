//! Structured outputs: what each API asks for (a JSON schema, any JSON object, a regex, a Lark grammar, strict
//! tools) turned into one grammar over the completion, compiled per request ([`ds4_engine::grammar`]) and handed
//! to the scheduler as a [`JobConstraint`], which masks every sampled token.
//!
//! What a request gets:
//! * **No format, no tools**: nothing (free sampling).
//! * **A format, no tools**: the answer is exactly the format (a JSON schema, `json_object`, a regex or a Lark
//!   grammar), then EOS.
//! * **Tools offered** (with or without a format): a Lark grammar over the whole answer in the model's DSML
//!   tool-call syntax ([`tool_grammar`]): either the answer (free text, or the format) or tool calls to offered
//!   tools only, each parameter value valid JSON (`string="false"`) or plain text (`string="true"`); a strict tool's
//!   parameters follow its input schema (names and order from `properties`, required ones present, values valid
//!   against each property's schema). So a tool call always parses back into a call with JSON arguments.
//! * **Custom tools** (Responses `{"type": "custom", "format": …}`, [`CustomTool`]): offered as a tool with one
//!   plain-text parameter, `input`; the value follows the tool's Lark grammar (nested as `%lark { … }`) or regex, or
//!   is free text. Each custom grammar is compiled alone first, so a bad one is a 400 naming the tool. A model
//!   without DSML (the test model) leaves its tool calls to its own parser: their grammars are checked, not
//!   enforced, as strict tools are not.
//! * **A forced call** ([`Force`]: `tool_choice` `"required"` or naming a tool): the answer is a tool-call block
//!   right away (at most two newlines before it), calling only the named tool when one is named.
//! * **One call** ([`ToolRules::single`], `parallel_tool_calls: false`): the block holds one invoke.
//! * **Thinking**: the constraint starts after `</think>` (`JobConstraint::trigger`); reasoning is free.
//!
//! A user Lark grammar replaces the whole answer (tools are not offered through it). Bad schemas and grammars are
//! 400s naming the problem; compilation runs on the blocking pool and is bounded by llguidance's limits. A custom
//! tool's grammar ends its value where the grammar ends: a grammar whose last terminal can also take `</` (say
//! `/.*/` at the very end) keeps that text in the terminal and the call cannot close; end such a grammar with a
//! literal (a newline, a keyword).

use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Map, Value};

use crate::api::errors::ApiError;
use crate::model::ToolSpec;
use crate::state::AppState;
use ds4_engine::grammar::{with_json_options, Constraint, ConstraintFactory, GrammarSpec, TokenMask};

/// What the answer must be.
#[derive(Debug, Clone, PartialEq)]
pub enum Format {
    /// Any JSON object.
    JsonObject,
    JsonSchema {
        name: Option<String>,
        schema: Value,
        strict: bool,
    },
    Regex(String),
    Lark(String),
}

/// How a custom tool's `input` is constrained.
#[derive(Debug, Clone, PartialEq)]
pub enum CustomFormat {
    /// Free text.
    Text,
    /// A Lark grammar (llguidance's dialect).
    Lark(String),
    /// A regex the whole input matches.
    Regex(String),
}

/// A custom (freeform) tool: offered as a tool named `name` with one plain-text parameter, `input`.
#[derive(Debug, Clone, PartialEq)]
pub struct CustomTool {
    pub name: String,
    pub format: CustomFormat,
    /// The request field its format came from (`tools[3].format`), for error messages.
    pub param: String,
}

/// The one parameter of a custom tool.
pub const CUSTOM_INPUT: &str = "input";

/// The parameters schema a custom tool is offered with.
pub fn custom_parameters() -> Value {
    json!({
        "type": "object",
        "properties": {CUSTOM_INPUT: {"type": "string", "description": "The tool's raw input text (not JSON)."}},
        "required": [CUSTOM_INPUT],
    })
}

/// The description a custom tool is offered with: its own, then what the input must be.
pub fn custom_description(description: &str, format: &CustomFormat) -> String {
    let rule = match format {
        CustomFormat::Text => return description.to_string(),
        CustomFormat::Lark(g) => format!("follows this Lark grammar:\n```lark\n{}\n```", g.trim_end()),
        CustomFormat::Regex(r) => format!("matches this regular expression: `{r}`"),
    };
    let sep = if description.is_empty() { "" } else { "\n\n" };
    format!("{description}{sep}The `{CUSTOM_INPUT}` parameter is raw text (not JSON) that {rule}")
}

/// The `input` of a custom tool's call, from the call's JSON arguments (`{"input": "…"}`; a lone string value of
/// another name is taken too; anything else is passed as the arguments text).
pub fn custom_input(arguments: &str) -> String {
    match serde_json::from_str::<Value>(arguments) {
        Ok(Value::Object(m)) => match m.get(CUSTOM_INPUT) {
            Some(Value::String(s)) => s.clone(),
            _ => match (m.len(), m.values().next()) {
                (1, Some(Value::String(s))) => s.clone(),
                _ => arguments.to_string(),
            },
        },
        Ok(Value::String(s)) => s,
        _ => arguments.to_string(),
    }
}

/// A tool call the answer must make.
#[derive(Debug, Clone, PartialEq)]
pub enum Force {
    /// Any offered tool (`tool_choice: "required"`).
    Any,
    /// This tool.
    Tool(String),
}

/// What constrains the offered tools beyond JSON-valid arguments.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ToolRules {
    /// Tools whose parameters follow their input schema.
    pub strict: Vec<String>,
    /// Custom tools (also in the tool list, as [`custom_parameters`]).
    pub custom: Vec<CustomTool>,
    /// The answer must call a tool.
    pub force: Option<Force>,
    /// At most one call (`parallel_tool_calls: false`).
    pub single: bool,
}

impl ToolRules {
    /// A custom tool of this name.
    pub fn custom(&self, name: &str) -> Option<&CustomTool> {
        self.custom.iter().find(|c| c.name == name)
    }

    fn needs_grammar(&self) -> bool {
        self.force.is_some() || self.custom.iter().any(|c| c.format != CustomFormat::Text)
    }
}

/// A regex matching `text` literally.
fn regex_literal(text: &str) -> String {
    let mut out = String::with_capacity(text.len() * 2);
    for c in text.chars() {
        if "\\.+*?()|[]{}^$#&-~".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// A regex as the body of a Lark `/…/` literal: unescaped `/` escaped, line breaks spelled out.
fn lark_regex(rx: &str) -> String {
    let mut out = String::with_capacity(rx.len() + 8);
    let mut escaped = false;
    for c in rx.chars() {
        match c {
            '/' if !escaped => out.push_str("\\/"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            _ => out.push(c),
        }
        escaped = c == '\\' && !escaped;
    }
    out
}

/// The grammar support of a model: the factory and the special ids grammars name.
#[derive(Debug, Clone)]
pub struct GrammarSupport {
    pub factory: ConstraintFactory,
    pub eos: u32,
    /// The ids that end the reasoning (`</think>`; one special id on the real model).
    pub think_end: Vec<u32>,
    /// The DSML marker of the model's tool calls.
    pub dsml: Option<u32>,
    /// A model without DSML: the text its tool calls start with (the test model's `<tool_call>`); once it is
    /// written, the rest is left to that model's own parser.
    pub call_open: Option<String>,
}

/// A request's constraint as the scheduler uses it: masks after the trigger, and the ids sampled fed back.
#[derive(Debug, Clone)]
pub struct JobConstraint {
    constraint: Constraint,
    /// Free sampling until these ids have been sampled in a row (`</think>` in thinking mode); empty: active.
    trigger: Vec<u32>,
    /// How many leading ids of `trigger` the latest samples matched.
    matched: usize,
    /// The mask for the next sample, computed ahead (while the model's step runs).
    ready: Option<TokenMask>,
}

impl JobConstraint {
    pub fn new(constraint: Constraint, trigger: Vec<u32>) -> Self {
        JobConstraint { constraint, trigger, matched: 0, ready: None }
    }

    /// The constraint applies to the next token.
    pub fn active(&self) -> bool {
        self.trigger.is_empty()
    }

    /// Compute the next mask now (a worker calls this while the step runs); returns the time it took.
    pub fn prepare(&mut self) -> Result<Duration, String> {
        if !self.active() || self.ready.is_some() {
            return Ok(Duration::ZERO);
        }
        let t = std::time::Instant::now();
        let m = self.constraint.mask().map_err(|e| e.to_string())?;
        self.ready = Some(m);
        Ok(t.elapsed())
    }

    /// The mask for the next sample (`None`: free sampling); computed here when nothing was prepared.
    pub fn take_mask(&mut self) -> Result<Option<TokenMask>, String> {
        if !self.active() {
            return Ok(None);
        }
        self.prepare()?;
        Ok(self.ready.take())
    }

    /// Record the sampled id.
    pub fn accept(&mut self, id: u32) -> Result<(), String> {
        self.ready = None;
        if self.trigger.is_empty() {
            return self.constraint.consume(id).map_err(|e| e.to_string());
        }
        if self.trigger.get(self.matched) == Some(&id) {
            self.matched += 1;
        } else {
            self.matched = usize::from(self.trigger.first() == Some(&id));
        }
        if self.matched == self.trigger.len() {
            self.trigger.clear();
        }
        Ok(())
    }
}

fn bad(param: &str, msg: impl Into<String>) -> ApiError {
    ApiError::param(param, msg)
}

fn str_of<'a>(v: &'a Value, key: &str) -> Option<&'a str> {
    v.get(key).and_then(Value::as_str)
}

/// A `json_schema` format's schema, checked to be a schema-shaped value.
fn schema_of(v: Option<&Value>, param: &str) -> Result<Value, ApiError> {
    match v {
        Some(s @ (Value::Object(_) | Value::Bool(_))) => Ok(s.clone()),
        Some(_) => Err(bad(param, "the schema must be a JSON object")),
        None => Err(bad(param, "a json_schema format needs a `schema`")),
    }
}

/// The extension formats every API accepts beside its own: `{"type": "regex", "pattern": …}` and
/// `{"type": "grammar", "syntax": "lark", "definition": …}` (also `{"type": "lark", "grammar": …}`).
fn extension(kind: &str, v: &Value, param: &str) -> Result<Option<Format>, ApiError> {
    match kind {
        "regex" => {
            let p = str_of(v, "pattern").or_else(|| str_of(v, "regex")).or_else(|| str_of(v, "definition"));
            Ok(Some(Format::Regex(p.ok_or_else(|| bad(param, "a regex format needs a `pattern`"))?.to_string())))
        }
        "grammar" | "lark" => {
            let syntax = str_of(v, "syntax").unwrap_or("lark");
            if syntax != "lark" {
                return Err(bad(param, format!("grammar syntax `{syntax}` is not supported (only lark)")));
            }
            let g = str_of(v, "definition").or_else(|| str_of(v, "grammar"));
            Ok(Some(Format::Lark(g.ok_or_else(|| bad(param, "a grammar format needs a `definition`"))?.to_string())))
        }
        other => Err(bad(
            param,
            format!("unsupported format type `{other}`; expected text, json_object, json_schema, regex or grammar"),
        )),
    }
}

fn kind_of<'a>(v: &'a Value, param: &str) -> Result<&'a str, ApiError> {
    if !v.is_object() {
        return Err(bad(param, "the format must be an object with a `type`"));
    }
    str_of(v, "type").ok_or_else(|| bad(param, "the format needs a `type`"))
}

/// OpenAI chat / completions `response_format`: `text`, `json_object`, `json_schema` (`json_schema: {name, schema,
/// strict}`), plus the extensions.
pub fn openai_response_format(v: Option<&Value>) -> Result<Option<Format>, ApiError> {
    let param = "response_format";
    let Some(v) = v.filter(|v| !v.is_null()) else { return Ok(None) };
    match kind_of(v, param)? {
        "text" => Ok(None),
        "json_object" => Ok(Some(Format::JsonObject)),
        "json_schema" => {
            let js = v.get("json_schema").ok_or_else(|| bad(param, "a json_schema format needs `json_schema`"))?;
            Ok(Some(Format::JsonSchema {
                name: str_of(js, "name").map(str::to_string),
                schema: schema_of(js.get("schema"), "response_format.json_schema.schema")?,
                strict: js.get("strict").and_then(Value::as_bool).unwrap_or(false),
            }))
        }
        other => extension(other, v, param),
    }
}

/// Responses `text.format`: `text`, `json_object`, `json_schema` (flat: `name`, `schema`, `strict`), plus the
/// extensions.
pub fn responses_text_format(text: Option<&Value>) -> Result<Option<Format>, ApiError> {
    let param = "text.format";
    let Some(v) = text.and_then(|t| t.get("format")).filter(|v| !v.is_null()) else { return Ok(None) };
    match kind_of(v, param)? {
        "text" => Ok(None),
        "json_object" => Ok(Some(Format::JsonObject)),
        "json_schema" => Ok(Some(Format::JsonSchema {
            name: str_of(v, "name").map(str::to_string),
            schema: schema_of(v.get("schema"), "text.format.schema")?,
            strict: v.get("strict").and_then(Value::as_bool).unwrap_or(false),
        })),
        other => extension(other, v, param),
    }
}

/// Anthropic `output_config.format` (or the older beta `output_format`): `json_schema` (`schema`), plus the
/// extensions.
pub fn anthropic_output_format(
    output_config: Option<&Value>,
    output_format: Option<&Value>,
) -> Result<Option<Format>, ApiError> {
    let (v, param) = match output_config.and_then(|c| c.get("format")).filter(|v| !v.is_null()) {
        Some(v) => (v, "output_config.format"),
        None => match output_format.filter(|v| !v.is_null()) {
            Some(v) => (v, "output_format"),
            None => return Ok(None),
        },
    };
    match kind_of(v, param)? {
        "text" => Ok(None),
        "json_object" => Ok(Some(Format::JsonObject)),
        "json_schema" => Ok(Some(Format::JsonSchema {
            name: None,
            schema: schema_of(v.get("schema"), &format!("{param}.schema"))?,
            strict: true,
        })),
        other => extension(other, v, param),
    }
}

/// The model's grammar support (built once, on first use, by the codec).
fn support(state: &Arc<AppState>) -> Result<Arc<GrammarSupport>, ApiError> {
    state.codec.grammar().map_err(|e| ApiError::invalid(format!("structured outputs are not available: {e}")))
}

/// A Lark string literal.
fn lit(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into())
}

/// A `%json { … }` block for `schema` (with the compile options).
fn json_block(schema: &Value) -> String {
    format!("%json {}", with_json_options(schema.clone()))
}

/// The answer's grammar rule body for a format.
fn answer_rule(f: &Format) -> Result<String, ApiError> {
    Ok(match f {
        Format::JsonObject => json_block(&json!({"type": "object"})),
        Format::JsonSchema { schema, .. } => json_block(schema),
        Format::Regex(r) => format!("/{}/", lark_regex(r)),
        Format::Lark(_) => return Err(ApiError::invalid("a Lark grammar format cannot be combined with tools")),
    })
}

/// A property's schema with the root's `$defs` / `definitions` carried along (so `#/$defs/…` still resolves).
fn with_defs(prop: &Value, root: &Value) -> Value {
    let mut p = match prop {
        Value::Object(m) => m.clone(),
        Value::Bool(true) => Map::new(),
        other => return other.clone(),
    };
    for key in ["$defs", "definitions"] {
        if let Some(d) = root.get(key) {
            p.entry(key).or_insert_with(|| d.clone());
        }
    }
    Value::Object(p)
}

/// A property that takes plain text (`string="true"`): a string with no constraint on its value.
fn plain_string(prop: &Value) -> bool {
    let Some(m) = prop.as_object() else { return false };
    m.get("type").and_then(Value::as_str) == Some("string")
        && m.keys().all(|k| matches!(k.as_str(), "type" | "description" | "title" | "examples" | "default"))
}

/// The Lark grammar of an answer in DSML with `tools` offered (see the module doc). `answer` is the format's rule
/// body, `None` for free text; `strict` names the tools whose parameters follow their schemas.
pub fn tool_grammar(tools: &[ToolSpec], strict: &[String], answer: Option<&str>, dsml: u32) -> String {
    tool_grammar_with(tools, &ToolRules { strict: strict.to_vec(), ..ToolRules::default() }, answer, dsml)
}

/// [`tool_grammar`] with custom tools and a forced call ([`ToolRules`]).
pub fn tool_grammar_with(tools: &[ToolSpec], rules: &ToolRules, answer: Option<&str>, dsml: u32) -> String {
    let strict = &rules.strict;
    let d = format!("<[{dsml}]>");
    let mut g = String::new();
    // Free text never spells the DSML marker (the output parser would take it for markup).
    g.push_str("TEXT: /(?s:.*)/ & ~/(?s:.*)｜DSML｜(?s:.*)/\n");
    g.push_str("TEXT_LT: /(?s:.*)</ & ~/(?s:.*)｜DSML｜(?s:.*)/\n");
    g.push_str("SVAL: /(?s:.*)<\\// & ~/(?s:.*)｜DSML｜(?s:.*)/\n");
    g.push_str("PNAME: /[A-Za-z0-9_.\\-]{1,64}/\n");
    match (answer, &rules.force) {
        (_, Some(_)) => g.push_str(&format!("start: CALL_LT {d} calls\nCALL_LT: /\\n{{0,2}}</\n")),
        (None, None) => g.push_str(&format!("start: TEXT | TEXT_LT {d} calls\n")),
        (Some(a), None) => g.push_str(&format!("start: answer | \"<\" {d} calls\nanswer: {a}\n")),
    }
    // Every tag inside the block starts with a "\n<" or "\n</" lexeme (never "\n" then "<": a greedy lexer would
    // take "\n<" for the start of "\n</" and refuse the marker that follows).
    let n = if rules.single { "" } else { "+" };
    g.push_str(&format!("calls: \"tool_calls>\" invoke{n} \"\\n</\" {d} \"tool_calls>\"\n"));
    let names: Vec<String> = (0..tools.len())
        .filter(|&i| match &rules.force {
            Some(Force::Tool(n)) => tools[i].name == *n,
            _ => true,
        })
        .map(|i| format!("tool{i}"))
        .collect();
    g.push_str(&format!("invoke: {}\n", names.join(" | ")));
    for (i, t) in tools.iter().enumerate() {
        let head = format!("\"\\n<\" {d} {}", lit(&format!("invoke name=\"{}\">", t.name)));
        let tail = format!("\"\\n</\" {d} \"invoke>\"");
        let props = t.parameters.get("properties").and_then(Value::as_object);
        if let Some(c) = rules.custom(&t.name) {
            // One plain-text parameter, `input`, in the tool's format (the terminal takes the closing `</`, as
            // SVAL does, so the value ends exactly where the DSML marker comes).
            let open = format!("\"\\n<\" {d} {}", lit(&format!("parameter name=\"{CUSTOM_INPUT}\" string=\"true\">")));
            let close = format!("{d} \"parameter>\"");
            let body = match &c.format {
                CustomFormat::Text => format!("SVAL {close}"),
                CustomFormat::Regex(r) => {
                    g.push_str(&format!("T{i}IN: /(?:{})<\\// & ~/(?s:.*)｜DSML｜(?s:.*)/\n", lark_regex(r)));
                    format!("T{i}IN {close}")
                }
                CustomFormat::Lark(l) => format!("%lark {{\n{l}\n}} \"</\" {close}"),
            };
            g.push_str(&format!("tool{i}: {head} {open} {body} {tail}\n"));
        } else if strict.contains(&t.name) {
            let props: Vec<(&String, &Value)> = props.map(|p| p.iter().collect()).unwrap_or_default();
            let required: Vec<&str> = t
                .parameters
                .get("required")
                .and_then(Value::as_array)
                .map(|r| r.iter().filter_map(Value::as_str).collect())
                .unwrap_or_default();
            // Parameters in schema order; the optional ones may be left out.
            let mut seq = Vec::new();
            for (j, (name, prop)) in props.iter().enumerate() {
                let rule = format!("t{i}p{j}");
                let open = format!("\"\\n<\" {d} {}", lit(&format!("parameter name=\"{name}\" string=\"")));
                let close = format!("{d} \"parameter>\"");
                let json = format!("\"false\\\">\" {} \"</\" {close}", json_block(&with_defs(prop, &t.parameters)));
                let body = if plain_string(prop) { format!("(\"true\\\">\" SVAL {close} | {json})") } else { json };
                g.push_str(&format!("{rule}: {open} {body}\n"));
                seq.push(if required.contains(&name.as_str()) { rule } else { format!("{rule}?") });
            }
            g.push_str(&format!("tool{i}: {head} {} {tail}\n", seq.join(" ")));
        } else {
            let param = format!(
                "\"\\n<\" {d} \"parameter name=\\\"\" PNAME \"\\\" string=\\\"\" (\"true\\\">\" SVAL | \"false\\\">\" {} \"</\") {d} \"parameter>\"",
                json_block(&json!({}))
            );
            g.push_str(&format!("t{i}param: {param}\n"));
            g.push_str(&format!("tool{i}: {head} t{i}param* {tail}\n"));
        }
    }
    g
}

/// Tool names a request marked strict.
pub fn strict_names(tools: &[Value], nested: Option<&str>) -> Vec<String> {
    tools
        .iter()
        .filter_map(|t| {
            let f = nested.and_then(|k| t.get(k)).unwrap_or(t);
            let strict = f.get("strict").or_else(|| t.get("strict")).and_then(Value::as_bool) == Some(true);
            strict.then(|| str_of(f, "name").map(str::to_string)).flatten()
        })
        .collect()
}

/// The constraint for a request, compiled on the blocking pool; `None` when nothing constrains it.
pub async fn plan(
    state: &Arc<AppState>,
    format: Option<Format>,
    format_param: &str,
    tools: &[ToolSpec],
    strict: &[String],
    thinking: bool,
) -> Result<Option<JobConstraint>, ApiError> {
    let rules = ToolRules { strict: strict.to_vec(), ..ToolRules::default() };
    plan_with(state, format, format_param, tools, &rules, thinking).await
}

/// Compile `spec` on the blocking pool (timed into the metrics).
async fn compile(state: &Arc<AppState>, factory: &ConstraintFactory, spec: GrammarSpec) -> Result<Constraint, String> {
    let factory = factory.clone();
    let t = std::time::Instant::now();
    let compiled = tokio::task::spawn_blocking(move || factory.compile(&spec))
        .await
        .map_err(|_| "compiling the grammar failed".to_string())?;
    state.metrics.structured.compiled(t.elapsed());
    compiled.map_err(|e| e.0)
}

/// Checks a forced call against the offered tools (chat and messages: every tool they offer is a function tool):
/// a forced call with no tool offered, or naming a tool that is not offered, is a 400 on `param`.
pub fn check_force(force: Option<Force>, tools: &[ToolSpec], param: &str) -> Result<Option<Force>, ApiError> {
    match force {
        Some(Force::Any) if tools.is_empty() => {
            Err(ApiError::param(param, "tool_choice asks for a tool call, but no tool is offered"))
        }
        Some(Force::Tool(n)) if !tools.iter().any(|t| t.name == n) => {
            Err(ApiError::param(param, format!("tool_choice names `{n}`, which is not an offered tool")))
        }
        f => Ok(f),
    }
}

/// [`plan`] with custom tools and a forced call ([`ToolRules`]).
pub async fn plan_with(
    state: &Arc<AppState>,
    format: Option<Format>,
    format_param: &str,
    tools: &[ToolSpec],
    rules: &ToolRules,
    thinking: bool,
) -> Result<Option<JobConstraint>, ApiError> {
    if format.is_none() && tools.is_empty() {
        return Ok(None);
    }
    let sup = match support(state) {
        Ok(s) => s,
        // Tools alone on a model without grammar support (the test model): its own parser guards the calls.
        Err(_) if format.is_none() && !rules.needs_grammar() => return Ok(None),
        Err(e) => {
            let field = match rules.custom.iter().find(|c| c.format != CustomFormat::Text) {
                Some(c) if format.is_none() => {
                    return Err(ApiError::param(&c.param, format!("custom tool `{}`: {}", c.name, e.message)))
                }
                _ if format.is_none() => "tool_choice",
                _ => format_param,
            };
            return Err(ApiError::param(field, e.message));
        }
    };
    // Each custom grammar alone first: an error names its tool.
    for c in &rules.custom {
        let spec = match &c.format {
            CustomFormat::Text => continue,
            CustomFormat::Lark(l) => GrammarSpec::Lark(l.clone()),
            CustomFormat::Regex(r) => GrammarSpec::Regex(r.clone()),
        };
        compile(state, &sup.factory, spec)
            .await
            .map_err(|e| ApiError::param(&c.param, format!("custom tool `{}`: {e}", c.name)))?;
    }
    let spec = match (&format, tools.is_empty(), sup.dsml) {
        (Some(Format::Lark(l)), _, _) => GrammarSpec::Lark(l.clone()),
        (Some(f), true, _) => match f {
            Format::JsonObject => GrammarSpec::any_json_object(),
            Format::JsonSchema { schema, .. } => GrammarSpec::JsonSchema(schema.clone()),
            Format::Regex(r) => GrammarSpec::Regex(r.clone()),
            Format::Lark(_) => unreachable!("matched above"),
        },
        (f, false, Some(dsml)) => {
            let answer = f.as_ref().map(answer_rule).transpose()?;
            GrammarSpec::Lark(tool_grammar_with(tools, rules, answer.as_deref(), dsml))
        }
        (Some(f), false, None) => match &sup.call_open {
            // The answer in the format, or a tool call in the model's own syntax.
            Some(open) => GrammarSpec::Lark(format!(
                "start: answer | CALL\nanswer: {}\nCALL: /{}(?s:.*)/\n",
                answer_rule(f)?,
                lark_regex(&regex_literal(open))
            )),
            None => return Err(ApiError::invalid("this model has no tool-call marker")),
        },
        (None, _, _) => return Ok(None),
    };
    let c = compile(state, &sup.factory, spec)
        .await
        .map_err(|e| ApiError::param(if format.is_some() { format_param } else { "tools" }, e))?;
    let trigger = if thinking { sup.think_end.clone() } else { Vec::new() };
    if thinking && trigger.is_empty() {
        return Err(ApiError::param(format_param, "this model cannot end its reasoning under a grammar"));
    }
    Ok(Some(JobConstraint::new(c, trigger)))
}

#[cfg(test)]
mod tests;
