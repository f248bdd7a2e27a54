//! The one load generator: keep-alive HTTP/1.1 (and RESP for Redis) over a
//! Unix or TCP stream, one connection per lane, each lane with exactly one
//! request outstanding. Every HTTP case (echo, agent, central) goes through
//! [`HttpConnection`], so the client side costs the same everywhere and the
//! ratios compare servers, not clients.
//!
//! A run starts `in_flight` lanes together; what completes during the
//! warm-up is not counted, what completes inside the measurement window is,
//! and every lane stops at the window's end (no request is cut short: the
//! one outstanding then finishes uncounted).

use std::future::Future;
use std::io::{Read as _, Write as _};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _, Interest, ReadBuf};
use tokio::net::TcpStream;

/// Most bytes of one response's head.
const HEAD_BYTES_MAX: usize = 16 * 1024;
/// Most bytes of one response's body.
const BODY_BYTES_MAX: usize = 1024 * 1024;

/// A stream the generator can talk over.
pub trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

/// Where a server listens.
#[derive(Debug, Clone)]
pub enum Endpoint {
    Unix(PathBuf),
    Tcp(SocketAddr),
}

impl Endpoint {
    pub async fn connect(&self) -> anyhow::Result<Box<dyn Io>> {
        Ok(match self {
            Self::Unix(path) => Box::new(
                ReadInterest::connect(path)
                    .with_context(|| format!("cannot connect to {}", path.display()))?,
            ),
            Self::Tcp(address) => {
                let stream = TcpStream::connect(address)
                    .await
                    .with_context(|| format!("cannot connect to {address}"))?;
                stream.set_nodelay(true)?;
                Box::new(stream)
            }
        })
    }
}

/// A Unix stream registered with the runtime for reading only.
///
/// Tokio registers a socket for write space as well, and a Unix socket's
/// reader wakes every writer so registered each time it takes a request
/// off the socket: the server under test woke a generator thread for
/// nothing once a request, in its own `recv`, and was preempted by it on
/// return (12 % of the agent's daemon thread by `perf`). A gateway's
/// client does not do that — Python's asyncio, for one, asks for write
/// space only after a write would block — so the generator must not
/// either. Its writes go straight to the socket: one small request on an
/// empty socket buffer, since each connection has one request
/// outstanding and the server reads it whole before answering.
struct ReadInterest(AsyncFd<std::os::unix::net::UnixStream>);

impl ReadInterest {
    fn connect(path: &std::path::Path) -> std::io::Result<Self> {
        // A Unix socket connects at once or not at all.
        let stream = std::os::unix::net::UnixStream::connect(path)?;
        stream.set_nonblocking(true)?;
        // Deprecated because an `AsyncFd` could outlive an fd it does not
        // own; a `UnixStream` owns its fd. The replacement is `unsafe`,
        // which this workspace forbids.
        #[allow(deprecated)]
        let registered = AsyncFd::with_interest(stream, Interest::READABLE)?;
        Ok(Self(registered))
    }
}

impl AsyncRead for ReadInterest {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        loop {
            let mut ready = std::task::ready!(self.0.poll_read_ready(cx))?;
            let unfilled = buf.initialize_unfilled();
            match ready.try_io(|stream| stream.get_ref().read(unfilled)) {
                Ok(read) => {
                    let read = read?;
                    buf.advance(read);
                    return Poll::Ready(Ok(()));
                }
                // Not readable after all: the readiness is cleared, wait again.
                Err(_would_block) => {}
            }
        }
    }
}

impl AsyncWrite for ReadInterest {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        match self.0.get_ref().write(data) {
            // Not registered for write space (see above): try again at the
            // next turn of the runtime. Not seen with one small request in
            // flight on a connection.
            Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => {
                cx.waker().wake_by_ref();
                Poll::Pending
            }
            written => Poll::Ready(written),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(self.0.get_ref().shutdown(std::net::Shutdown::Write))
    }
}

/// One answer.
#[derive(Debug)]
pub struct HttpResponse {
    pub status: u16,
    pub body: Vec<u8>,
}

