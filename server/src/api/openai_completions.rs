//! `POST /v1/completions` (legacy OpenAI text completions): the prompt is raw text (or a list of token ids), no chat
//! template, no reasoning or tool parsing.
//!
//! Accepted: `prompt` (string, a one-element list of strings, or a list of token ids), `max_tokens`, `temperature`,
//! `top_p`, `top_k`, `seed`, `stop`, `n` (1 only), `stream`, `stream_options.include_usage`, `echo` (false only),
//! `response_format` (the completion follows it: see [`crate::structured`]).

use std::sync::Arc;

use bytes::Bytes;
use hyper::{HeaderMap, Response};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::api::errors::{ApiError, Flavor};
use crate::api::openai_chat::StreamOptions;
use crate::api::{max_tokens, models, now_unix, parse_json, sampling, stop_strings, OneOrMany};
use crate::generate::{new_id, Finish, GenEvent, GenOptions, Generation, Usage};
use crate::response::{json_response, sse_response, Body};
use crate::sse;
use crate::state::AppState;

#[derive(Debug, Deserialize)]
struct CompletionRequest {
    model: Option<String>,
    prompt: Prompt,
    max_tokens: Option<u64>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    top_k: Option<u64>,
    seed: Option<u64>,
    stop: Option<OneOrMany>,
    n: Option<u64>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    echo: Option<bool>,
    response_format: Option<Value>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
}

fn usage_json(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    })
}

fn finish_str(f: Finish) -> &'static str {
    if matches!(f, Finish::Length | Finish::ContextFull) {
        "length"
    } else {
        "stop"
    }
}

/// `POST /v1/completions`.
pub async fn handle(state: Arc<AppState>, _headers: HeaderMap, body: Bytes) -> Result<Response<Body>, ApiError> {
    let req: CompletionRequest = parse_json(&body)?;
    let model = models::check(&state, req.model.as_deref())?;
    let format = crate::structured::openai_response_format(req.response_format.as_ref())?;
    if req.n.is_some_and(|n| n != 1) {
        return Err(ApiError::param("n", "only n = 1 is supported"));
    }
    if req.echo == Some(true) {
        return Err(ApiError::param("echo", "echo is not supported"));
    }
    let tokens = match req.prompt {
        Prompt::Text(t) => crate::api::tokenize(&state, t, "prompt").await?,
        Prompt::Texts(mut v) if v.len() == 1 => crate::api::tokenize(&state, v.remove(0), "prompt").await?,
        Prompt::Texts(_) => return Err(ApiError::param("prompt", "exactly one prompt is supported")),
        Prompt::Tokens(t) => {
            if let Some(bad) = t.iter().find(|&&id| id as usize >= state.info.vocab_size) {
                return Err(ApiError::param("prompt", format!("token id {bad} is outside the vocabulary")));
            }
            if t.len() >= state.info.context_size {
                return Err(ApiError::context_overflow(t.len(), state.info.context_size).with_param("prompt"));
            }
            t
        }
    };
    let opts = GenOptions {
        sampling: sampling(req.temperature, req.top_p, req.top_k, req.seed)?,
        max_tokens: Some(max_tokens("max_tokens", req.max_tokens)?.unwrap_or(16)),
        stop: stop_strings("stop", req.stop.map(OneOrMany::into_vec))?,
        thinking: false,
        tool_id_prefix: "call_",
        raw: true,
        constraint: crate::structured::plan(&state, format, "response_format", &[], &[], false).await?,
    };
    let gen = Generation::start(&state, tokens, opts)?;
    let id = new_id("cmpl-");
    let created = now_unix();
    if !req.stream.unwrap_or(false) {
        let out = gen.collect().await?;
        return Ok(json_response(
            200,
            &json!({
                "id": id, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": 0, "text": out.content, "finish_reason": finish_str(out.finish),
                    "logprobs": null}],
                "usage": usage_json(&out.usage),
            }),
        ));
    }
    let include_usage = req.stream_options.and_then(|o| o.include_usage).unwrap_or(false);
    let (tx, response) = sse_response();
    tokio::spawn(async move {
        let chunk = |text: &str, finish: Option<&str>| {
            sse::data(&json!({
                "id": id, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": null}],
            }))
        };
        let mut gen = gen;
        gen.watch(&tx);
        while let Some(ev) = gen.next().await {
            let frame = match ev {
                Ok(GenEvent::Content(c)) => chunk(&c, None),
                Ok(GenEvent::KeepAlive) => sse::comment("keep-alive"),
                Ok(_) => continue,
                Err(e) => {
                    let _ = tx.send(sse::data(&e.body(Flavor::OpenAi))).await;
                    return;
                }
            };
            if !tx.send(frame).await {
                return;
            }
        }
        if !tx.send(chunk("", Some(finish_str(gen.finish())))).await {
            return;
        }
        if include_usage {
            let usage = sse::data(&json!({
                "id": id, "object": "text_completion", "created": created, "model": model,
                "choices": [], "usage": usage_json(&gen.usage()),
            }));
            if !tx.send(usage).await {
                return;
            }
        }
        let _ = tx.send(sse::done()).await;
    });
    Ok(response)
}
