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
//! * **Thinking**: the constraint starts after `</think>` ([`JobConstraint::trigger`]); reasoning is free.
//!
//! A user Lark grammar replaces the whole answer (tools are not offered through it). Bad schemas and grammars are
//! 400s naming the problem; compilation runs on the blocking pool and is bounded by llguidance's limits.

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

/// The grammar support of a model: the factory and the special ids grammars name.
#[derive(Debug, Clone)]
pub struct GrammarSupport {
    pub factory: ConstraintFactory,
    pub eos: u32,
    pub think_end: Option<u32>,
    pub dsml: Option<u32>,
}

/// A request's constraint as the scheduler uses it: masks after the trigger, and the ids sampled fed back.
#[derive(Debug, Clone)]
pub struct JobConstraint {
    constraint: Constraint,
    /// Free sampling until this id has been sampled (`</think>` in thinking mode).
    pub trigger: Option<u32>,
    /// The mask for the next sample, computed ahead (while the model's step runs).
    ready: Option<TokenMask>,
}

impl JobConstraint {
    pub fn new(constraint: Constraint, trigger: Option<u32>) -> Self {
        JobConstraint { constraint, trigger, ready: None }
    }

    /// The constraint applies to the next token.
    pub fn active(&self) -> bool {
        self.trigger.is_none()
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
        match self.trigger {
            Some(t) => {
                if t == id {
                    self.trigger = None;
                }
                Ok(())
            }
            None => self.constraint.consume(id).map_err(|e| e.to_string()),
        }
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
        Format::Regex(r) => format!("/{}/", r.replace('/', "\\/")),
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
    let d = format!("<[{dsml}]>");
    let mut g = String::new();
    // Free text never spells the DSML marker (the output parser would take it for markup).
    g.push_str("TEXT: /(?s:.*)/ & ~/(?s:.*)｜DSML｜(?s:.*)/\n");
    g.push_str("TEXT_LT: /(?s:.*)</ & ~/(?s:.*)｜DSML｜(?s:.*)/\n");
    g.push_str("SVAL: /(?s:.*)<\\// & ~/(?s:.*)｜DSML｜(?s:.*)/\n");
    g.push_str("PNAME: /[A-Za-z0-9_.\\-]{1,64}/\n");
    match answer {
        None => g.push_str(&format!("start: TEXT | TEXT_LT {d} calls\n")),
        Some(a) => g.push_str(&format!("start: answer | \"<\" {d} calls\nanswer: {a}\n")),
    }
    // Every tag inside the block starts with a "\n<" or "\n</" lexeme (never "\n" then "<": a greedy lexer would
    // take "\n<" for the start of "\n</" and refuse the marker that follows).
    g.push_str(&format!("calls: \"tool_calls>\" invoke+ \"\\n</\" {d} \"tool_calls>\"\n"));
    let names: Vec<String> = (0..tools.len()).map(|i| format!("tool{i}")).collect();
    g.push_str(&format!("invoke: {}\n", names.join(" | ")));
    for (i, t) in tools.iter().enumerate() {
        let head = format!("\"\\n<\" {d} {}", lit(&format!("invoke name=\"{}\">", t.name)));
        let tail = format!("\"\\n</\" {d} \"invoke>\"");
        let props = t.parameters.get("properties").and_then(Value::as_object);
        if strict.contains(&t.name) {
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
    if format.is_none() && tools.is_empty() {
        return Ok(None);
    }
    let sup = match support(state) {
        Ok(s) => s,
        // Tools alone on a model without grammar support (the test model): its own parser guards the calls.
        Err(_) if format.is_none() => return Ok(None),
        Err(e) => return Err(e),
    };
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
            GrammarSpec::Lark(tool_grammar(tools, strict, answer.as_deref(), dsml))
        }
        (None, _, _) => return Ok(None),
        (Some(_), _, None) => return Err(ApiError::invalid("this model has no tool-call marker")),
    };
    let factory = sup.factory.clone();
    let t = std::time::Instant::now();
    let compiled = tokio::task::spawn_blocking(move || factory.compile(&spec))
        .await
        .map_err(|_| ApiError::internal("compiling the grammar failed"))?;
    state.metrics.structured.compiled(t.elapsed());
    let c = compiled.map_err(|e| ApiError::param(if format.is_some() { format_param } else { "tools" }, e.0))?;
    let trigger = if thinking { sup.think_end } else { None };
    let _ = sup.eos;
    Ok(Some(JobConstraint::new(c, trigger)))
}

#[cfg(test)]
mod tests;
