//! One error type for every API, rendered in each API's JSON error shape.
//!
//! OpenAI (chat, completions, responses, models): `{"error":{"message","type","param","code"}}`.
//! Anthropic: `{"type":"error","error":{"type","message"}}`.
//! `Retry-After` is set on 503 (queue full). Messages are written for the client's user and never contain a Rust
//! debug dump.

use serde_json::{json, Value};

/// The error shape of a route: Anthropic for `/messages…`, OpenAI otherwise.
pub fn flavor_of(route: &str) -> Flavor {
    if route.starts_with("/messages") {
        Flavor::Anthropic
    } else {
        Flavor::OpenAi
    }
}

/// Which JSON error shape to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavor {
    OpenAi,
    Anthropic,
}

/// An HTTP error answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
    pub param: Option<String>,
    /// Seconds, for 503.
    pub retry_after: Option<u64>,
    /// OpenAI `code` (`model_not_found`, `context_length_exceeded`, …); `None` renders as `null`.
    pub code: Option<&'static str>,
    /// Answer with `connection: close` (the request was not read to its end).
    pub close: bool,
}

impl ApiError {
    pub fn new(status: u16, message: impl Into<String>) -> Self {
        ApiError { status, message: message.into(), param: None, retry_after: None, code: None, close: false }
    }

    /// 400 invalid request.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(400, message)
    }

    /// 400 about one parameter.
    pub fn param(param: &str, message: impl Into<String>) -> Self {
        ApiError { param: Some(param.to_string()), ..Self::new(400, message) }
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(404, message)
    }

    /// 404 for a model name this server does not serve (OpenAI code `model_not_found`).
    pub fn model_not_found(message: impl Into<String>) -> Self {
        ApiError { code: Some("model_not_found"), ..Self::new(404, message) }
    }

    /// 401: the API key is missing or wrong.
    pub fn unauthorized(message: impl Into<String>) -> Self {
        ApiError { code: Some("invalid_api_key"), ..Self::new(401, message) }
    }

    /// The same error about another parameter.
    pub fn with_param(mut self, param: &str) -> Self {
        self.param = Some(param.to_string());
        self
    }

    pub fn overloaded(retry_after: u64) -> Self {
        ApiError { retry_after: Some(retry_after), ..Self::new(503, "the server is busy: request queue is full") }
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(500, message)
    }

    /// The prompt does not fit the context.
    pub fn context_overflow(prompt_tokens: usize, context: usize) -> Self {
        ApiError {
            param: Some("messages".into()),
            ..Self::new(
                400,
                format!(
                    "this model's maximum context length is {context} tokens, but the prompt is {prompt_tokens} \
                     tokens (context_length_exceeded); shorten the conversation"
                ),
            )
        }
    }

    /// The prompt has at least `at_least` tokens (counting stopped there) and does not fit the context.
    pub fn context_overflow_at_least(at_least: usize, context: usize) -> Self {
        ApiError {
            param: Some("messages".into()),
            ..Self::new(
                400,
                format!(
                    "this model's maximum context length is {context} tokens, but the prompt is more than {} \
                     tokens (context_length_exceeded); shorten the conversation",
                    at_least - 1
                ),
            )
        }
    }

    /// A JSON body that did not deserialize.
    pub fn bad_json(e: &serde_json::Error) -> Self {
        Self::invalid(format!("invalid request body: {e}"))
    }

    fn openai_type(&self) -> &'static str {
        match self.status {
            401 => "authentication_error",
            403 => "permission_error",
            429 => "rate_limit_error",
            400..=499 => "invalid_request_error",
            _ => "server_error",
        }
    }

    fn anthropic_type(&self) -> &'static str {
        match self.status {
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            413 => "request_too_large",
            429 => "rate_limit_error",
            503 => "overloaded_error",
            400..=499 => "invalid_request_error",
            _ => "api_error",
        }
    }

    /// The JSON body in `flavor`'s shape.
    pub fn body(&self, flavor: Flavor) -> Value {
        match flavor {
            Flavor::OpenAi => {
                let code = match self.code {
                    Some(c) => Some(c),
                    None if self.message.contains("context_length_exceeded") => Some("context_length_exceeded"),
                    None => None,
                };
                json!({"error": {"message": self.message, "type": self.openai_type(), "param": self.param,
                    "code": code}})
            }
            Flavor::Anthropic => {
                json!({"type": "error", "error": {"type": self.anthropic_type(), "message": self.message}})
            }
        }
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status, self.message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes() {
        let e = ApiError::context_overflow(5000, 4096);
        let b = e.body(Flavor::OpenAi);
        assert_eq!(b["error"]["code"], "context_length_exceeded");
        assert!(b["error"]["message"].as_str().unwrap().contains("5000"));
        let b = ApiError::overloaded(1).body(Flavor::Anthropic);
        assert_eq!(b["type"], "error");
        assert_eq!(b["error"]["type"], "overloaded_error");
    }

    #[test]
    fn client_errors_are_not_server_errors() {
        for status in [400, 404, 405, 408, 411, 413, 414, 415, 431] {
            let e = ApiError::new(status, "x");
            assert_eq!(e.body(Flavor::OpenAi)["error"]["type"], "invalid_request_error", "{status}");
            assert_ne!(e.body(Flavor::Anthropic)["error"]["type"], "api_error", "{status}");
        }
        assert_eq!(ApiError::not_found("no such endpoint").body(Flavor::OpenAi)["error"]["code"], Value::Null);
        assert_eq!(ApiError::model_not_found("m").body(Flavor::OpenAi)["error"]["code"], "model_not_found");
        let e = ApiError::unauthorized("k");
        assert_eq!(e.body(Flavor::OpenAi)["error"]["type"], "authentication_error");
        assert_eq!(e.body(Flavor::Anthropic)["error"]["type"], "authentication_error");
    }
}
