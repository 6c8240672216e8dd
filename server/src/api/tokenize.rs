//! `POST /tokenize` and `POST /detokenize` (also under `/v1/`), in the shapes llama-server and vLLM answer, so a
//! client can check its prompt's length and a proxy can compute cache keys with the server's own tokenizer.
//!
//! `/tokenize` takes one of:
//! - `content` (llama-server) or `prompt` (vLLM): a text, tokenized as it is. Special-token text in it is parsed as
//!   the special token (llama-server's default `parse_special: true`; `false` is refused rather than ignored).
//! - `messages` (vLLM's chat form, OpenAI chat messages, with optional `tools`, `tool_choice`, `reasoning_effort`,
//!   `thinking`): rendered with the chat template exactly as `POST /v1/chat/completions` renders them, so the ids are
//!   the prompt that request would generate from. The rendered prompt already starts with the BOS token and ends
//!   where the assistant's reply starts (`add_generation_prompt: false` and `continue_final_message: true` are refused).
//!
//! `add_special` (llama-server, default `false`) or `add_special_tokens` (vLLM; default `true` for `prompt`, `false`
//! for `messages`) prepends the BOS token to a text. `with_pieces` (llama-server) returns `tokens` as
//! `[{"id", "piece"}]`, the piece a string, or the list of its bytes where the token is not whole UTF-8 by itself;
//! `return_token_strs` (vLLM) adds `token_strs` (pieces, lossy UTF-8). The answer always holds `tokens`, `count`
//! and `max_model_len` (the served context), which satisfies both servers' clients.
//!
//! `/detokenize` takes `tokens` (ids, each below the vocabulary size) and answers `{"content", "prompt"}` (the
//! llama-server and the vLLM name of the same text).

use std::sync::Arc;

use bytes::Bytes;
use hyper::{HeaderMap, Response};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::api::errors::ApiError;
use crate::api::openai_chat::{self, ChatRequest};
use crate::api::{models, parse_json};
use crate::model::EncodeError;
use crate::response::{json_response, Body};
use crate::state::AppState;

#[derive(Debug, Deserialize)]
struct TokenizeRequest {
    model: Option<String>,
    content: Option<String>,
    prompt: Option<String>,
    messages: Option<Value>,
    add_special: Option<bool>,
    add_special_tokens: Option<bool>,
    parse_special: Option<bool>,
    with_pieces: Option<bool>,
    return_token_strs: Option<bool>,
    add_generation_prompt: Option<bool>,
    continue_final_message: Option<bool>,
}

#[derive(Debug, Deserialize)]
struct DetokenizeRequest {
    model: Option<String>,
    tokens: Vec<i64>,
}

/// `POST /tokenize`.
pub async fn tokenize(state: Arc<AppState>, _h: HeaderMap, body: Bytes) -> Result<Response<Body>, ApiError> {
    let req: TokenizeRequest = parse_json(&body)?;
    models::check(&state, req.model.as_deref())?;
    if req.parse_special == Some(false) {
        return Err(ApiError::param("parse_special", "parse_special: false is not supported"));
    }
    // A bare text gets the BOS token by default only in vLLM's shape (`prompt`).
    let default_special = req.content.is_none();
    let ids = match (req.content.or(req.prompt), req.messages.is_some()) {
        (Some(_), true) => {
            return Err(ApiError::invalid("give either a text (`content` or `prompt`) or `messages`, not both"))
        }
        (None, false) => return Err(ApiError::invalid("missing `content`, `prompt` or `messages`")),
        (Some(text), false) => {
            let add = req.add_special.or(req.add_special_tokens).unwrap_or(default_special);
            let st = state.clone();
            let mut ids = run_blocking(move || st.codec.encode(&text).map_err(EncodeError::from)).await?;
            if add {
                if let Some(bos) = state.codec.bos() {
                    ids.insert(0, bos);
                }
            }
            ids
        }
        (None, true) => {
            if req.add_generation_prompt == Some(false) {
                return Err(ApiError::param(
                    "add_generation_prompt",
                    "add_generation_prompt: false is not supported (the chat template always ends where the \
                     assistant's reply starts)",
                ));
            }
            if req.continue_final_message == Some(true) {
                return Err(ApiError::param("continue_final_message", "continue_final_message is not supported"));
            }
            // The same request type and conversion as /v1/chat/completions, so the ids are that prompt's.
            let mut chat: ChatRequest = parse_json(&body)?;
            let mut conv = openai_chat::conversation(&mut chat)?;
            state.tools.restore(&mut conv);
            let st = state.clone();
            run_blocking(move || st.codec.prompt(&conv, usize::MAX)).await?
        }
    };
    let mut out = json!({"count": ids.len(), "max_model_len": state.info.context_size});
    let pieces = req.with_pieces.unwrap_or(false);
    let strs = req.return_token_strs.unwrap_or(false);
    if pieces || strs {
        let bytes: Vec<Vec<u8>> = ids.iter().map(|&t| state.codec.token_bytes(t)).collect();
        if strs {
            out["token_strs"] = bytes.iter().map(|b| Value::String(String::from_utf8_lossy(b).into_owned())).collect();
        }
        if pieces {
            out["tokens"] = ids
                .iter()
                .zip(&bytes)
                .map(|(&id, b)| match std::str::from_utf8(b) {
                    Ok(s) => json!({"id": id, "piece": s}),
                    Err(_) => json!({"id": id, "piece": b}),
                })
                .collect();
        }
    }
    if !pieces {
        out["tokens"] = json!(ids);
    }
    Ok(json_response(200, &out))
}

/// `POST /detokenize`.
pub async fn detokenize(state: Arc<AppState>, _h: HeaderMap, body: Bytes) -> Result<Response<Body>, ApiError> {
    let req: DetokenizeRequest = parse_json(&body)?;
    models::check(&state, req.model.as_deref())?;
    let vocab = state.info.vocab_size;
    let mut ids = Vec::with_capacity(req.tokens.len());
    for (i, &t) in req.tokens.iter().enumerate() {
        match u32::try_from(t) {
            Ok(id) if (id as usize) < vocab => ids.push(id),
            _ => {
                return Err(ApiError::param(
                    &format!("tokens[{i}]"),
                    format!("token id {t} is out of range (the vocabulary has {vocab} tokens)"),
                ))
            }
        }
    }
    let st = state.clone();
    let text = tokio::task::spawn_blocking(move || {
        let mut d = st.codec.decoder();
        let mut text = String::new();
        for id in ids {
            text.push_str(&d.push(id));
        }
        text.push_str(&d.finish());
        text
    })
    .await
    .map_err(|_| ApiError::internal("detokenizing failed"))?;
    Ok(json_response(200, &json!({"content": text, "prompt": text})))
}

async fn run_blocking<F>(f: F) -> Result<Vec<u32>, ApiError>
where
    F: FnOnce() -> Result<Vec<u32>, EncodeError> + Send + 'static,
{
    match tokio::task::spawn_blocking(f).await {
        Ok(Ok(ids)) => Ok(ids),
        Ok(Err(EncodeError::TooLong { limit })) => Err(ApiError::invalid(format!("more than {limit} tokens"))),
        Ok(Err(EncodeError::Failed(e))) => Err(ApiError::invalid(format!("could not tokenize: {e}"))),
        Err(_) => Err(ApiError::internal("tokenizing failed")),
    }
}
