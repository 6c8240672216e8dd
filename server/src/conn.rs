//! Connection bookkeeping for the accept loop: timeouts for idle and slow connections and a cap on open ones.
//!
//! Every accepted connection is registered in a [`Tracker`] with a phase:
//! - **idle** — no request in progress (just connected, or between keep-alive requests); closed after
//!   `idle_timeout`;
//! - **head** — bytes of a request arrived but its head is not complete yet; closed `header_timeout` after the first
//!   byte (slowloris);
//! - **busy** — a request is being answered (from the complete head until its response body has been sent, streams
//!   included); never closed by the tracker. Reading the request body is bounded separately (`body_timeout`, in
//!   [`crate::http`]).
//!
//! A reaper task checks the phases a few times per timeout. At `max_connections` the accept loop still accepts, and
//! makes room by closing the oldest connection that is not busy (so a flood of idle sockets cannot lock out
//! `/health`); when every connection is busy the new one is closed at once. When `accept` fails for lack of file
//! descriptors, the loop closes the oldest non-busy connection and backs off for a moment instead of spinning.
//!
//! Invariant: a connection is in the table exactly while its task runs; closing is a [`Notify`] the task selects on,
//! so the socket is dropped by its own task.

use std::collections::BTreeMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::Notify;

use crate::metrics::{CloseReason, Metrics};

const IDLE: u8 = 0;
const HEAD: u8 = 1;
const BUSY: u8 = 2;

/// Timeouts and the connection cap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnLimits {
    /// Open connections at most (the oldest non-busy one is closed to make room).
    pub max_connections: usize,
    /// From the first byte of a request to the end of its head.
    pub header_timeout: Duration,
    /// A connection with no request in progress.
    pub idle_timeout: Duration,
    /// Reading a whole request body.
    pub body_timeout: Duration,
}

impl Default for ConnLimits {
    fn default() -> Self {
        ConnLimits {
            max_connections: 1024,
            header_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            body_timeout: Duration::from_secs(60),
        }
    }
}

/// One connection's state (shared by its task, its I/O wrapper, its busy guards and the reaper).
pub struct Conn {
    phase: AtomicU8,
    /// Milliseconds since the tracker's epoch when the phase began.
    since_ms: AtomicU64,
    in_flight: AtomicUsize,
    /// Requests handed to the service so far.
    requests: AtomicU64,
    close: Notify,
    epoch: Instant,
}

impl Conn {
    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// A request head is complete: the connection is busy until the returned guard (and any other) is dropped.
    pub fn begin(self: &Arc<Self>) -> BusyGuard {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        self.requests.fetch_add(1, Ordering::AcqRel);
        self.phase.store(BUSY, Ordering::Release);
        BusyGuard(self.clone())
    }

    /// Resolves when the tracker wants this connection closed.
    pub async fn closed(&self) {
        self.close.notified().await
    }

    fn saw_bytes(&self) {
        if self.in_flight.load(Ordering::Acquire) == 0
            && self.phase.compare_exchange(IDLE, HEAD, Ordering::AcqRel, Ordering::Acquire).is_ok()
        {
            self.since_ms.store(self.now_ms(), Ordering::Release);
        }
    }
}

/// Keeps its connection busy while alive (held by the response body).
pub struct BusyGuard(Arc<Conn>);

impl Drop for BusyGuard {
    fn drop(&mut self) {
        if self.0.in_flight.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.since_ms.store(self.0.now_ms(), Ordering::Release);
            self.0.phase.store(IDLE, Ordering::Release);
        }
    }
}

/// The table of open connections.
pub struct Tracker {
    limits: ConnLimits,
    conns: Mutex<BTreeMap<u64, Arc<Conn>>>,
    next: AtomicU64,
    epoch: Instant,
    metrics: Arc<Metrics>,
}

impl Tracker {
    pub fn new(limits: ConnLimits, metrics: Arc<Metrics>) -> Arc<Self> {
        Arc::new(Tracker {
            limits,
            conns: Mutex::new(BTreeMap::new()),
            next: AtomicU64::new(0),
            epoch: Instant::now(),
            metrics,
        })
    }

