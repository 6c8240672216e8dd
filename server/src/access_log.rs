//! The access log: one `INFO` line per request (target `ds4_server::access`), written when its response has been
//! sent — for a stream, when the stream ends or the client goes away.
//!
//! Fields: `method`, `path` (without the query), `status`, `prompt_tokens`, `cached_tokens`, `output_tokens`,
//! `reasoning_tokens` (0 for requests that generate nothing), `ttfb_ms` (until the first body bytes went out),
//! `total_ms`, and `complete` (false when the client left before the end). Never any request or response text.
//!
//! How usage gets here: [`wrap`] runs the handler inside a task-local [`Stats`] slot; a
//! [`crate::generate::Generation`] started by the handler takes the slot ([`current`]) and keeps it up to date, also
//! from the spawned task that writes a stream. The line is written by the response body wrapper, so it sees the final
//! usage of a stream.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Body as HttpBody, Frame, SizeHint};
use hyper::{Method, Response};

use crate::generate::Usage;
use crate::response::Body;

tokio::task_local! {
    static STATS: Arc<Stats>;
}

/// What a request's generation reports to the access log.
#[derive(Debug, Default)]
pub struct Stats {
    usage: Mutex<Usage>,
}

impl Stats {
    /// The usage so far (the last call wins).
    pub fn set_usage(&self, u: Usage) {
        if let Ok(mut g) = self.usage.lock() {
            *g = u;
        }
    }

    fn usage(&self) -> Usage {
        self.usage.lock().map(|g| *g).unwrap_or_default()
    }
}

/// The current request's slot, when called (directly or not) from a handler run by [`wrap`].
pub fn current() -> Option<Arc<Stats>> {
    STATS.try_with(Arc::clone).ok()
}

/// Runs `handler` for one request; its response body logs the request's line when it ends or is dropped.
pub async fn wrap(method: Method, path: String, handler: impl Future<Output = Response<Body>>) -> Response<Body> {
    let start = Instant::now();
    let stats = Arc::new(Stats::default());
    let response = STATS.scope(stats.clone(), handler).await;
    let status = response.status().as_u16();
    response.map(|inner| {
        LoggedBody { inner, entry: Some(Entry { method, path, status, start, first_byte: None, stats }) }.boxed()
    })
}

struct Entry {
    method: Method,
    path: String,
    status: u16,
    start: Instant,
    first_byte: Option<Instant>,
    stats: Arc<Stats>,
}

impl Entry {
    fn log(self, complete: bool) {
        let u = self.stats.usage();
        let ms = |t: Instant| t.duration_since(self.start).as_millis() as u64;
        let now = Instant::now();
        tracing::info!(
            target: "ds4_server::access",
            method = %self.method,
            path = %self.path,
            status = self.status,
            prompt_tokens = u.prompt_tokens,
            cached_tokens = u.cached_tokens,
            output_tokens = u.completion_tokens,
            reasoning_tokens = u.reasoning_tokens,
            ttfb_ms = ms(self.first_byte.unwrap_or(now)),
            total_ms = ms(now),
            complete,
            "request"
        );
    }
}

/// A response body that writes the access-log line at its end.
struct LoggedBody {
    inner: Body,
    entry: Option<Entry>,
}

impl HttpBody for LoggedBody {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(_)) => {
                if let Some(e) = self.entry.as_mut() {
                    e.first_byte.get_or_insert_with(Instant::now);
                }
            }
            Poll::Ready(None) => {
                if let Some(e) = self.entry.take() {
                    e.log(true);
                }
            }
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for LoggedBody {
    fn drop(&mut self) {
        if let Some(e) = self.entry.take() {
            // A full body whose last frame was sent ends without a final poll; it is complete when it says so.
            let complete = self.inner.is_end_stream();
            e.log(complete);
        }
    }
}
