//! How a listener keeps its connections within bounds (`[server.connections]`): a cap on the
//! connections it holds, in all and per peer; a deadline for a new connection's first bytes
//! (the HTTP/2 preface, or a TLS ClientHello); and accept loops that back off, instead of
//! spinning, when the process is out of file descriptors or memory. Refusals, timeouts and
//! accept failures are counted and logged at most every [`LOG_EVERY`].
//!
//! [`Cap::admit`] hands out a [`Permit`] per connection; [`Limited`] carries it (with the
//! deadline) for as long as tonic holds the connection, so the count is exact however the
//! connection ends. kvtierd's and kvtier-agent's Unix listeners get theirs through
//! [`crate::peers::PeerGate`]; kvtierd's TCP listener through [`tcp_incoming`]; the metrics
//! endpoints through [`crate::prometheus_http::serve`]. Every process fits its limits to its
//! open-file limit at start ([`fit_to_descriptors`]), each listener an equal share.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::future::Future as _;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::{Duration, Instant};

use futures::Stream;
use kvtier_config::connections::ConnectionLimits;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Sleep;

use crate::doors::Listener;
use crate::metrics::MetricRegistry;

/// The shortest interval between two log lines of one kind of refusal.
pub const LOG_EVERY: Duration = Duration::from_secs(10);
/// Bytes a new connection must send before the handshake deadline: the HTTP/2 preface's
/// length (a TLS ClientHello is longer).
pub const HANDSHAKE_BYTES: usize = 24;
/// The longest wait between accepts while the process is out of descriptors.
const MAX_BACKOFF: Duration = Duration::from_secs(1);

/// Lets a repeated log line through at most once per period, and counts the rest.
#[derive(Debug)]
pub struct Throttle {
    every: Duration,
    state: Mutex<(Option<Instant>, u64)>,
}

impl Throttle {
    /// At most one line per `every`.
    pub const fn new(every: Duration) -> Self {
        Self {
            every,
            state: Mutex::new((None, 0)),
        }
    }

    /// `Some(lines suppressed since the last one)` when a line may be logged now.
    pub fn allow(&self) -> Option<u64> {
        let mut s = self.state.lock();
        let now = Instant::now();
        if s.0
            .is_some_and(|last| now.duration_since(last) < self.every)
        {
            s.1 += 1;
            return None;
        }
        let suppressed = std::mem::take(&mut s.1);
        s.0 = Some(now);
        Some(suppressed)
    }
}

/// Whether an accept failed because the process or system is out of descriptors or memory:
/// retrying at once fails again (the listener stays readable), so the loop must wait.
pub fn is_exhaustion(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
    )
}

/// The series of every listener's connections, declared once per process.
#[derive(Clone, Debug)]
pub struct ConnMetrics {
    refused: prometheus::IntCounterVec,
    timeouts: prometheus::IntCounterVec,
    accept_errors: prometheus::IntCounterVec,
    open: prometheus::IntGaugeVec,
}

impl ConnMetrics {
    /// Declares the series in `metrics`.
    pub fn new(metrics: &MetricRegistry) -> prometheus::Result<Self> {
        Ok(Self {
            refused: metrics.counter_vec(
                "kvtier_server_refused_connections_total",
                "connections closed at accept because the listener holds server.connections.max (limit) or the peer server.connections.per_peer (peer_limit)",
                &["socket", "reason"],
            )?,
            timeouts: metrics.counter_vec(
                "kvtier_server_connection_timeouts_total",
                "connections closed because they sent too little within server.connections.handshake_timeout",
                &["socket"],
            )?,
            accept_errors: metrics.counter_vec(
                "kvtier_server_accept_errors_total",
                "accepts that failed for want of file descriptors or memory; the listener waits (up to 1 s) before the next",
                &["socket"],
            )?,
            open: metrics.gauge_vec(
                "kvtier_server_connections",
                "connections a listener holds open",
                &["socket"],
            )?,
        })
    }
}

/// One listener's connection cap.
#[derive(Clone, Debug)]
pub struct Cap {
    total: Arc<Semaphore>,
    peers: Arc<Mutex<HashMap<u64, u32>>>,
    limits: ConnectionLimits,
    socket: &'static str,
    metrics: ConnMetrics,
    refusals: Arc<Throttle>,
    timeouts: Arc<Throttle>,
}

