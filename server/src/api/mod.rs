//! One module per wire API, plus what they share: JSON decoding with clear errors, model-name checks, sampling
//! parameter validation and the unix timestamp.
//!
//! Every API module turns its request into a [`crate::backend::Conversation`] (unknown fields are ignored, never
//! rejected), starts a [`crate::generate::Generation`] and answers either with one JSON object or with an SSE stream
//! written by a spawned task (which stops, cancelling the job, as soon as the client is gone).

pub mod anthropic;
pub mod content;
pub mod errors;
pub mod models;
pub mod openai_chat;
pub mod openai_completions;
pub mod responses;

use serde::de::DeserializeOwned;

use crate::backend::Conversation;
use crate::sampling::SamplingParams;
use crate::state::AppState;
use errors::ApiError;

/// Decode a JSON body into `T`; syntax and type errors become 400s naming the problem.
pub fn parse_json<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    if body.iter().all(|b| b.is_ascii_whitespace()) {
        return Err(ApiError::invalid("the request body is empty; expected a JSON object"));
    }
    serde_json::from_slice(body).map_err(|e| ApiError::bad_json(&e))
}

/// Validate sampling knobs (OpenAI ranges; `top_k` is an extension).
pub fn sampling(
    temperature: Option<f64>,
    top_p: Option<f64>,
    top_k: Option<u64>,
    seed: Option<u64>,
) -> Result<SamplingParams, ApiError> {
    let temperature = temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::param("temperature", format!("temperature must be between 0 and 2, got {temperature}")));
    }
    let top_p = top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::param("top_p", format!("top_p must be in (0, 1], got {top_p}")));
    }
    Ok(SamplingParams {
        temperature: temperature as f32,
        top_p: top_p as f32,
        top_k: top_k.unwrap_or(0).min(u32::MAX as u64) as usize,
        seed,
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

/// Tokenize text (a tokenizer failure is a 400 naming it).
pub fn tokenize(state: &AppState, text: &str) -> Result<Vec<u32>, ApiError> {
    state.codec.encode(text).map_err(|e| ApiError::invalid(format!("could not tokenize the prompt: {e}")))
}

/// Render a conversation and tokenize it.
pub fn prompt_tokens(state: &AppState, conv: &Conversation) -> Result<Vec<u32>, ApiError> {
    let prompt = state.codec.render(conv).map_err(|e| ApiError::invalid(format!("could not render the chat: {e}")))?;
    tokenize(state, &prompt)
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