impl HttpResponse {
    pub fn is_success(&self) -> bool {
        (200..300).contains(&self.status)
    }

    pub fn json(&self) -> anyhow::Result<serde_json::Value> {
        serde_json::from_slice(&self.body).context("the answer is not JSON")
    }
}

/// A keep-alive HTTP/1.1 client connection.
pub struct HttpConnection {
    stream: Box<dyn Io>,
    host: &'static str,
    /// Bytes read past the last answer.
    buffer: Vec<u8>,
    request: Vec<u8>,
}

impl std::fmt::Debug for HttpConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpConnection")
            .field("host", &self.host)
            .finish_non_exhaustive()
    }
}

impl HttpConnection {
    pub async fn open(endpoint: &Endpoint) -> anyhow::Result<Self> {
        Ok(Self {
            stream: endpoint.connect().await?,
            host: "bench",
            buffer: Vec::with_capacity(4096),
            request: Vec::with_capacity(1024),
        })
    }

    /// Sends one request and reads its whole answer. `headers` are extra
    /// header lines, each ending in `\r\n`.
    pub async fn request(
        &mut self,
        method: &str,
        path: &str,
        headers: &str,
        body: &[u8],
    ) -> anyhow::Result<HttpResponse> {
        use std::io::Write as _;
        self.request.clear();
        write!(
            self.request,
            "{method} {path} HTTP/1.1\r\nhost: {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n{headers}\r\n",
            self.host,
            body.len()
        )?;
        self.request.extend_from_slice(body);
        self.stream.write_all(&self.request).await?;
        self.read_response().await
    }

    async fn fill(&mut self) -> anyhow::Result<()> {
        let mut chunk = [0u8; 8192];
        let read = self.stream.read(&mut chunk).await?;
        if read == 0 {
            bail!("the server closed the connection");
        }
        self.buffer.extend_from_slice(&chunk[..read]);
        Ok(())
    }

    async fn read_response(&mut self) -> anyhow::Result<HttpResponse> {
        let head_end = loop {
            if let Some(at) = find(&self.buffer, b"\r\n\r\n") {
                break at + 4;
            }
            if self.buffer.len() > HEAD_BYTES_MAX {
                bail!("the answer's head is larger than {HEAD_BYTES_MAX} bytes");
            }
            self.fill().await?;
        };
        let head = std::str::from_utf8(&self.buffer[..head_end]).context("a non-UTF-8 head")?;
        let mut lines = head.split("\r\n");
        let status: u16 = lines
            .next()
            .and_then(|line| line.split_whitespace().nth(1))
            .and_then(|code| code.parse().ok())
            .context("no status line")?;
        let mut length = None;
        let mut chunked = false;
        for line in lines {
            let Some((name, value)) = line.split_once(':') else {
                continue;
            };
            let value = value.trim();
            if name.eq_ignore_ascii_case("content-length") {
                length = Some(value.parse::<usize>().context("a bad content-length")?);
            } else if name.eq_ignore_ascii_case("transfer-encoding") {
                chunked = value.eq_ignore_ascii_case("chunked");
            }
        }
        self.buffer.drain(..head_end);
        let body = if chunked {
            self.read_chunked().await?
        } else {
            let length = length.unwrap_or(0);
            if length > BODY_BYTES_MAX {
                bail!("the answer's body is larger than {BODY_BYTES_MAX} bytes");
            }
            while self.buffer.len() < length {
                self.fill().await?;
            }
            self.buffer.drain(..length).collect()
        };
        Ok(HttpResponse { status, body })
    }

