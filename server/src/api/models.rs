//! `GET /v1/models`, `GET /v1/models/{id}` and the model-name policy for requests.
//!
//! Policy: one model is served. A request may name it by its id, by a DeepSeek alias (`deepseek-v4-flash`,
//! `deepseek-chat`, `deepseek-reasoner`, any `deepseek-v4*`), or by a name an agent sends by default when the user
//! did not configure one (`claude-*`: Claude Code without `--model`; `gpt-*`, `o1*`/`o3*`/`o4*`, `codex-*`: Codex).
//! Everything else is 404 `model_not_found`. A missing model field means the served model. Responses echo the name
//! the client sent.

use serde_json::json;

use crate::api::errors::ApiError;
use crate::response::{json_response, Body};
use crate::state::AppState;
use hyper::Response;

/// Whether `name` selects the served model.
pub fn accepts(state: &AppState, name: &str) -> bool {
    let n = name.to_ascii_lowercase();
    n == state.info.id.to_ascii_lowercase()
        || n.starts_with("deepseek-v4")
        || n == "deepseek-chat"
        || n == "deepseek-reasoner"
        || ["claude-", "gpt-", "o1", "o3", "o4", "codex-"].iter().any(|p| n.starts_with(p))
}

/// Check the request's model field; returns the name to echo.
pub fn check(state: &AppState, model: Option<&str>) -> Result<String, ApiError> {
    match model {
        None | Some("") => Ok(state.info.id.clone()),
        Some(m) if accepts(state, m) => Ok(m.to_string()),
        Some(m) => Err(ApiError::model_not_found(format!(
            "the model `{m}` does not exist; this server serves `{}`",
            state.info.id
        ))),
    }
}

fn model_object(state: &AppState, id: &str) -> serde_json::Value {
    json!({
        "id": id,
        "object": "model",
        "created": 0,
        "owned_by": "ds4",
        "type": "model",
        "display_name": if state.info.demo { "ds4 built-in demo model" } else { "DeepSeek V4 Flash" },
        "context_length": state.info.context_size,
        "demo": state.info.demo,
    })
}

/// `GET /v1/models`.
pub fn list(state: &AppState) -> Response<Body> {
    let data = vec![model_object(state, &state.info.id)];
    json_response(200, &json!({"object": "list", "data": data, "has_more": false}))
}

/// `GET /v1/models/{id}`.
pub fn get(state: &AppState, id: &str) -> Result<Response<Body>, ApiError> {
    if id == state.info.id || accepts(state, id) {
        Ok(json_response(200, &model_object(state, id)))
    } else {
        Err(ApiError::model_not_found(format!("the model `{id}` does not exist")))
    }
}