impl Cap {
    /// The cap of `listener` (its row in the doors table names it in logs and labels).
    pub fn new(limits: &ConnectionLimits, listener: Listener, metrics: &ConnMetrics) -> Self {
        let socket = listener.door().name;
        for reason in ["limit", "peer_limit"] {
            metrics.refused.with_label_values(&[socket, reason]);
        }
        metrics.timeouts.with_label_values(&[socket]);
        metrics.accept_errors.with_label_values(&[socket]);
        metrics.open.with_label_values(&[socket]);
        Self {
            total: Arc::new(Semaphore::new(limits.max as usize)),
            peers: Arc::new(Mutex::new(HashMap::new())),
            limits: limits.clone(),
            socket,
            metrics: metrics.clone(),
            refusals: Arc::new(Throttle::new(LOG_EVERY)),
            timeouts: Arc::new(Throttle::new(LOG_EVERY)),
        }
    }

    /// The time a new connection has for its first bytes.
    pub fn handshake_timeout(&self) -> Duration {
        self.limits.handshake_timeout.0
    }

    /// A permit for one more connection from `peer` (a uid, or a hash of an IP address), or
    /// `None` (counted, logged at most every [`LOG_EVERY`]) when the listener or the peer
    /// is at its limit: the caller closes the connection.
    pub fn admit(&self, peer: u64) -> Option<Permit> {
        let refuse = |reason: &'static str| {
            self.metrics
                .refused
                .with_label_values(&[self.socket, reason])
                .inc();
            if let Some(more) = self.refusals.allow() {
                tracing::warn!(
                    socket = self.socket,
                    reason,
                    max = self.limits.max,
                    per_peer = self.limits.per_peer,
                    suppressed = more,
                    "refused a connection: server.connections is reached"
                );
            }
            None
        };
        let Ok(total) = self.total.clone().try_acquire_owned() else {
            return refuse("limit");
        };
        {
            let mut peers = self.peers.lock();
            let n = peers.entry(peer).or_insert(0);
            if *n >= self.limits.per_peer {
                drop(peers);
                return refuse("peer_limit");
            }
            *n += 1;
        }
        let open = self.metrics.open.with_label_values(&[self.socket]);
        open.inc();
        Some(Permit {
            _total: total,
            peer,
            peers: self.peers.clone(),
            open,
        })
    }

    /// `io` under its permit, closed if it has not sent [`HANDSHAKE_BYTES`] within the
    /// handshake timeout.
    pub fn limit<IO>(&self, io: IO, permit: Permit) -> Limited<IO> {
        Limited {
            io,
            _permit: permit,
            pending: Some((
                HANDSHAKE_BYTES,
                Box::pin(tokio::time::sleep(self.handshake_timeout())),
            )),
            socket: self.socket,
            timeouts: self.metrics.timeouts.with_label_values(&[self.socket]),
            throttle: self.timeouts.clone(),
        }
    }

    /// Waits after a failed accept: for descriptor or memory exhaustion 10 ms, doubling up
    /// to a second while it lasts (`backoff` carries the wait between calls); counted, and
    /// logged at most every [`LOG_EVERY`].
    pub async fn accept_failed(&self, e: &io::Error, backoff: &mut Duration) {
        if !is_exhaustion(e) {
            tracing::debug!(socket = self.socket, "accept failed: {e}");
            return;
        }
        self.metrics
            .accept_errors
            .with_label_values(&[self.socket])
            .inc();
        *backoff = (*backoff * 2).clamp(Duration::from_millis(10), MAX_BACKOFF);
        if let Some(more) = self.refusals.allow() {
            tracing::warn!(
                socket = self.socket,
                wait = ?*backoff,
                suppressed = more,
                "cannot accept connections: {e}; waiting before the next try"
            );
        }
        tokio::time::sleep(*backoff).await;
    }
}

/// One admitted connection's place under its listener's cap; given back on drop.
#[derive(Debug)]
pub struct Permit {
    _total: OwnedSemaphorePermit,
    peer: u64,
    peers: Arc<Mutex<HashMap<u64, u32>>>,
    open: prometheus::IntGauge,
}

impl Drop for Permit {
    fn drop(&mut self) {
        let mut peers = self.peers.lock();
        if let Some(n) = peers.get_mut(&self.peer) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                peers.remove(&self.peer);
            }
        }
        self.open.dec();
    }
}

