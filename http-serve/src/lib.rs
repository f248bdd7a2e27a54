//! The HTTP/1.1 connection loop both daemons serve with (the central
//! service on TCP, the agent on its Unix socket), in the shape of
//! mini-redis's `server.rs`: a semaphore caps the connections, every
//! connection task watches the shutdown signal, and the loop returns only
//! once every connection has drained.
//!
//! What it bounds ([`Limits`]):
//!
//! - **connections**: at most `connections_max` at once. A permit is taken
//!   *before* `accept`, so past the cap new connections are not refused by
//!   this process: they wait in the kernel's listen backlog (and the kernel
//!   refuses them once the backlog is full) until a connection closes.
//! - **header read**: a request's head (request line and headers) must
//!   arrive within `header_read_timeout` of the server starting to wait for
//!   it, or the connection is closed (hyper's `header_read_timeout`). The
//!   wait starts when the connection opens and again after each response,
//!   so a keep-alive connection that starts no new request within this
//!   time is closed too. The TLS handshake has the same deadline.
//! - **idle**: a connection on which no byte moves in either direction for
//!   `idle_timeout` (a stalled request body, a client that stopped reading
//!   the response, a handler that hangs) is closed.
//!
//! Nothing here knows the API: the caller hands a service per connection
//! (an axum `Router`, possibly with the peer's credentials as an
//! extension).
//!
//! [`openapi`] builds the OpenAPI 3.1 document each daemon serves at
//! `GET /openapi.json`, from the schemas of its own wire types.

pub mod openapi;

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::serve::Listener;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{Semaphore, watch};
use tokio::time::Instant;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

/// How long a connection may take and how many may be open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Deadline for a request's head (and the TLS handshake), counted from
    /// when the server starts waiting for it.
    pub header_read_timeout: Duration,
    /// A connection with no byte read or written for this long is closed.
    pub idle_timeout: Duration,
    /// Open connections at most; more wait in the listen backlog.
    pub connections_max: usize,
}

impl Limits {
    /// The central service's defaults: 10 s header read, 60 s idle, 1024
    /// connections.
    pub const CENTRAL: Self = Self {
        header_read_timeout: Duration::from_secs(10),
        idle_timeout: Duration::from_secs(60),
        connections_max: 1024,
    };
    /// The agent's defaults: 10 s header read, 60 s idle, 256 connections.
    pub const AGENT: Self = Self {
        header_read_timeout: Duration::from_secs(10),
        idle_timeout: Duration::from_secs(60),
        connections_max: 256,
    };
}

/// Why the server's certificate or key could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum TlsConfigError {
    #[error("cannot read the certificate chain {path}: {message}", path = .path.display())]
    Certificates { path: PathBuf, message: String },
    #[error("no certificate in {path} (expected PEM `BEGIN CERTIFICATE` blocks)", path = .path.display())]
    NoCertificate { path: PathBuf },
    #[error("cannot read the private key {path}: {message}", path = .path.display())]
    Key { path: PathBuf, message: String },
    #[error("the certificate and key do not make a TLS configuration: {0}")]
    Config(#[from] rustls::Error),
}

/// The server's certificate and key, ready to accept TLS connections.
#[derive(Clone)]
pub struct Tls(TlsAcceptor);

impl std::fmt::Debug for Tls {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str("Tls(..)")
    }
}

/// The crypto every TLS configuration of the project uses (ring).
pub fn crypto_provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// TLS serving the PEM certificate chain `cert` (leaf first)
/// with the PEM private key `key` (PKCS#8, PKCS#1 or SEC1). HTTP/1.1 only.
pub fn tls(cert: &Path, key: &Path) -> Result<Tls, TlsConfigError> {
    let chain = CertificateDer::pem_file_iter(cert)
        .and_then(Iterator::collect::<Result<Vec<_>, _>>)
        .map_err(|error| TlsConfigError::Certificates {
            path: cert.to_owned(),
            message: error.to_string(),
        })?;
    if chain.is_empty() {
        return Err(TlsConfigError::NoCertificate {
            path: cert.to_owned(),
        });
    }
    let key = PrivateKeyDer::from_pem_file(key).map_err(|error| TlsConfigError::Key {
        path: key.to_owned(),
        message: error.to_string(),
    })?;
    let mut config = rustls::ServerConfig::builder_with_provider(crypto_provider())
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(chain, key)?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Tls(TlsAcceptor::from(Arc::new(config))))
}

