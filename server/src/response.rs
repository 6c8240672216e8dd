//! Response builders shared by the API modules and the HTTP layer: the boxed [`Body`] every response has, JSON and
//! error responses, and the SSE response fed by an [`SseSender`]. A leaf module: it uses only [`crate::sse`] and the
//! error type ([`crate::api::errors`]), never the router.

use std::convert::Infallible;

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::header::{HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use hyper::{Response, StatusCode};
use serde_json::Value;

use crate::api::errors::{ApiError, Flavor};
use crate::sse::{self, SseSender};

/// Every response body.
pub type Body = BoxBody<Bytes, Infallible>;

/// A JSON response.
pub fn json_response(status: u16, value: &Value) -> Response<Body> {
    let mut r = Response::new(Full::new(Bytes::from(value.to_string())).boxed());
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    r.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

/// An error response in `flavor`'s shape.
pub fn error_response(err: &ApiError, flavor: Flavor) -> Response<Body> {
    let mut r = json_response(err.status, &err.body(flavor));
    if let Some(s) = err.retry_after {
        r.headers_mut().insert(RETRY_AFTER, HeaderValue::from(s));
    }
    if err.close {
        r.headers_mut().insert(hyper::header::CONNECTION, HeaderValue::from_static("close"));
    }
    r
}

/// A streaming `text/event-stream` response and the sender that feeds it.
pub fn sse_response() -> (SseSender, Response<Body>) {
    let (tx, body) = sse::channel();
    let mut r = Response::new(body.boxed());
    let h = r.headers_mut();
    h.insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    h.insert("cache-control", HeaderValue::from_static("no-cache"));
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    (tx, r)
}