/// A connection under its permit and its handshake deadline: reads fail with `TimedOut`
/// once the deadline passes before the first [`HANDSHAKE_BYTES`] arrived.
#[derive(Debug)]
pub struct Limited<IO> {
    io: IO,
    _permit: Permit,
    /// Bytes still expected before the deadline, and the deadline.
    pending: Option<(usize, Pin<Box<Sleep>>)>,
    socket: &'static str,
    timeouts: prometheus::IntCounter,
    throttle: Arc<Throttle>,
}

impl<IO> Limited<IO> {
    /// The connection itself.
    pub fn get_ref(&self) -> &IO {
        &self.io
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for Limited<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if let Some((_, deadline)) = &mut this.pending
            && deadline.as_mut().poll(cx).is_ready()
        {
            this.pending = None;
            this.timeouts.inc();
            if let Some(more) = this.throttle.allow() {
                tracing::warn!(
                    socket = this.socket,
                    suppressed = more,
                    "closed a connection that stayed silent past server.connections.handshake_timeout"
                );
            }
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "no handshake within server.connections.handshake_timeout",
            )));
        }
        let before = buf.filled().len();
        ready!(Pin::new(&mut this.io).poll_read(cx, buf))?;
        let got = buf.filled().len() - before;
        if let Some((need, _)) = &mut this.pending {
            *need = need.saturating_sub(got);
            if *need == 0 || got == 0 {
                this.pending = None;
            }
        }
        Poll::Ready(Ok(()))
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Limited<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

impl<IO: tonic::transport::server::Connected> tonic::transport::server::Connected for Limited<IO> {
    type ConnectInfo = IO::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

/// Descriptors kept out of the listeners' share at [`fit_to_descriptors`]: the process's own
/// files, pools, sockets and runtime.
pub const RESERVED_DESCRIPTORS: u64 = 64;

/// `limits` fitted to a process that may hold `nofile` descriptors and serves `listeners`
/// listeners: each listener gets at most an equal share of what is left after
/// [`RESERVED_DESCRIPTORS`] (at least 1), so a flood on one listener can never take the
/// descriptors another needs, nor all of them; `per_peer` stays within `max`.
pub fn fitted(limits: &ConnectionLimits, nofile: u64, listeners: u32) -> ConnectionLimits {
    let share = nofile.saturating_sub(RESERVED_DESCRIPTORS) / u64::from(listeners.max(1));
    let max = u64::from(limits.max).min(share).max(1) as u32;
    ConnectionLimits {
        max,
        per_peer: limits.per_peer.min(max),
        handshake_timeout: limits.handshake_timeout,
    }
}

/// [`fitted`] to this process's open-file limit now (`RLIMIT_NOFILE`, after
/// [`crate::process::raise_descriptor_limit`]); logs when it lowers `[server.connections]`.
pub fn fit_to_descriptors(limits: &ConnectionLimits, listeners: u32) -> ConnectionLimits {
    fit_to_descriptors_beside(limits, listeners, 0)
}

/// [`fit_to_descriptors`] for a process that may hold `held` descriptors besides its
/// connections (the agent's memory door: descriptors deposited and not yet registered), of
/// which at most half the limit is set aside.
pub fn fit_to_descriptors_beside(
    limits: &ConnectionLimits,
    listeners: u32,
    held: u64,
) -> ConnectionLimits {
    let nofile = rustix::process::getrlimit(rustix::process::Resource::Nofile)
        .current
        .unwrap_or(u64::MAX);
    let nofile = nofile - held.min(nofile / 2);
    let fit = fitted(limits, nofile, listeners);
    if fit.max < limits.max {
        tracing::warn!(
            nofile,
            listeners,
            max = fit.max,
            per_peer = fit.per_peer,
            configured = limits.max,
            "server.connections lowered to fit the open-file limit: each listener keeps its \
             share (raise LimitNOFILE / ulimit -n for more)"
        );
    }
    fit
}

/// The peer key of a TCP connection: its IP address, hashed.
pub(crate) fn ip_key(addr: &std::net::SocketAddr) -> u64 {
    use std::hash::{Hash as _, Hasher as _};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    addr.ip().hash(&mut h);
    h.finish()
}

/// `listener`'s connections under `cap` (per IP address), with `TCP_NODELAY`: Nagle's
/// algorithm with delayed ACKs adds ~40 ms to small responses. Accept failures wait as
/// [`Cap::accept_failed`] says; the stream never ends and never yields an error.
pub fn tcp_incoming(
    listener: TcpListener,
    cap: Cap,
) -> impl Stream<Item = io::Result<Limited<TcpStream>>> + Send + 'static {
    futures::stream::unfold(
        (listener, cap, Duration::ZERO),
        |(listener, cap, mut backoff)| async move {
            loop {
                match listener.accept().await {
                    Ok((stream, addr)) => {
                        backoff = Duration::ZERO;
                        let Some(permit) = cap.admit(ip_key(&addr)) else {
                            continue;
                        };
                        let _ = stream.set_nodelay(true);
                        let io = cap.limit(stream, permit);
                        return Some((Ok(io), (listener, cap, backoff)));
                    }
                    Err(e) => cap.accept_failed(&e, &mut backoff).await,
                }
            }
        },
    )
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    use super::*;