    async fn read_chunked(&mut self) -> anyhow::Result<Vec<u8>> {
        let mut body = Vec::new();
        loop {
            let line_end = loop {
                if let Some(at) = find(&self.buffer, b"\r\n") {
                    break at;
                }
                self.fill().await?;
            };
            let size_text = std::str::from_utf8(&self.buffer[..line_end])?;
            let size = usize::from_str_radix(size_text.split(';').next().unwrap_or("").trim(), 16)
                .context("a bad chunk size")?;
            self.buffer.drain(..line_end + 2);
            if size == 0 {
                // No trailers from our servers: just the final CRLF.
                while self.buffer.len() < 2 {
                    self.fill().await?;
                }
                self.buffer.drain(..2);
                return Ok(body);
            }
            if body.len() + size > BODY_BYTES_MAX {
                bail!("the answer's body is larger than {BODY_BYTES_MAX} bytes");
            }
            while self.buffer.len() < size + 2 {
                self.fill().await?;
            }
            body.extend(self.buffer.drain(..size));
            self.buffer.drain(..2);
        }
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack
        .windows(needle.len())
        .position(|window| window == needle)
}

/// A minimal RESP2 client connection (Redis): one command, one reply.
pub struct RespConnection {
    stream: Box<dyn Io>,
    buffer: Vec<u8>,
    command: Vec<u8>,
}

impl std::fmt::Debug for RespConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RespConnection").finish_non_exhaustive()
    }
}

/// A Redis reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RespValue {
    Simple(String),
    Error(String),
    Integer(i64),
    Bulk(Option<Vec<u8>>),
    Array(Vec<RespValue>),
}

impl RespConnection {
    pub async fn open(endpoint: &Endpoint) -> anyhow::Result<Self> {
        Ok(Self {
            stream: endpoint.connect().await?,
            buffer: Vec::with_capacity(1024),
            command: Vec::with_capacity(256),
        })
    }

    pub async fn command(&mut self, arguments: &[&[u8]]) -> anyhow::Result<RespValue> {
        use std::io::Write as _;
        self.command.clear();
        write!(self.command, "*{}\r\n", arguments.len())?;
        for argument in arguments {
            write!(self.command, "${}\r\n", argument.len())?;
            self.command.extend_from_slice(argument);
            self.command.extend_from_slice(b"\r\n");
        }
        self.stream.write_all(&self.command).await?;
        loop {
            if let Some((value, used)) = parse_resp(&self.buffer)? {
                self.buffer.drain(..used);
                return Ok(value);
            }
            let mut chunk = [0u8; 4096];
            let read = self.stream.read(&mut chunk).await?;
            if read == 0 {
                bail!("redis closed the connection");
            }
            self.buffer.extend_from_slice(&chunk[..read]);
        }
    }
}

/// One complete value at the start of `input` and the bytes it used, or
/// `None` when more bytes are needed.
fn parse_resp(input: &[u8]) -> anyhow::Result<Option<(RespValue, usize)>> {
    let Some(line_end) = find(input, b"\r\n") else {
        return Ok(None);
    };
    let Some((&kind, rest)) = input[..line_end].split_first() else {
        bail!("an empty RESP line");
    };
    let line = std::str::from_utf8(rest)?;
    let after = line_end + 2;
    Ok(match kind {
        b'+' => Some((RespValue::Simple(line.to_owned()), after)),
        b'-' => Some((RespValue::Error(line.to_owned()), after)),
        b':' => Some((RespValue::Integer(line.parse()?), after)),
        b'$' => {
            let length: i64 = line.parse()?;
            if length < 0 {
                return Ok(Some((RespValue::Bulk(None), after)));
            }
            let length = usize::try_from(length)?;
            if input.len() < after + length + 2 {
                return Ok(None);
            }
            Some((
                RespValue::Bulk(Some(input[after..after + length].to_vec())),
                after + length + 2,
            ))
        }
        b'*' => {
            let count: i64 = line.parse()?;
            let mut used = after;
            let mut items = Vec::new();
            for _ in 0..count.max(0) {
                match parse_resp(&input[used..])? {
                    Some((item, length)) => {
                        items.push(item);
                        used += length;
                    }
                    None => return Ok(None),
                }
            }
            Some((RespValue::Array(items), used))
        }
        other => bail!("an unknown RESP type {:?}", char::from(other)),
    })
}

/// The warm-up and the measurement window of one case.
#[derive(Debug, Clone, Copy)]
pub struct Window {
    pub warmup: Duration,
    pub measure: Duration,
}

