//! HTTP plumbing: the accept loop with graceful shutdown (connections tracked by [`crate::conn`]: timeouts, cap),
//! the [`crate::guard`] checks (Host, Origin/CORS, API key, body type), routing (on the path *without* its query
//! string, so `/v1/messages?beta=true` works; a missing `/v1` prefix is tolerated), body size limits (413) and the
//! body read timeout (408), per-endpoint request metrics. Response builders live in [`crate::response`] (re-exported here), so the API modules
//! do not depend on this one. Errors use the shape of the API the
//! path names ([`flavor_of`]), also for requests refused before routing.
//!
//! Shutdown: when the `shutdown` future resolves, the listener stops accepting, idle keep-alive connections close,
//! in-flight requests (streams included) run to completion up to `drain_timeout`, then [`serve`] returns.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::json;
use tokio::net::TcpListener;

use crate::api;
use crate::api::errors::ApiError;
use crate::conn::{self, GuardedBody, Tracker, Watched};
use crate::guard;
use crate::state::AppState;
use crate::{status, webui};

pub use crate::api::errors::flavor_of;
pub use crate::response::{error_response, json_response, sse_response, Body};

fn text_response(status: StatusCode, content_type: &'static str, text: String) -> Response<Body> {
    let mut r = Response::new(Full::new(Bytes::from(text)).boxed());
    *r.status_mut() = status;
    r.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    r
}

/// Read the whole body, refusing more than `limit` bytes.
pub async fn read_body(req: Request<Incoming>, limit: usize) -> Result<Bytes, ApiError> {
    let too_large = || ApiError::new(413, format!("request body is larger than the limit of {limit} bytes"));
    let declared = req.headers().get(hyper::header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(too_large());
    }
    match Limited::new(req.into_body(), limit).collect().await {
        Ok(c) => Ok(c.to_bytes()),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => Err(too_large()),
        Err(e) => Err(ApiError::invalid(format!("could not read the request body: {e}"))),
    }
}

/// Read and drop a body of at most `limit` bytes; `false` when it was larger or broken.
async fn discard_body(req: Request<Incoming>, limit: usize) -> bool {
    let mut body = req.into_body();
    let mut seen = 0usize;
    while let Some(frame) = body.frame().await {
        match frame {
            Ok(f) => {
                seen += f.data_ref().map_or(0, |d| d.len());
                if seen > limit {
                    return false;
                }
            }
            Err(_) => return false,
        }
    }
    true
}

/// Route one request: the [`crate::guard`] checks first, then the endpoint.
pub async fn handle(state: Arc<AppState>, req: Request<Incoming>) -> Response<Body> {
    let path = req.uri().path().to_string();
    let route = path.strip_prefix("/v1").filter(|p| p.starts_with('/')).unwrap_or(&path).trim_end_matches('/');
    let route = if route.is_empty() { "/" } else { route }.to_string();
    let flavor = flavor_of(&route);
    let method = req.method().clone();
    let passed = match state.limits.access.check(&method, &route, req.headers()) {
        Ok(p) => p,
        Err(e) => {
            state.metrics.request("refused", e.status);
            return error_response(&e, flavor);
        }
    };
    let (endpoint, result) = if method == Method::OPTIONS {
        let answer = state.limits.access.preflight(&passed, req.headers()).map(|headers| {
            let mut r = Response::new(Full::new(Bytes::new()).boxed());
            *r.status_mut() = StatusCode::NO_CONTENT;
            for (k, v) in headers {
                r.headers_mut().insert(k, v);
            }
            r
        });
        ("preflight", answer)
    } else if method == Method::POST && known_route(&route) {
        match guard::check_body_headers(req.headers()) {
            Ok(()) => route_request(&state, &route, &path, req).await,
            Err(e) => ("refused", Err(e)),
        }
    } else {
        route_request(&state, &route, &path, req).await
    };
    let mut response = result.unwrap_or_else(|e| {
        if e.status >= 500 {
            tracing::warn!(endpoint, status = e.status, error = %e.message, "request failed");
        }
        error_response(&e, flavor)
    });
    if let Some(origin) = passed.allow_origin.as_deref().and_then(|o| HeaderValue::from_str(o).ok()) {
        response.headers_mut().insert("access-control-allow-origin", origin);
        response.headers_mut().insert("vary", HeaderValue::from_static("origin"));
    }
    state.metrics.request(endpoint, response.status().as_u16());
    response
}

fn known_route(route: &str) -> bool {
    matches!(
        route,
        "/health"
            | "/metrics"
            | "/status"
            | "/models"
            | "/chat/completions"
            | "/completions"
            | "/messages"
            | "/messages/count_tokens"
            | "/responses"
            | "/tokenize"
            | "/detokenize"
    ) || route.starts_with("/models/")
}