    fn cap(max: u32, per_peer: u32, handshake_ms: u64) -> Cap {
        let limits = ConnectionLimits {
            max,
            per_peer,
            handshake_timeout: kvtier_config::Dur(Duration::from_millis(handshake_ms)),
        };
        Cap::new(
            &limits,
            Listener::Control,
            &ConnMetrics::new(&MetricRegistry::new()).unwrap(),
        )
    }

    #[test]
    fn permits_count_per_listener_and_per_peer_and_come_back_on_drop() {
        let c = cap(3, 2, 1000);
        let a1 = c.admit(1).unwrap();
        let _a2 = c.admit(1).unwrap();
        assert!(c.admit(1).is_none(), "a third from one peer");
        let _b1 = c.admit(2).unwrap();
        assert!(c.admit(3).is_none(), "a fourth in all");
        drop(a1);
        assert!(c.admit(1).is_some(), "the permit came back");
        let refused = |reason: &str| {
            c.metrics
                .refused
                .with_label_values(&["control", reason])
                .get()
        };
        assert_eq!((refused("peer_limit"), refused("limit")), (1, 1));
    }

    #[test]
    fn caps_fit_the_descriptor_limit_in_equal_shares() {
        let limits = ConnectionLimits {
            max: 1024,
            per_peer: 256,
            handshake_timeout: kvtier_config::Dur(Duration::from_secs(10)),
        };
        // Plenty of descriptors: as configured.
        assert_eq!(fitted(&limits, 1 << 20, 6), limits);
        // 200 descriptors, 6 listeners: (200 - 64) / 6 = 22 each, per peer as well.
        let f = fitted(&limits, 200, 6);
        assert_eq!((f.max, f.per_peer), (22, 22));
        assert!(u64::from(f.max) * 6 + RESERVED_DESCRIPTORS <= 200);
        // Fewer than the reserve: one each, never zero.
        let f = fitted(&limits, 10, 3);
        assert_eq!((f.max, f.per_peer), (1, 1));
    }

    #[test]
    fn a_throttle_lets_one_line_through_per_period_and_counts_the_rest() {
        let t = Throttle::new(Duration::from_secs(3600));
        assert_eq!(t.allow(), Some(0));
        assert_eq!(t.allow(), None);
        assert_eq!(t.allow(), None);
        let quick = Throttle::new(Duration::ZERO);
        assert_eq!(quick.allow(), Some(0));
        assert_eq!(quick.allow(), Some(0));
    }

    #[tokio::test]
    async fn a_silent_connection_times_out_and_a_talkative_one_never_does() {
        let c = cap(8, 8, 100);
        let (mut client, server) = tokio::io::duplex(64);
        let mut silent = c.limit(server, c.admit(1).unwrap());
        let mut buf = [0u8; 8];
        let e = silent.read(&mut buf).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert_eq!(c.metrics.timeouts.with_label_values(&["control"]).get(), 1);

        let (mut client2, server2) = tokio::io::duplex(64);
        let mut talker = c.limit(server2, c.admit(2).unwrap());
        client2.write_all(&[7u8; 24]).await.unwrap();
        let mut got = [0u8; 24];
        talker.read_exact(&mut got).await.unwrap();
        // Past the deadline, an idle but introduced connection stays.
        tokio::time::sleep(Duration::from_millis(200)).await;
        client2.write_all(b"x").await.unwrap();
        assert_eq!(talker.read(&mut buf).await.unwrap(), 1);
        client.shutdown().await.unwrap();
    }

    #[test]
    fn only_exhaustion_makes_an_accept_loop_wait() {
        assert!(is_exhaustion(&io::Error::from_raw_os_error(libc::EMFILE)));
        assert!(is_exhaustion(&io::Error::from_raw_os_error(libc::ENFILE)));
        assert!(!is_exhaustion(&io::Error::from_raw_os_error(
            libc::ECONNABORTED
        )));
    }
}