/// What one lane saw inside the window.
#[derive(Debug)]
pub struct Lane {
    measure_from: Instant,
    measure_until: Instant,
    /// Latency of every request answered inside the window, in µs.
    pub latencies_us: Vec<u32>,
    /// The reserves' latencies only (µs).
    pub reserve_latencies_us: Vec<u32>,
    /// Complete cycles (the last request answered inside the window).
    pub cycles: u64,
    /// Answers that were not what the case expects (inside the window).
    pub errors: u64,
}

/// Which request of a cycle was timed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Reserve,
    Other,
}

impl Lane {
    fn new(start: Instant, window: Window) -> Self {
        Self {
            measure_from: start + window.warmup,
            measure_until: start + window.warmup + window.measure,
            latencies_us: Vec::with_capacity(4096),
            reserve_latencies_us: Vec::new(),
            cycles: 0,
            errors: 0,
        }
    }

    /// Whether the window is over: the lane stops.
    pub fn done(&self) -> bool {
        Instant::now() >= self.measure_until
    }

    fn counts(&self, at: Instant) -> bool {
        at >= self.measure_from && at < self.measure_until
    }

    /// A request sent at `sent` was answered now.
    pub fn record(&mut self, kind: Kind, sent: Instant) {
        let now = Instant::now();
        if self.counts(now) {
            let micros = u32::try_from(now.duration_since(sent).as_micros()).unwrap_or(u32::MAX);
            self.latencies_us.push(micros);
            if kind == Kind::Reserve {
                self.reserve_latencies_us.push(micros);
            }
        }
    }

    /// A cycle ended now.
    pub fn cycle_done(&mut self) {
        if self.counts(Instant::now()) {
            self.cycles += 1;
        }
    }

    /// An unexpected answer now.
    pub fn error(&mut self) {
        if self.counts(Instant::now()) {
            self.errors += 1;
        }
    }
}

/// The merged lanes of one run.
#[derive(Debug, Clone, Default)]
pub struct LoadResult {
    pub in_flight: usize,
    pub seconds: f64,
    pub requests: u64,
    pub cycles: u64,
    pub errors: u64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub reserve_p50_ms: Option<f64>,
    pub reserve_p99_ms: Option<f64>,
}

impl LoadResult {
    pub fn requests_per_second(&self) -> f64 {
        self.requests as f64 / self.seconds
    }

    pub fn cycles_per_second(&self) -> f64 {
        self.cycles as f64 / self.seconds
    }
}

/// The `per_mille`-th of a thousand of sorted `values` (nearest rank), ms.
pub fn percentile_ms(sorted_us: &[u32], per_mille: usize) -> f64 {
    if sorted_us.is_empty() {
        return 0.0;
    }
    let index = (sorted_us.len() * per_mille / 1000).min(sorted_us.len() - 1);
    f64::from(sorted_us[index]) / 1000.0
}