/// Serves `listener` until `shutdown` completes, then stops accepting,
/// lets each connection finish the request under way (idle ones close at
/// once) and returns when the last one has closed. `service` makes the
/// service for one accepted connection (before the TLS handshake, if
/// `tls` is given).
pub async fn serve<L, F, S>(
    mut listener: L,
    tls: Option<Tls>,
    limits: Limits,
    mut service: F,
    shutdown: impl Future<Output = ()> + Send + 'static,
) where
    L: Listener,
    F: FnMut(&L::Io, &L::Addr) -> S,
    S: tower_service::Service<
            hyper::Request<Incoming>,
            Response = axum::response::Response,
            Error = Infallible,
        > + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    let connections_max = limits.connections_max.max(1);
    let permits = Arc::new(Semaphore::new(connections_max));
    let (stop, stopping) = watch::channel(false);
    let shutdown = tokio::spawn(async move {
        shutdown.await;
        let _ = stop.send(true);
    });
    let mut waiting = stopping.clone();
    loop {
        // The permit first: past the cap, connections wait in the backlog.
        let permit = tokio::select! {
            permit = permits.clone().acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => break,
            },
            _ = waiting.wait_for(|stop| *stop) => break,
        };
        let (io, addr) = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = waiting.wait_for(|stop| *stop) => break,
        };
        let service = service(&io, &addr);
        let tls = tls.as_ref().map(|Tls(acceptor)| acceptor.clone());
        let stopping = stopping.clone();
        tokio::spawn(async move {
            let _permit = permit;
            serve_connection(io, tls, limits, service, stopping).await;
        });
    }
    shutdown.abort();
    // Every connection task holds a permit until it ends.
    let all = u32::try_from(connections_max).unwrap_or(u32::MAX);
    let _ = permits.acquire_many(all).await;
}

async fn serve_connection<I, S>(
    io: I,
    tls: Option<TlsAcceptor>,
    limits: Limits,
    service: S,
    mut stopping: watch::Receiver<bool>,
) where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    S: tower_service::Service<
            hyper::Request<Incoming>,
            Response = axum::response::Response,
            Error = Infallible,
        > + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    let activity = Activity::new();
    let io = Watched {
        io,
        activity: activity.clone(),
    };
    let io = match tls {
        None => Conn::Plain(io),
        Some(acceptor) => {
            match tokio::time::timeout(limits.header_read_timeout, acceptor.accept(io)).await {
                Ok(Ok(stream)) => Conn::Tls(Box::new(stream)),
                Ok(Err(error)) => {
                    tracing::debug!(%error, "TLS handshake failed");
                    return;
                }
                Err(_) => {
                    tracing::debug!("TLS handshake timed out");
                    return;
                }
            }
        }
    };
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .keep_alive(true);
    let connection = builder.serve_connection(TokioIo::new(io), TowerToHyperService::new(service));
    tokio::pin!(connection);
    let mut draining = false;
    loop {
        let idle_at = activity.last() + limits.idle_timeout;
        tokio::select! {
            result = connection.as_mut() => {
                if let Err(error) = result {
                    tracing::debug!(%error, "connection closed with an error");
                }
                return;
            }
            _ = stopping.wait_for(|stop| *stop), if !draining => {
                connection.as_mut().graceful_shutdown();
                draining = true;
            }
            () = tokio::time::sleep_until(idle_at) => {
                if activity.last() + limits.idle_timeout <= Instant::now() {
                    tracing::debug!(
                        idle_ms = u64::try_from(limits.idle_timeout.as_millis()).unwrap_or(u64::MAX),
                        "closing a connection on which nothing moved"
                    );
                    return;
                }
            }
        }
    }
}

/// When a byte last moved on a connection, in milliseconds since it opened.
#[derive(Debug, Clone)]
struct Activity {
    opened: Instant,
    last_ms: Arc<AtomicU64>,
}

impl Activity {
    fn new() -> Self {
        Self {
            opened: Instant::now(),
            last_ms: Arc::new(AtomicU64::new(0)),
        }
    }

    fn touch(&self) {
        let elapsed = u64::try_from(self.opened.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_ms.store(elapsed, Ordering::Relaxed);
    }

    fn last(&self) -> Instant {
        self.opened + Duration::from_millis(self.last_ms.load(Ordering::Relaxed))
    }
}

/// A stream that records when bytes move.
#[derive(Debug)]
struct Watched<I> {
    io: I,
    activity: Activity,
}

impl<I: AsyncRead + Unpin> AsyncRead for Watched<I> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.io).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.activity.touch();
        }
        polled
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for Watched<I> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.io).poll_write(cx, buf);
        if matches!(polled, Poll::Ready(Ok(written)) if written > 0) {
            self.activity.touch();
        }
        polled
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// A connection, in clear or under TLS.
#[derive(Debug)]
enum Conn<I> {
    Plain(I),
    Tls(Box<TlsStream<I>>),
}

impl<I: AsyncRead + AsyncWrite + Unpin> AsyncRead for Conn<I> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(io) => Pin::new(io).poll_read(cx, buf),
            Self::Tls(io) => Pin::new(io.as_mut()).poll_read(cx, buf),
        }
    }
}

impl<I: AsyncRead + AsyncWrite + Unpin> AsyncWrite for Conn<I> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Self::Plain(io) => Pin::new(io).poll_write(cx, buf),
            Self::Tls(io) => Pin::new(io.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(io) => Pin::new(io).poll_flush(cx),
            Self::Tls(io) => Pin::new(io.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(io) => Pin::new(io).poll_shutdown(cx),
            Self::Tls(io) => Pin::new(io.as_mut()).poll_shutdown(cx),
        }
    }
}
