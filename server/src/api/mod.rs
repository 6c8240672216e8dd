//! One module per wire API, plus what they share: JSON decoding with clear errors, model-name checks, sampling
//! parameter validation and the unix timestamp.
//!
//! Every API module turns its request into a [`crate::model::Conversation`] (unknown fields are ignored, never
//! rejected), starts a [`crate::generate::Generation`] and answers either with one JSON object or with an SSE stream
//! written by a spawned task (which stops, cancelling the job, as soon as the client is gone).

pub mod anthropic;
pub mod content;
pub mod errors;
pub mod models;
pub mod openai_chat;
pub mod openai_completions;
pub mod responses;
pub mod tokenize;

use serde::de::DeserializeOwned;

use std::sync::Arc;

use crate::model::{Conversation, EncodeError};
use crate::state::AppState;
use ds4_engine::sampler::SamplerConfig;
use errors::ApiError;

/// Decode a JSON body into `T`; syntax and type errors become 400s naming the problem.
pub fn parse_json<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    if body.iter().all(|b| b.is_ascii_whitespace()) {
        return Err(ApiError::invalid("the request body is empty; expected a JSON object"));
    }
    serde_json::from_slice(body).map_err(|e| ApiError::bad_json(&e))
}

/// Validate sampling knobs (OpenAI ranges; `top_k` is an extension). Without a seed, a random one.
pub fn sampling(
    temperature: Option<f64>,
    top_p: Option<f64>,
    top_k: Option<u64>,
    seed: Option<u64>,
) -> Result<SamplerConfig, ApiError> {
    let temperature = temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::param("temperature", format!("temperature must be between 0 and 2, got {temperature}")));
    }
    let top_p = top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::param("top_p", format!("top_p must be in (0, 1], got {top_p}")));
    }
    Ok(SamplerConfig {
        temperature: temperature as f32,
        top_p: (top_p as f32).max(f32::MIN_POSITIVE),
        top_k: top_k.unwrap_or(0).min(u32::MAX as u64) as usize,
        seed: seed.unwrap_or_else(rand::random),
        ..SamplerConfig::default()
    })
}

/// Validate an optional token limit (must be ≥ 1).
pub fn max_tokens(name: &str, v: Option<u64>) -> Result<Option<usize>, ApiError> {
    match v {
        Some(0) => Err(ApiError::param(name, format!("{name} must be at least 1"))),
        Some(n) => Ok(Some(n.min(usize::MAX as u64) as usize)),
        None => Ok(None),
    }
}

/// Tokenize text for a prompt named `param` (a tokenizer failure is a 400 naming it; more tokens than the context
/// holds is the context-length error, found without tokenizing the whole text). Runs on the blocking pool so a long
/// text never holds up the threads that answer other requests.
pub async fn tokenize(state: &Arc<AppState>, text: String, param: &'static str) -> Result<Vec<u32>, ApiError> {
    let st = state.clone();
    blocking(state, param, move || st.codec.encode_bounded(&text, st.info.context_size.saturating_sub(1))).await
}

/// Render a conversation and tokenize it (see [`crate::model::Codec::prompt`]), on the blocking pool; `param` is
/// the request field a context-length error names (`messages`, `input`).
pub async fn prompt_tokens(
    state: &Arc<AppState>,
    conv: &Conversation,
    param: &'static str,
) -> Result<Vec<u32>, ApiError> {
    let st = state.clone();
    let conv = conv.clone();
    blocking(state, param, move || st.codec.prompt(&conv, st.info.context_size.saturating_sub(1))).await
}

async fn blocking<F>(state: &Arc<AppState>, param: &'static str, f: F) -> Result<Vec<u32>, ApiError>
where
    F: FnOnce() -> Result<Vec<u32>, EncodeError> + Send + 'static,
{
    let ctx = state.info.context_size;
    match tokio::task::spawn_blocking(f).await {
        Ok(Ok(ids)) => Ok(ids),
        Ok(Err(EncodeError::TooLong { limit })) => {
            Err(ApiError::context_overflow_at_least(limit + 1, ctx).with_param(param))
        }
        Ok(Err(EncodeError::Failed(e))) => Err(ApiError::invalid(format!("could not tokenize the prompt: {e}"))),
        Err(_) => Err(ApiError::internal("tokenizing the prompt failed")),
    }
}

/// Seconds since the unix epoch.
pub fn now_unix() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// A JSON value that is either one string or a list of strings (OpenAI `stop`).
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(untagged)]
pub enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

impl OneOrMany {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            OneOrMany::One(s) => vec![s],
            OneOrMany::Many(v) => v,
        }
    }
}

/// Stop strings: at most 16, none empty.
pub fn stop_strings(param: &str, stop: Option<Vec<String>>) -> Result<Vec<String>, ApiError> {
    let stop = stop.unwrap_or_default();
    if stop.len() > 16 {
        return Err(ApiError::param(param, "at most 16 stop sequences are supported"));
    }
    if stop.iter().any(|s| s.is_empty()) {
        return Err(ApiError::param(param, "stop sequences must not be empty"));
    }
    Ok(stop)
}