    /// Open connections.
    pub fn len(&self) -> usize {
        self.conns.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Registers a new connection, making room first when the cap is reached. `None`: every connection is busy
    /// and the new one must be closed.
    pub fn register(&self) -> Option<(u64, Arc<Conn>)> {
        if self.len() >= self.limits.max_connections.max(1) && !self.evict_oldest() {
            self.metrics.connection_closed(CloseReason::Rejected);
            return None;
        }
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let conn = Arc::new(Conn {
            phase: AtomicU8::new(IDLE),
            since_ms: AtomicU64::new(self.epoch.elapsed().as_millis() as u64),
            in_flight: AtomicUsize::new(0),
            requests: AtomicU64::new(0),
            close: Notify::new(),
            epoch: self.epoch,
        });
        let mut g = self.conns.lock();
        g.insert(id, conn.clone());
        self.metrics.connections_open.store(g.len() as u64, Ordering::Relaxed);
        Some((id, conn))
    }

    /// The connection's task ended.
    pub fn remove(&self, id: u64) {
        let mut g = self.conns.lock();
        g.remove(&id);
        self.metrics.connections_open.store(g.len() as u64, Ordering::Relaxed);
    }

    /// Asks the oldest non-busy connection to close; false when all are busy.
    pub fn evict_oldest(&self) -> bool {
        let g = self.conns.lock();
        let victim = g.values().find(|c| c.phase.load(Ordering::Acquire) != BUSY);
        match victim {
            Some(c) => {
                c.close.notify_one();
                // Mark it busy so a second eviction picks another one before this task has run.
                c.phase.store(BUSY, Ordering::Release);
                self.metrics.connection_closed(CloseReason::Evicted);
                true
            }
            None => false,
        }
    }

    /// One reaper pass: closes idle and slow-head connections past their timeouts.
    pub fn reap(&self) {
        let now = self.epoch.elapsed().as_millis() as u64;
        let idle = self.limits.idle_timeout.as_millis() as u64;
        let head = self.limits.header_timeout.as_millis() as u64;
        let g = self.conns.lock();
        for c in g.values() {
            let age = now.saturating_sub(c.since_ms.load(Ordering::Acquire));
            let reason = match c.phase.load(Ordering::Acquire) {
                IDLE if age >= idle => CloseReason::IdleTimeout,
                HEAD if age >= head => CloseReason::HeaderTimeout,
                _ => continue,
            };
            c.close.notify_one();
            c.phase.store(BUSY, Ordering::Release);
            self.metrics.connection_closed(reason);
        }
    }

    /// Runs [`Tracker::reap`] a few times per timeout, forever.
    pub async fn run_reaper(self: Arc<Self>) {
        let shortest = self.limits.idle_timeout.min(self.limits.header_timeout);
        let every = (shortest / 4).clamp(Duration::from_millis(50), Duration::from_secs(1));
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            self.reap();
        }
    }
}

/// An I/O stream that tells its [`Conn`] when request bytes arrive, and replaces the empty-bodied error responses
/// hyper writes by itself (a request it could not parse: bad framing 400, 414, 431) with the API's JSON error.
///
/// hyper answers such a request without calling the service, so a response head written when every request handed to
/// the service already has its head out must be one of those; its status is kept, the body becomes
/// [`crate::api::errors::ApiError`]'s JSON in the shape of the API the request line's path names.
pub struct Watched<T> {
    inner: T,
    conn: Arc<Conn>,
    /// Response heads written so far.
    heads: u64,
    /// The first bytes of the request being read (for its path).
    head: Vec<u8>,
    /// A replacement response still to be written.
    pending: Vec<u8>,
    /// The rest of hyper's own error response is being discarded.
    swallowing: bool,
}

const HEAD_KEEP: usize = 512;

impl<T> Watched<T> {
    pub fn new(inner: T, conn: Arc<Conn>) -> Self {
        Watched { inner, conn, heads: 0, head: Vec::new(), pending: Vec::new(), swallowing: false }
    }
}

