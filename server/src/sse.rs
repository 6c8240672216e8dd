//! Server-sent events: frame formatting and a channel-backed streaming body.
//!
//! A handler gets an [`SseSender`] and a response whose body is fed by it. `send` returns `false` once the client is
//! gone (hyper dropped the body): the writer must then stop, which drops its [`crate::generate::Generation`] and so
//! cancels the scheduler job. Frames: `event: NAME\ndata: JSON\n\n` (Anthropic, Responses), `data: JSON\n\n`
//! (OpenAI chat/completions), `: comment\n\n` (keep-alive; every SSE parser ignores it).

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use hyper::body::{Body, Frame};
use serde_json::Value;
use tokio::sync::mpsc;

/// `event: name` + `data: json` frame.
pub fn event(name: &str, data: &Value) -> Bytes {
    Bytes::from(format!("event: {name}\ndata: {data}\n\n"))
}

/// A bare `data:` frame.
pub fn data(data: &Value) -> Bytes {
    Bytes::from(format!("data: {data}\n\n"))
}

/// `data: [DONE]` (OpenAI's end marker).
pub fn done() -> Bytes {
    Bytes::from_static(b"data: [DONE]\n\n")
}

/// A comment frame (keep-alive).
pub fn comment(text: &str) -> Bytes {
    Bytes::from(format!(": {text}\n\n"))
}

/// Writes frames into a streaming response body.
#[derive(Clone)]
pub struct SseSender {
    tx: mpsc::Sender<Bytes>,
}

impl SseSender {
    /// Send one frame; `false` when the client has disconnected.
    pub async fn send(&self, frame: Bytes) -> bool {
        self.tx.send(frame).await.is_ok()
    }

    /// Resolves once the client has disconnected (the body was dropped), without writing anything.
    pub async fn closed(&self) {
        self.tx.closed().await
    }
}

/// The streaming body behind an [`SseSender`].
pub struct ChannelBody {
    rx: mpsc::Receiver<Bytes>,
}

/// A connected sender/body pair (the body ends when every sender is dropped).
pub fn channel() -> (SseSender, ChannelBody) {
    let (tx, rx) = mpsc::channel(64);
    (SseSender { tx }, ChannelBody { rx })
}

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.rx.poll_recv(cx).map(|o| o.map(|b| Ok(Frame::data(b))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    #[tokio::test]
    async fn frames_flow_and_a_dropped_body_is_noticed() {
        let (tx, body) = channel();
        assert!(tx.send(event("ping", &serde_json::json!({"type": "ping"}))).await);
        assert!(tx.send(done()).await);
        drop(tx);
        let all = body.collect().await.unwrap().to_bytes();
        assert_eq!(&all[..], b"event: ping\ndata: {\"type\":\"ping\"}\n\ndata: [DONE]\n\n");
        let (tx, body) = channel();
        drop(body);
        assert!(!tx.send(comment("keep-alive")).await);
    }
}