/// Runs `in_flight` lanes of `lane(index, Lane)` for the warm-up and the
/// window; each lane returns its [`Lane`] when [`Lane::done`].
pub async fn run_lanes<F, Fut>(
    in_flight: usize,
    window: Window,
    lane: F,
) -> anyhow::Result<LoadResult>
where
    F: Fn(usize, Lane) -> Fut,
    Fut: Future<Output = anyhow::Result<Lane>> + Send + 'static,
{
    let start = Instant::now();
    let handles: Vec<_> = (0..in_flight)
        .map(|index| tokio::spawn(lane(index, Lane::new(start, window))))
        .collect();
    let mut latencies = Vec::new();
    let mut reserve_latencies = Vec::new();
    let mut result = LoadResult {
        in_flight,
        seconds: window.measure.as_secs_f64(),
        ..LoadResult::default()
    };
    let mut first_error = None;
    for handle in handles {
        match handle.await.context("a lane panicked")? {
            Ok(lane) => {
                result.cycles += lane.cycles;
                result.errors += lane.errors;
                latencies.extend(lane.latencies_us);
                reserve_latencies.extend(lane.reserve_latencies_us);
            }
            Err(error) => {
                first_error.get_or_insert(error);
            }
        }
    }
    if let Some(error) = first_error {
        return Err(error);
    }
    result.requests = latencies.len() as u64;
    latencies.sort_unstable();
    reserve_latencies.sort_unstable();
    result.p50_ms = percentile_ms(&latencies, 500);
    result.p99_ms = percentile_ms(&latencies, 990);
    if !reserve_latencies.is_empty() {
        result.reserve_p50_ms = Some(percentile_ms(&reserve_latencies, 500));
        result.reserve_p99_ms = Some(percentile_ms(&reserve_latencies, 990));
    }
    Ok(result)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resp_values_parse_whole_or_not_at_all() {
        let input = b"*2\r\n:1\r\n$3\r\n999\r\n";
        assert_eq!(
            parse_resp(input).expect("valid"),
            Some((
                RespValue::Array(vec![
                    RespValue::Integer(1),
                    RespValue::Bulk(Some(b"999".to_vec()))
                ]),
                input.len()
            ))
        );
        assert_eq!(parse_resp(&input[..10]).expect("valid so far"), None);
        assert_eq!(
            parse_resp(b"-NOSCRIPT x\r\n").expect("valid"),
            Some((RespValue::Error("NOSCRIPT x".to_owned()), 13))
        );
    }

    /// The generator's Unix connection, registered for reading only,
    /// carries requests and answers in order, an answer that arrives in
    /// pieces included, and a request larger than the socket's buffer
    /// (its write waits for room without being woken by write space).
    #[tokio::test]
    async fn a_unix_connection_registered_for_reading_only_carries_requests() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let path = dir.path().join("echo.sock");
        let listener = tokio::net::UnixListener::bind(&path).expect("binds");
        // Answers each request with its body's length, head and body
        // written apart.
        let server = tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.expect("accepts");
            let mut buffer = Vec::new();
            let mut chunk = vec![0u8; 65536];
            loop {
                let head_end = loop {
                    if let Some(at) = find(&buffer, b"\r\n\r\n") {
                        break at + 4;
                    }
                    let read = stream.read(&mut chunk).await.expect("reads");
                    if read == 0 {
                        return;
                    }
                    buffer.extend_from_slice(&chunk[..read]);
                };
                let head = String::from_utf8_lossy(&buffer[..head_end]).to_string();
                let length: usize = head
                    .lines()
                    .find_map(|line| line.strip_prefix("content-length: "))
                    .and_then(|value| value.trim().parse().ok())
                    .expect("a content-length");
                while buffer.len() < head_end + length {
                    let read = stream.read(&mut chunk).await.expect("reads");
                    buffer.extend_from_slice(&chunk[..read]);
                }
                buffer.drain(..head_end + length);
                let body = length.to_string();
                let head = format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n", body.len());
                stream.write_all(head.as_bytes()).await.expect("writes");
                stream.write_all(body.as_bytes()).await.expect("writes");
            }
        });
        let client = async {
            let mut connection = HttpConnection::open(&Endpoint::Unix(path))
                .await
                .expect("connects");
            for length in [0, 17, 4 << 20, 3] {
                let body = vec![b'x'; length];
                let answer = connection
                    .request("POST", "/echo", "", &body)
                    .await
                    .expect("answered");
                assert_eq!(answer.status, 200);
                assert_eq!(answer.body, length.to_string().into_bytes());
            }
            drop(connection);
            server
                .await
                .expect("the server ends when the client closes");
        };
        // A write that waits for room it is never told of would hang.
        tokio::time::timeout(Duration::from_secs(60), client)
            .await
            .expect("the exchange ends");
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let values: Vec<u32> = (1..=100).map(|ms| ms * 1000).collect();
        assert_eq!(percentile_ms(&values, 500), 51.0);
        assert_eq!(percentile_ms(&values, 990), 100.0);
        assert_eq!(percentile_ms(&[], 500), 0.0);
    }
}