async fn route_request(
    state: &Arc<AppState>,
    route: &str,
    path: &str,
    req: Request<Incoming>,
) -> (&'static str, Result<Response<Body>, ApiError>) {
    let method = req.method().clone();
    match (route, &method) {
        ("/health", &Method::GET) => ("health", Ok(json_response(200, &json!({"status": "ok"})))),
        ("/metrics", &Method::GET) => (
            "metrics",
            Ok(text_response(StatusCode::OK, "text/plain; version=0.0.4; charset=utf-8", state.metrics.render())),
        ),
        ("/status", &Method::GET) => ("status", Ok(json_response(200, &status::snapshot(state)))),
        ("/", &Method::GET) if state.limits.webui => ("webui", Ok(webui::page())),
        (p, &Method::GET) if state.limits.webui && p.starts_with("/webui/") => {
            ("webui", webui::asset(&p["/webui/".len()..]))
        }
        ("/models", &Method::GET) => ("models", Ok(api::models::list(state))),
        (p, &Method::GET) if p.starts_with("/models/") => ("models", api::models::get(state, &p["/models/".len()..])),
        ("/chat/completions", &Method::POST) => {
            ("chat_completions", with_body(state, req, api::openai_chat::handle).await)
        }
        ("/completions", &Method::POST) => {
            ("completions", with_body(state, req, api::openai_completions::handle).await)
        }
        ("/messages", &Method::POST) => ("messages", with_body(state, req, api::anthropic::handle).await),
        ("/messages/count_tokens", &Method::POST) => {
            ("count_tokens", with_body(state, req, api::anthropic::count_tokens).await)
        }
        ("/responses", &Method::POST) => ("responses", with_body(state, req, api::responses::handle).await),
        ("/tokenize", &Method::POST) => ("tokenize", with_body(state, req, api::tokenize::tokenize).await),
        ("/detokenize", &Method::POST) => ("detokenize", with_body(state, req, api::tokenize::detokenize).await),
        (p, _) if known_route(p) => {
            ("other", Err(ApiError::new(405, format!("method {method} is not allowed on {path}"))))
        }
        _ => ("other", Err(ApiError::not_found(format!("no such endpoint: {method} {path}")))),
    }
}

/// Read the body, then call `f(state, headers, body)`.
async fn with_body<F, Fut>(state: &Arc<AppState>, req: Request<Incoming>, f: F) -> Result<Response<Body>, ApiError>
where
    F: FnOnce(Arc<AppState>, hyper::HeaderMap, Bytes) -> Fut,
    Fut: Future<Output = Result<Response<Body>, ApiError>>,
{
    let headers = req.headers().clone();
    // Room in the shared request-memory budget first (the body is not read while waiting for it).
    let declared = headers.get(hyper::header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<usize>().ok());
    let size = declared.unwrap_or(state.limits.max_body_bytes).min(state.limits.max_body_bytes);
    let _reservation = match state.limits.request_memory.reserve(size).await {
        Ok(r) => r,
        Err(busy) => {
            let mut e = ApiError::new(503, "the server is busy: too many large requests are being read; retry later");
            e.retry_after = Some(busy.retry_after);
            // Read the body to its end without keeping it, so the client reads the answer (closing with its bytes
            // unread would reset the connection under it); a body that does not arrive in time closes it.
            let limit = state.limits.max_body_bytes;
            let timeout = state.limits.conn.body_timeout;
            e.close = !matches!(tokio::time::timeout(timeout, discard_body(req, limit)).await, Ok(true));
            return Err(e);
        }
    };
    let timeout = state.limits.conn.body_timeout;
    let body = match tokio::time::timeout(timeout, read_body(req, state.limits.max_body_bytes)).await {
        Ok(b) => b?,
        Err(_) => {
            state.metrics.connection_closed(crate::metrics::CloseReason::BodyTimeout);
            let mut e = ApiError::new(408, format!("the request body did not arrive within {} s", timeout.as_secs()));
            e.close = true;
            return Err(e);
        }
    };
    f(state.clone(), headers, body).await
}

/// Accept connections until `shutdown` resolves, then drain for at most `drain_timeout`. Connections are tracked
/// by [`crate::conn::Tracker`] (timeouts, cap, back-off when file descriptors run out).
pub async fn serve(
    listener: TcpListener,
    state: Arc<AppState>,
    shutdown: impl Future<Output = ()>,
    drain_timeout: Duration,
) {
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let tracker = Tracker::new(state.limits.conn, state.metrics.clone());
    let reaper = tokio::spawn(tracker.clone().run_reaper());
    let mut last_accept_warning: Option<std::time::Instant> = None;
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, peer) = match accepted {
                    Ok(x) => x,
                    Err(e) => {
                        let fds = conn::is_fd_exhaustion(&e);
                        if last_accept_warning.is_none_or(|t| t.elapsed() >= Duration::from_secs(5)) {
                            last_accept_warning = Some(std::time::Instant::now());
                            tracing::warn!(error = %e, open = tracker.len(), "accept failed{}",
                                if fds { "; closing the oldest idle connection and backing off" } else { "" });
                        }
                        if fds {
                            tracker.evict_oldest();
                        }
                        tokio::time::sleep(Duration::from_millis(if fds { 20 } else { 50 })).await;
                        continue;
                    }
                };
                let Some((id, conn_state)) = tracker.register() else {
                    drop(stream);
                    continue;
                };
                let _ = stream.set_nodelay(true);
                let state = state.clone();
                let cs = conn_state.clone();
                let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                    let state = state.clone();
                    let busy = cs.begin();
                    let (method, path) = (req.method().clone(), req.uri().path().to_string());
                    async move {
                        let r = crate::access_log::wrap(method, path, handle(state, req)).await;
                        Ok::<_, Infallible>(r.map(|b| GuardedBody::new(b, busy)))
                    }
                });
                let conn = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(Watched::new(stream, conn_state.clone())), service);
                let conn = graceful.watch(conn);
                let tracker = tracker.clone();
                tokio::spawn(async move {
                    tokio::select! {
                        r = conn => {
                            if let Err(e) = r {
                                tracing::debug!(%peer, error = %e, "connection ended with an error");
                            }
                        }
                        _ = conn_state.closed() => tracing::debug!(%peer, "connection closed by the server"),
                    }
                    tracker.remove(id);
                });
            }
            _ = &mut shutdown => break,
        }
    }
    drop(listener);
    tracing::info!(connections = graceful.count(), "shutting down: draining in-flight requests");
    if tokio::time::timeout(drain_timeout, graceful.shutdown()).await.is_err() {
        tracing::warn!("drain timeout: closing the remaining connections");
    }
    reaper.abort();
}