/// The JSON error response replacing hyper's own `status` answer to the request starting with `head`.
pub fn replacement_response(status: u16, head: &[u8]) -> Vec<u8> {
    let line = head.split(|&b| b == b'\r' || b == b'\n').next().unwrap_or(b"");
    let path = line.split(|&b| b == b' ').nth(1).unwrap_or(b"/");
    let path = String::from_utf8_lossy(path);
    let path = path.split('?').next().unwrap_or("/");
    let route = path.strip_prefix("/v1").filter(|p| p.starts_with('/')).unwrap_or(path);
    let flavor = crate::api::errors::flavor_of(route);
    let message = match status {
        414 => "the request URI is too long".to_string(),
        431 => "the request headers are too large".to_string(),
        400 => "malformed HTTP request (bad request line, header or body framing)".to_string(),
        505 => "unsupported HTTP version".to_string(),
        s => format!("the HTTP request could not be processed ({s})"),
    };
    let body = crate::api::errors::ApiError::new(status, message).body(flavor).to_string();
    let reason = hyper::StatusCode::from_u16(status).ok().and_then(|s| s.canonical_reason()).unwrap_or("Error");
    format!(
        "HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

impl<T: AsyncRead + Unpin> AsyncRead for Watched<T> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.conn.saw_bytes();
            if self.conn.in_flight.load(Ordering::Acquire) == 0 && self.head.len() < HEAD_KEEP {
                let take = (HEAD_KEEP - self.head.len()).min(buf.filled().len() - before);
                let new = buf.filled()[before..before + take].to_vec();
                self.head.extend_from_slice(&new);
            }
        }
        r
    }
}

impl<T: AsyncWrite + Unpin> Watched<T> {
    /// Writes what is pending; `Ready(Ok)` once nothing is.
    fn drain_pending(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        while !self.pending.is_empty() {
            match Pin::new(&mut self.inner).poll_write(cx, &self.pending) {
                Poll::Ready(Ok(0)) => return Poll::Ready(Err(std::io::ErrorKind::WriteZero.into())),
                Poll::Ready(Ok(n)) => {
                    self.pending.drain(..n);
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            }
        }
        Poll::Ready(Ok(()))
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Watched<T> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        // A response head (informational `1xx` ones, e.g. `100 Continue`, precede the real head and do not count).
        if buf.starts_with(b"HTTP/1.") && buf.get(9) != Some(&b'1') {
            let answered = self.heads;
            self.heads += 1;
            if answered >= self.conn.requests.load(Ordering::Acquire) {
                let status = std::str::from_utf8(buf.get(9..12).unwrap_or(b"400")).ok().and_then(|s| s.parse().ok());
                self.pending = replacement_response(status.unwrap_or(400), &self.head);
                self.swallowing = true;
            } else {
                self.swallowing = false;
                self.head.clear();
            }
        }
        if self.swallowing {
            return match self.drain_pending(cx) {
                Poll::Ready(Ok(())) | Poll::Pending => Poll::Ready(Ok(buf.len())),
                Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            };
        }
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        std::task::ready!(self.drain_pending(cx))?;
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        std::task::ready!(self.drain_pending(cx))?;
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Whether an `accept` error means the process (or system) ran out of file descriptors.
pub fn is_fd_exhaustion(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(code) if code == libc::EMFILE || code == libc::ENFILE)
}

/// Raises the soft open-file limit to the hard one (Unix) and returns the soft limit now in force.
pub fn raise_fd_limit() -> Option<u64> {
    #[cfg(unix)]
    {
        let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: `lim` is a valid, writable rlimit struct for the duration of the call.
        if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
            return None;
        }
        if lim.rlim_cur < lim.rlim_max {
            let want = libc::rlimit { rlim_cur: lim.rlim_max, rlim_max: lim.rlim_max };
            // SAFETY: `want` is a valid rlimit struct; setrlimit only reads it.
            if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &want) } == 0 {
                lim.rlim_cur = lim.rlim_max;
            }
        }
        #[allow(clippy::unnecessary_cast)]
        Some(lim.rlim_cur as u64)
    }
    #[cfg(not(unix))]
    {
        None
    }
}

/// The response body of a request, holding its connection busy until the body is done or dropped.
pub struct GuardedBody<B> {
    inner: B,
    _busy: BusyGuard,
}

impl<B> GuardedBody<B> {
    pub fn new(inner: B, busy: BusyGuard) -> Self {
        GuardedBody { inner, _busy: busy }
    }
}

impl<B: hyper::body::Body + Unpin> hyper::body::Body for GuardedBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}
