//! The gateways' HTTP/1.1 API on the agent's Unix socket (docs/design.md
//! §6.5), with axum over a [`UnixListener`]: each request is parsed strictly,
//! handed to the daemon as a [`GatewayRequest`], and the core's
//! [`GatewayResponse`] mapped to a status and a JSON body. No decision is
//! made here. The four admission routes (reserve, start, settle, release)
//! are recognized before axum's router (`AdmissionRoute`): they are
//! nearly every request, and they answer exactly as the router's handlers.
//!
//! | core answer | HTTP |
//! |---|---|
//! | `Reservation` | 201 when created, else 200; the reservation record |
//! | `Accepted` | 202; the reservation record |
//! | `Rejected` | 429, `Retry-After`, `RateLimit-Policy`/`RateLimit`; `{error: "rate_limited", reservation, policyGeneration, dimension, retryAfterSeconds}` |
//! | `Conflict` | 409 `{error: code, message}` |
//! | `NotFound` | 404 `{error: "reservation_not_found", message}` |
//! | `Refused` | the center's status, `{error: code, message}` as the center said them |
//! | `Invalid` | 400 `{error: code, field, message}` (`invalid_units`, `invalid_body`) |
//! | `Unavailable` | 503, `Retry-After`; `{error: code, message, retryAfterSeconds}` |
//! | `PassThrough` | 200 `{"admitted": true, "mode": "off"}` |
//!
//! Every other answer but a 2xx is an error in the same shape, with the
//! codes and statuses of the center's API (docs/design.md §6.1): 400
//! `invalid_path` for a path segment that does not decode or parse, 404
//! `no_such_endpoint`, 405 `method_not_allowed` (with `Allow`), 413
//! `body_too_large`, 400 `unreadable_body`. Bodies are limited to
//! [`BODY_BYTES_MAX`]; an unknown field is a 400 that names it. Any
//! `Content-Type` is accepted: every body is JSON, parsed strictly. Handlers
//! never panic on input.
//!
//! # Every 429 says when to ask again
//!
//! docs/design.md §6.4: a 429 always carries `Retry-After`. When the ledger
//! gives a horizon (capacity that refills, debt that refills repay) that is
//! the value; when waiting alone cannot help (a frozen route, a replaced or
//! rolled-back generation, units above `reservationUnitsMax`) the agent
//! still answers [`RETRY_AFTER_NO_HORIZON_SECONDS`]: an operator has to act
//! first, and a gateway polling once a minute costs nothing. The body's
//! `retryAfterSeconds` is the same number; `dimension` says which case it
//! is. The `RateLimit-Policy` and `RateLimit` fields are the center's for
//! the reservation's own subject and route, passed on verbatim when the
//! center sent them (never another tenant's).
//!
//! # Where the listener comes from
//!
//! [`bind`] creates the socket file; [`serve`] takes any listener, so the
//! command may pass the one systemd handed over by socket activation
//! instead (`reservoir agent run`; this crate knows nothing of systemd).

use std::future::Future;
use std::io;
use std::os::unix::fs::{FileTypeExt as _, PermissionsExt as _};
use std::path::Path;
use std::sync::Arc;

use agent_core::{AgentReservation, AgentStatus, GatewayRequest, GatewayReserve, GatewayResponse};
use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::rejection::{BytesRejection, PathRejection, QueryRejection};
use axum::extract::{DefaultBodyLimit, FromRequestParts, Path as UrlPath, Query, Request, State};
use axum::http::{HeaderName, HeaderValue, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use hyper::body::Incoming;
use ledger::protocol::ErrorCode;
use ledger::{LegActual, LegAsk};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use shard_format::{
    IdempotencyKey, MemberName, OperationId, ReservationId, Route, ShardId, Subject,
};
use tokio::net::UnixListener;
use tokio::sync::Semaphore;

use crate::daemon::{DaemonHandle, Stopped};

/// Largest request body accepted.
pub const BODY_BYTES_MAX: usize = 64 * 1024;

/// Most shards in a page of `GET /v1/shards`, and the page's size when
/// the call names none: a page costs the daemon's thread about 2.5 µs a
/// shard (copying it and writing its JSON), so a page holds it for a few
/// milliseconds at most.
pub const SHARDS_PAGE_MAX: usize = 1000;

/// Most requests handled at once; more are answered 503 with Retry-After
/// at once instead of queueing without bound.
pub const REQUESTS_IN_FLIGHT_MAX: usize = 8192;

/// The socket file's mode: owner and group may connect.
pub const SOCKET_MODE: u32 = 0o660;

pub use ledger::RETRY_AFTER_NO_HORIZON_SECONDS;

/// Who may connect, by peer credentials (`SO_PEERCRED`). Empty lists allow
/// everyone the file mode lets in.
///
/// `allowed_gids` matches the peer's primary group or any of its
/// supplementary groups, as the kernel does for the socket file's group:
/// operators let a gateway in by adding its user to a group
/// (systemd/README.md). `SO_PEERCRED` carries only the primary group; the
/// others are read from `/proc/<pid>/status` when the primary does not
/// match, and a peer whose groups cannot be read is refused.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PeerPolicy {
    pub allowed_uids: Vec<u32>,
    pub allowed_gids: Vec<u32>,
}

/// Why a peer was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerRefusal {
    /// Its uid is not in `allowed_uids` (or the kernel gave none).
    Uid,
    /// Neither its primary nor a supplementary group is in `allowed_gids`.
    Gid,
    /// Its primary group is not listed and its supplementary groups could
    /// not be read (no pid, the process is gone, or `/proc` hides it).
    GroupsUnreadable,
}

impl PeerRefusal {
    /// A stable name for logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Uid => "uid_not_allowed",
            Self::Gid => "gid_not_allowed",
            Self::GroupsUnreadable => "groups_unreadable",
        }
    }
}

impl PeerPolicy {
    /// Whether `peer` may use the socket. `supplementary_groups(pid)` is
    /// asked only when `allowed_gids` is set and the primary gid is not in
    /// it; `None` from it refuses the peer.
    pub fn check(
        &self,
        peer: &Peer,
        supplementary_groups: impl FnOnce(i32) -> Option<Vec<u32>>,
    ) -> Result<(), PeerRefusal> {
        let uid_ok = self.allowed_uids.is_empty()
            || peer.uid.is_some_and(|uid| self.allowed_uids.contains(&uid));
        if !uid_ok {
            return Err(PeerRefusal::Uid);
        }
        if self.allowed_gids.is_empty()
            || peer.gid.is_some_and(|gid| self.allowed_gids.contains(&gid))
        {
            return Ok(());
        }
        let groups = peer
            .pid
            .filter(|pid| *pid > 0)
            .and_then(supplementary_groups)
            .ok_or(PeerRefusal::GroupsUnreadable)?;
        if groups.iter().any(|gid| self.allowed_gids.contains(gid)) {
            Ok(())
        } else {
            Err(PeerRefusal::Gid)
        }
    }
}

/// The supplementary groups in the text of a `/proc/<pid>/status` file (its
/// `Groups:` line, gids separated by white space, possibly none), or `None`
/// when the line is missing or a gid is not a number.
pub fn groups_from_proc_status(status: &str) -> Option<Vec<u32>> {
    let line = status
        .lines()
        .find_map(|line| line.strip_prefix("Groups:"))?;
    line.split_whitespace()
        .map(|gid| gid.parse::<u32>().ok())
        .collect()
}

/// The supplementary groups of process `pid` now, from
/// `/proc/<pid>/status`, or `None` when it cannot be read.
///
/// The pid is the one `SO_PEERCRED` recorded at connect; the connecting
/// process holds the connection, so the pid names it unless it handed the
/// socket on and exited. The groups are read at each request, so a peer
/// that dropped a group since connecting is judged without it.
pub fn supplementary_groups(pid: i32) -> Option<Vec<u32>> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    groups_from_proc_status(&status)
}

/// The connecting process, from the kernel.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Peer {
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub pid: Option<i32>,
}

impl Peer {
    /// The process at the other end of `stream`.
    pub fn of(stream: &tokio::net::UnixStream) -> Self {
        match stream.peer_cred() {
            Ok(cred) => Self {
                uid: Some(cred.uid()),
                gid: Some(cred.gid()),
                pid: cred.pid(),
            },
            Err(_) => Self::default(),
        }
    }
}

/// Binds the socket at `path`: a stale socket file (nobody listening) is
/// removed first; a live one is an error (another agent runs there). The
/// file gets [`SOCKET_MODE`].
pub async fn bind(path: &Path) -> io::Result<UnixListener> {
    if let Ok(metadata) = std::fs::symlink_metadata(path) {
        if !metadata.file_type().is_socket() {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!("{} exists and is not a socket", path.display()),
            ));
        }
        if tokio::net::UnixStream::connect(path).await.is_ok() {
            return Err(io::Error::new(
                io::ErrorKind::AddrInUse,
                format!("another process listens on {}", path.display()),
            ));
        }
        std::fs::remove_file(path)?;
    }
    let listener = UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(SOCKET_MODE))?;
    Ok(listener)
}

/// What every handler shares, behind one `Arc`: axum clones the state for
/// every request (and its middleware), and a field-by-field clone — the
/// daemon's channel and watch handles, the peer lists — was 2 % of the
/// agent's CPU on the emergency path.
type AppState = Arc<App>;

#[derive(Debug)]
struct App {
    daemon: DaemonHandle,
    peers: PeerPolicy,
    in_flight: Arc<Semaphore>,
}

/// The API's routes over `state`.
fn router(state: AppState) -> Router {
    Router::new()
        .route("/v1/reservations", post(reserve))
        .route("/v1/reservations/{reservation}", get(get_reservation))
        .route("/v1/reservations/{reservation}/start", post(start))
        .route("/v1/reservations/{reservation}/settle", post(settle))
        .route("/v1/reservations/{reservation}/release", post(release))
        .route("/v1/reservations/{reservation}/cancel", post(cancel))
        .route("/v1/status", get(status))
        .route("/v1/shards", get(shards))
        .route("/metrics", get(metrics))
        .route("/openapi.json", get(openapi))
        // After every route: it applies to the routes registered before it.
        .method_not_allowed_fallback(method_not_allowed)
        .fallback(no_such_endpoint)
        .layer(DefaultBodyLimit::max(BODY_BYTES_MAX))
        .with_state(state)
}

pub use http_serve::Limits as ServerLimits;

/// Serves the API on `listener` until `shutdown` completes, then lets the
/// connections under way finish, with the default limits
/// ([`ServerLimits::AGENT`]).
pub async fn serve(
    listener: UnixListener,
    daemon: DaemonHandle,
    peers: PeerPolicy,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    serve_with_limits(listener, daemon, peers, ServerLimits::AGENT, shutdown).await
}

/// [`serve`] with `limits`: the header-read and idle timeouts and the
/// connection cap (past it, connections wait in the socket's backlog).
pub async fn serve_with_limits(
    listener: UnixListener,
    daemon: DaemonHandle,
    peers: PeerPolicy,
    limits: ServerLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    let state = Arc::new(App {
        daemon,
        peers,
        in_flight: Arc::new(Semaphore::new(REQUESTS_IN_FLIGHT_MAX)),
    });
    let routes = router(state.clone());
    http_serve::serve(
        listener,
        None,
        limits,
        move |stream: &tokio::net::UnixStream, _: &_| {
            let peer = Peer::of(stream);
            tracing::debug!(uid = ?peer.uid, gid = ?peer.gid, pid = ?peer.pid, "gateway connected");
            Connection {
                peer,
                state: state.clone(),
                routes: routes.clone(),
            }
        },
        shutdown,
    )
    .await;
    Ok(())
}

/// One connection's service: the routes behind [`Connection::admit`], for
/// the peer the kernel named at connect.
///
/// The peer travels in this service, not in each request's extensions: a
/// layer inserting it (and a middleware reading it back) allocated every
/// request an extension map, which was 4 % of the agent's daemon thread
/// on the emergency path.
#[derive(Clone)]
struct Connection {
    peer: Peer,
    state: AppState,
    routes: Router,
}

impl tower_service::Service<Request<Incoming>> for Connection {
    type Response = Response;
    type Error = std::convert::Infallible;
    type Future =
        std::pin::Pin<Box<dyn Future<Output = Result<Response, std::convert::Infallible>> + Send>>;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<Incoming>) -> Self::Future {
        let connection = self.clone();
        Box::pin(async move { Ok(connection.admit(request).await) })
    }
}

impl Connection {
    /// Refuses a peer outside the allow-list (judged at each request: see
    /// [`supplementary_groups`]), sheds load past
    /// [`REQUESTS_IN_FLIGHT_MAX`], and counts answers by status.
    async fn admit(mut self, request: Request<Incoming>) -> Response {
        let state = &self.state;
        let peer = self.peer;
        let response = if let Err(refusal) = state.peers.check(&peer, supplementary_groups) {
            tracing::warn!(
                event = "peer_refused",
                reason = refusal.as_str(),
                uid = ?peer.uid,
                gid = ?peer.gid,
                pid = ?peer.pid,
                "peer refused by the allow-list"
            );
            error(
                StatusCode::FORBIDDEN,
                json!({"error": ErrorCode::PeerNotAllowed, "message": "this uid/gid may not use the agent socket"}),
            )
        } else if let Ok(_permit) = state.in_flight.clone().try_acquire_owned() {
            if let Some(route) = AdmissionRoute::of(request.method(), request.uri().path()) {
                route.answer(state, request.into_body()).await
            } else {
                use tower_service::Service as _;
                let Ok(response) = self.routes.call(request.map(Body::new)).await;
                response
            }
        } else {
            with_retry_after(
                error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    json!({"error": ErrorCode::Overloaded, "message": format!("more than {REQUESTS_IN_FLIGHT_MAX} requests are under way; retry with the same idempotency key"), "retryAfterSeconds": 1}),
                ),
                1,
            )
        };
        state
            .daemon
            .metrics()
            .count_response(response.status().as_u16());
        response
    }
}

/// The four routes of an admission's life, recognized without axum's
/// router: they are nearly every request a gateway sends, and the router's
/// layers (its route lookup, the path parameters and body limit in each
/// request's extension map, its boxed futures) cost them about a tenth of
/// the agent's daemon thread on the emergency path. They answer exactly as
/// the router's handlers for the same routes do, sharing their parsing and
/// rendering; every other request, and these paths with a percent-encoded
/// or empty segment (which axum decodes), goes through the router.
#[derive(Debug, PartialEq, Eq)]
enum AdmissionRoute {
    /// `POST /v1/reservations`.
    Reserve,
    /// `POST /v1/reservations/{reservation}/start`.
    Start(String),
    /// `POST /v1/reservations/{reservation}/settle`.
    Settle(String),
    /// `POST /v1/reservations/{reservation}/release`.
    Release(String),
}

impl AdmissionRoute {
    fn of(method: &Method, path: &str) -> Option<Self> {
        if method != Method::POST {
            return None;
        }
        let rest = path.strip_prefix("/v1/reservations")?;
        if rest.is_empty() {
            return Some(Self::Reserve);
        }
        let (reservation, action) = rest.strip_prefix('/')?.split_once('/')?;
        if reservation.is_empty() || reservation.contains('%') {
            return None;
        }
        let reservation = reservation.to_owned();
        match action {
            "start" => Some(Self::Start(reservation)),
            "settle" => Some(Self::Settle(reservation)),
            "release" => Some(Self::Release(reservation)),
            _ => None,
        }
    }

    async fn answer(self, state: &App, body: Incoming) -> Response {
        let body = read_body(body).await;
        let request = match self {
            Self::Reserve => reserve_request(body),
            Self::Start(reservation) => start_request(&reservation, body),
            Self::Settle(reservation) => settle_request(&reservation, body),
            Self::Release(reservation) => release_request(&reservation, body),
        };
        respond(state, request).await
    }
}

/// The body, limited to [`BODY_BYTES_MAX`], as axum's `Bytes` extractor
/// under the router's [`DefaultBodyLimit`] reads it.
async fn read_body(body: Incoming) -> Result<Bytes, Refusal> {
    use http_body_util::BodyExt as _;
    match http_body_util::Limited::new(body, BODY_BYTES_MAX)
        .collect()
        .await
    {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(error) if error.is::<http_body_util::LengthLimitError>() => Err(body_too_large()),
        Err(error) => Err(body_unreadable(format_args!(
            "Failed to buffer the request body: {error}"
        ))),
    }
}

fn error(status: StatusCode, body: Value) -> Response {
    (status, axum::Json(body)).into_response()
}

/// An answer refusing a request before it reaches the core.
#[derive(Debug)]
struct Refusal {
    status: StatusCode,
    body: Value,
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        error(self.status, self.body)
    }
}

/// 400 `invalid_body`, naming the member (empty: the body as a whole).
fn invalid_request(field: &str, message: impl Into<String>) -> Refusal {
    Refusal {
        status: StatusCode::BAD_REQUEST,
        body: json!({"error": ErrorCode::InvalidBody, "field": field, "message": message.into()}),
    }
}

/// 400 `invalid_path`, naming the path segment.
fn invalid_path(field: &str, message: impl Into<String>) -> Refusal {
    Refusal {
        status: StatusCode::BAD_REQUEST,
        body: json!({"error": ErrorCode::InvalidPath, "field": field, "message": message.into()}),
    }
}

/// The path's segments, or a 400 `invalid_path` in the error shape when
/// one does not decode (broken percent-encoding, not UTF-8): axum's own
/// [`UrlPath`] would answer plain text.
struct Segments<T>(T);

impl<T, S> FromRequestParts<S> for Segments<T>
where
    T: DeserializeOwned + Send,
    S: Send + Sync,
{
    type Rejection = Refusal;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &S,
    ) -> Result<Self, Self::Rejection> {
        let UrlPath(segments) = UrlPath::<T>::from_request_parts(parts, state)
            .await
            .map_err(|rejection: PathRejection| {
                invalid_path(
                    "",
                    format!("a path segment cannot be read: {}", rejection.body_text()),
                )
            })?;
        Ok(Self(segments))
    }
}

fn with_retry_after(mut response: Response, seconds: u64) -> Response {
    if let Ok(value) = HeaderValue::from_str(&seconds.to_string()) {
        response.headers_mut().insert(header::RETRY_AFTER, value);
    }
    response
}

fn stopped(_: Stopped) -> Response {
    with_retry_after(
        error(
            StatusCode::SERVICE_UNAVAILABLE,
            json!({"error": ErrorCode::Stopping, "message": "the agent is stopping; retry with the same idempotency key", "retryAfterSeconds": 1}),
        ),
        1,
    )
}

async fn no_such_endpoint(request: Request) -> Response {
    error(
        StatusCode::NOT_FOUND,
        json!({"error": ErrorCode::NoSuchEndpoint, "message": format!("no endpoint at {} {}", request.method(), request.uri().path())}),
    )
}

/// A known path called with a method it does not answer; axum adds the
/// `Allow` header naming the methods it does.
async fn method_not_allowed(method: Method, uri: Uri) -> Response {
    error(
        StatusCode::METHOD_NOT_ALLOWED,
        json!({"error": ErrorCode::MethodNotAllowed, "message": format!("{} does not answer {method}; the Allow header names the methods it does", uri.path())}),
    )
}

/// The body, or the 413/400 answer for one that could not be read.
fn body_bytes(body: Result<Bytes, BytesRejection>) -> Result<Bytes, Refusal> {
    body.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            body_too_large()
        } else {
            body_unreadable(format_args!("{rejection}"))
        }
    })
}

fn body_too_large() -> Refusal {
    Refusal {
        status: StatusCode::PAYLOAD_TOO_LARGE,
        body: json!({"error": ErrorCode::BodyTooLarge, "message": format!("request bodies are limited to {BODY_BYTES_MAX} bytes")}),
    }
}

fn body_unreadable(why: std::fmt::Arguments<'_>) -> Refusal {
    Refusal {
        status: StatusCode::BAD_REQUEST,
        body: json!({"error": ErrorCode::UnreadableBody, "message": format!("the body cannot be read: {why}")}),
    }
}

/// Parses a JSON object strictly: no member twice in any object (named by
/// its path), only `fields` may appear (an unknown one is named), then the
/// typed value (a bad value is named by its path).
fn parse_strict<T: DeserializeOwned>(body: &[u8], fields: &[&str]) -> Result<T, Refusal> {
    // The common case, a valid body: one walk for repeated and unknown
    // members, then the typed value straight from the bytes. A body that
    // fails either is parsed again below, where what is wrong gets its
    // name. (Through a `Value` first, then the typed value from it, a
    // reserve body took 1.4 µs to parse against 0.8 this way.)
    if body.trim_ascii_start().first() == Some(&b'{')
        && first_offending_member(body, Some(fields)).is_none()
        && let Ok(parsed) = serde_json::from_slice(body)
    {
        return Ok(parsed);
    }
    parse_naming_the_fault(body, fields)
}

/// [`parse_strict`] for a body that may be at fault: the body as a `Value`
/// first, so that the answer names what is wrong with it.
fn parse_naming_the_fault<T: DeserializeOwned>(body: &[u8], fields: &[&str]) -> Result<T, Refusal> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|error| invalid_request("", format!("the body is not JSON: {error}")))?;
    if let Some(Offending::Repeated(duplicate)) = first_offending_member(body, None) {
        return Err(invalid_request(
            &duplicate,
            format!("field `{duplicate}` appears more than once"),
        ));
    }
    let Value::Object(object) = &value else {
        return Err(invalid_request("", "the body must be a JSON object"));
    };
    if let Some(unknown) = object.keys().find(|key| !fields.contains(&key.as_str())) {
        return Err(invalid_request(
            unknown,
            format!(
                "unknown field `{unknown}`; expected one of: {}",
                fields.join(", ")
            ),
        ));
    }
    serde_path_to_error::deserialize(value).map_err(|error| {
        let path = error.path().to_string();
        let inner = error.into_inner().to_string();
        let field = if path.is_empty() || path == "." {
            // A missing field has no path; serde names it in the message.
            inner
                .split('`')
                .nth(1)
                .map_or_else(String::new, str::to_owned)
        } else {
            path
        };
        invalid_request(&field, format!("field `{field}`: {inner}"))
    })
}

/// What [`first_offending_member`] found.
#[derive(Debug, PartialEq, Eq)]
enum Offending {
    /// The path (`request.model`, `tags[2].name`) of a member that appears
    /// twice in one object.
    Repeated(String),
    /// A top-level member not among the fields asked for.
    Unknown(String),
    /// Not JSON: the caller's own parse says where.
    Unreadable,
}

/// The first member of a JSON `body` that appears twice in one object, at
/// any depth, or (given `fields`) that is not one of them at the top level;
/// `None` if there is none and the walk read a whole value.
///
/// serde_json keeps the last of duplicate members where the center's
/// strict parser (`shard_format::parse`) refuses them; two readers of one
/// body must not see different values, so the agent refuses them too, at
/// any depth (the free-form `request` is covered by the request digest).
fn first_offending_member(body: &[u8], fields: Option<&[&str]>) -> Option<Offending> {
    use serde::de::DeserializeSeed as _;
    let found = std::cell::RefCell::new(None);
    let mut deserializer = serde_json::Deserializer::from_slice(body);
    let walked = UniqueMembers {
        found: &found,
        fields,
    }
    .deserialize(&mut deserializer);
    match (found.into_inner(), walked) {
        (Some(found), _) => Some(found),
        (None, Ok(())) => None,
        (None, Err(_)) => Some(Offending::Unreadable),
    }
}

/// Walks one JSON value; at the first member seen twice in an object (or,
/// given `fields`, not among them) it records the member's name in `found`
/// and stops with an error, and every enclosing member and element puts
/// its own segment in front as the error passes: a walk that finds
/// nothing allocates no path.
struct UniqueMembers<'a> {
    found: &'a std::cell::RefCell<Option<Offending>>,
    /// The members this object may have (the top level only).
    fields: Option<&'a [&'a str]>,
}

impl UniqueMembers<'_> {
    /// Puts `segment` (a member's name or `[index]`) in front of the path
    /// found below it.
    fn in_front(&self, segment: std::fmt::Arguments<'_>) {
        if let Some(Offending::Repeated(path)) = self.found.borrow_mut().as_mut() {
            let dot = if path.starts_with('[') { "" } else { "." };
            *path = format!("{segment}{dot}{path}");
        }
    }

    /// The walker of a member's value or an element.
    fn below(&self) -> Self {
        Self {
            found: self.found,
            fields: None,
        }
    }
}

impl<'de> serde::de::DeserializeSeed<'de> for UniqueMembers<'_> {
    type Value = ();

    fn deserialize<D: serde::Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for UniqueMembers<'_> {
    type Value = ();

    fn expecting(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str("a JSON value")
    }

    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }

    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        Ok(())
    }

    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        Ok(())
    }

    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        Ok(())
    }

    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        Ok(())
    }

    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let mut index = 0_usize;
        loop {
            match seq.next_element_seed(self.below()) {
                Ok(Some(())) => index += 1,
                Ok(None) => return Ok(()),
                Err(error) => {
                    self.in_front(format_args!("[{index}]"));
                    return Err(error);
                }
            }
        }
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let mut seen = SeenMembers::default();
        while let Some(name) = map.next_key_seed(MemberName)? {
            if seen.contains(&name) {
                *self.found.borrow_mut() = Some(Offending::Repeated(name.into_owned()));
                return Err(serde::de::Error::custom("duplicate member"));
            }
            if let Some(fields) = self.fields
                && !fields.contains(&name.as_ref())
            {
                *self.found.borrow_mut() = Some(Offending::Unknown(name.into_owned()));
                return Err(serde::de::Error::custom("unknown member"));
            }
            if let Err(error) = map.next_value_seed(self.below()) {
                self.in_front(format_args!("{name}"));
                return Err(error);
            }
            seen.insert(name);
        }
        Ok(())
    }
}

/// How many member names of one object [`SeenMembers`] keeps in a list.
const MEMBERS_LISTED_MAX: usize = 16;

/// The member names of one object seen so far: a list searched in order
/// while it is short — the API's own objects have a handful of members,
/// and a hash set hashed (and allocated and grew) for each body was 1 % of
/// the agent's daemon thread on the emergency path — and a hash set for
/// the names past [`MEMBERS_LISTED_MAX`], so that an object of thousands
/// of members (a free-form `request`) is not checked in quadratic time.
#[derive(Default)]
struct SeenMembers<'de> {
    listed: Vec<std::borrow::Cow<'de, str>>,
    hashed: std::collections::HashSet<std::borrow::Cow<'de, str>>,
}

impl<'de> SeenMembers<'de> {
    fn contains(&self, name: &str) -> bool {
        // An empty hash set answers without hashing.
        self.listed.iter().any(|seen| seen == name) || self.hashed.contains(name)
    }

    fn insert(&mut self, name: std::borrow::Cow<'de, str>) {
        if self.listed.len() < MEMBERS_LISTED_MAX {
            self.listed.push(name);
        } else {
            self.hashed.insert(name);
        }
    }
}

/// An empty body or `{}`.
fn parse_empty(body: &[u8]) -> Result<(), Refusal> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(());
    }
    parse_strict::<serde_json::Map<String, Value>>(body, &[]).map(|_| ())
}

fn reservation_id(raw: &str) -> Result<ReservationId, Refusal> {
    ReservationId::new(raw)
        .map_err(|error| invalid_path("reservation", format!("path segment `reservation` {error}")))
}

async fn answer(state: &App, request: GatewayRequest) -> Response {
    match state.daemon.call(request).await {
        Ok(response) => render(response),
        Err(stopped_error) => stopped(stopped_error),
    }
}

/// A record as a gateway sees it: `endedAt` is the journal's retention
/// bookkeeping, not part of the answer (a first answer and its replay must
/// read the same).
fn for_gateway(mut reservation: AgentReservation) -> AgentReservation {
    reservation.ended_at = None;
    reservation
}

/// A reservation record as the JSON body of a `status` answer.
fn reservation_answer(status: StatusCode, reservation: &AgentReservation) -> Response {
    thread_local! {
        /// Where answers are written before their body is copied out: it
        /// keeps the room of the largest answer so far.
        static ANSWER: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    // Written into a buffer that keeps its room, then copied into a body of
    // the exact size: axum's `Json` started at 128 bytes and grew (and
    // copied) its buffer three times for a record, and a body allocated
    // with room to spare kept memory of a larger size class resident.
    let written = ANSWER.with_borrow_mut(|scratch| {
        scratch.clear();
        serde_json::to_writer(&mut *scratch, reservation).map(|()| Bytes::copy_from_slice(scratch))
    });
    match written {
        Ok(body) => (
            status,
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            )],
            body,
        )
            .into_response(),
        // Nothing in a record fails to serialize (strings, numbers,
        // structs), but an answer must not panic.
        Err(serialize_error) => {
            tracing::error!(%serialize_error, reservation = %reservation.reservation, "a reservation record did not serialize");
            error(
                StatusCode::INTERNAL_SERVER_ERROR,
                json!({"error": ErrorCode::Internal, "message": format!("the reservation record did not serialize: {serialize_error}")}),
            )
        }
    }
}

/// Maps the core's answer to HTTP (see the module documentation).
pub fn render(response: GatewayResponse) -> Response {
    match response {
        GatewayResponse::Reservation {
            created,
            reservation,
        } => {
            let status = if created {
                StatusCode::CREATED
            } else {
                StatusCode::OK
            };
            reservation_answer(status, &for_gateway(*reservation))
        }
        GatewayResponse::Accepted(reservation) => {
            reservation_answer(StatusCode::ACCEPTED, &for_gateway(*reservation))
        }
        GatewayResponse::Rejected {
            reservation,
            rejection,
            leg,
        } => {
            let retry_after = rejection.retry_after_header_seconds();
            let mut body = json!({
                "error": ErrorCode::RateLimited,
                // The center's sentence for the same rejection.
                "message": ledger::protocol::Refusal::rate_limited(rejection).message,
                "reservation": reservation,
                "policyGeneration": rejection.policy_generation,
                "dimension": rejection.dimension,
                "retryAfterSeconds": retry_after,
            });
            // A multi-leg reserve: the limiting leg, the caller's own pair.
            if let (Some((index, pair)), Value::Object(members)) = (leg, &mut body) {
                members.insert("leg".into(), index.into());
                members.insert("subject".into(), pair.subject.as_str().into());
                members.insert("route".into(), pair.route.as_str().into());
            }
            let mut response =
                with_retry_after(error(StatusCode::TOO_MANY_REQUESTS, body), retry_after);
            // The caller's own limit, as the center computed it.
            let fields = rejection.rate_limit.iter().flat_map(|state| {
                [
                    ("ratelimit-policy", state.policy_field()),
                    (
                        "ratelimit",
                        state.limit_field(rejection.retry_after_seconds),
                    ),
                ]
            });
            for (name, value) in fields {
                if let Ok(value) = HeaderValue::from_str(&value) {
                    response
                        .headers_mut()
                        .insert(HeaderName::from_static(name), value);
                }
            }
            response
        }
        GatewayResponse::PassThrough => (
            StatusCode::OK,
            axum::Json(crate::openapi::PassThroughBody::default()),
        )
            .into_response(),
        GatewayResponse::Conflict { code, message } => error(
            StatusCode::CONFLICT,
            json!({"error": code, "message": message}),
        ),
        GatewayResponse::NotFound => error(
            StatusCode::NOT_FOUND,
            json!({"error": ErrorCode::ReservationNotFound, "message": "no such reservation"}),
        ),
        GatewayResponse::Refused {
            status,
            code,
            message,
        } => error(
            StatusCode::from_u16(status).unwrap_or(StatusCode::CONFLICT),
            json!({"error": code, "message": message}),
        ),
        GatewayResponse::Invalid {
            code,
            field,
            message,
        } => error(
            StatusCode::BAD_REQUEST,
            json!({"error": code, "field": field, "message": message}),
        ),
        GatewayResponse::Unavailable {
            code,
            message,
            retry_after_seconds,
        } => with_retry_after(
            error(
                StatusCode::SERVICE_UNAVAILABLE,
                json!({"error": code, "message": message, "retryAfterSeconds": retry_after_seconds}),
            ),
            retry_after_seconds,
        ),
    }
}

const RESERVE_FIELDS: &[&str] = &[
    "idempotencyKey",
    "subject",
    "route",
    "units",
    "minUnits",
    "legs",
    "deadlineMs",
    "priority",
    "request",
];

/// `POST /v1/reservations`: one pair (`subject`, `route`, `units`,
/// `minUnits`), or `legs`, 1 to 8 pairs admitted all or none
/// (docs/design.md §3.13).
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(crate) struct ReserveBody {
    idempotency_key: IdempotencyKey,
    #[serde(default)]
    subject: Option<Subject>,
    #[serde(default)]
    route: Option<Route>,
    /// Required with `subject` and `route` (the one-pair form).
    #[serde(default)]
    #[schemars(range(min = 1, max = shard_format::limits::UNITS_MAX))]
    units: Option<u64>,
    /// A flexible reservation: admit the largest amount from `minUnits` to
    /// `units` that can be covered now (the answer's `reservedUnits`).
    #[serde(default)]
    #[schemars(range(min = 1, max = shard_format::limits::UNITS_MAX))]
    min_units: Option<u64>,
    /// The multi-leg form, instead of `subject`, `route`, `units` and
    /// `minUnits`: each leg `{subject, route, units, minUnits?}`; the
    /// answer's `legs` carry each leg's `reservedUnits`.
    #[serde(default)]
    legs: Option<Vec<LegAsk>>,
    /// How long the gateway will wait for the execution, from the reserve.
    /// At least 1, at most the agent's `deadline_ms_max` (default one hour).
    #[serde(default)]
    #[schemars(range(min = 1))]
    deadline_ms: Option<u64>,
    #[serde(default)]
    priority: Option<u8>,
    /// Free-form description of the request, covered by the request digest.
    #[serde(default)]
    request: Option<Value>,
}

/// Parses a reserve body in either form into the core's request.
fn parse_reserve(body: &[u8]) -> Result<GatewayReserve, Refusal> {
    let body: ReserveBody = parse_strict(body, RESERVE_FIELDS)?;
    let one_pair = body.subject.is_some()
        || body.route.is_some()
        || body.units.is_some()
        || body.min_units.is_some();
    let (first, more_legs) = match body.legs {
        Some(_) if one_pair => {
            return Err(invalid_request(
                "legs",
                "field `legs`: give `legs`, or `subject`, `route` and `units`, not both",
            ));
        }
        Some(legs) if legs.is_empty() => {
            return Err(invalid_request(
                "legs",
                "field `legs`: a reservation has at least one leg",
            ));
        }
        Some(mut legs) => {
            let more = legs.split_off(1);
            (legs.swap_remove(0), more)
        }
        None => {
            let missing = |field: &str| {
                invalid_request(field, format!("field `{field}`: missing field `{field}`"))
            };
            let first = LegAsk {
                subject: body.subject.ok_or_else(|| missing("subject"))?,
                route: body.route.ok_or_else(|| missing("route"))?,
                units: body.units.ok_or_else(|| missing("units"))?,
                min_units: body.min_units,
            };
            (first, Vec::new())
        }
    };
    Ok(GatewayReserve {
        idempotency_key: body.idempotency_key,
        subject: first.subject,
        route: first.route,
        units: first.units,
        min_units: first.min_units,
        deadline_ms: body.deadline_ms,
        priority: body.priority,
        request: body.request,
        more_legs,
    })
}

/// A handler's answer: the core's, or the refusal of a request that did
/// not parse.
async fn respond(state: &App, request: Result<GatewayRequest, Refusal>) -> Response {
    match request {
        Ok(request) => answer(state, request).await,
        Err(refusal) => refusal.into_response(),
    }
}

fn reserve_request(body: Result<Bytes, Refusal>) -> Result<GatewayRequest, Refusal> {
    let reserve = parse_reserve(&body?)?;
    tracing::debug!(
        subject = %reserve.subject,
        route = %reserve.route,
        units = reserve.units,
        "reserve"
    );
    Ok(GatewayRequest::Reserve(reserve))
}

async fn reserve(State(state): State<AppState>, body: Result<Bytes, BytesRejection>) -> Response {
    respond(&state, reserve_request(body_bytes(body))).await
}

async fn get_reservation(
    State(state): State<AppState>,
    Segments(reservation): Segments<String>,
) -> Response {
    match reservation_id(&reservation) {
        Ok(reservation) => answer(&state, GatewayRequest::Get { reservation }).await,
        Err(refusal) => refusal.into_response(),
    }
}

/// `POST /v1/reservations/{reservation}/start`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(crate) struct StartBody {
    operation_id: OperationId,
}

/// `POST /v1/reservations/{reservation}/settle`: `actualUnits` for one
/// pair, or `legs` for a multi-leg reservation (a leg left out settles at
/// its reserved units).
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(crate) struct SettleBody {
    operation_id: OperationId,
    #[serde(default)]
    #[schemars(range(max = shard_format::limits::UNITS_MAX))]
    actual_units: Option<u64>,
    #[serde(default)]
    legs: Option<Vec<LegActual>>,
}

fn start_request(
    reservation: &str,
    body: Result<Bytes, Refusal>,
) -> Result<GatewayRequest, Refusal> {
    let reservation = reservation_id(reservation)?;
    let body: StartBody = parse_strict(&body?, &["operationId"])?;
    Ok(GatewayRequest::Start {
        reservation,
        operation_id: body.operation_id,
    })
}

async fn start(
    State(state): State<AppState>,
    Segments(reservation): Segments<String>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    respond(&state, start_request(&reservation, body_bytes(body))).await
}

fn settle_request(
    reservation: &str,
    body: Result<Bytes, Refusal>,
) -> Result<GatewayRequest, Refusal> {
    let reservation = reservation_id(reservation)?;
    let body: SettleBody = parse_strict(&body?, &["operationId", "actualUnits", "legs"])?;
    match (body.actual_units, body.legs) {
        (Some(actual_units), None) => Ok(GatewayRequest::Settle {
            reservation,
            operation_id: body.operation_id,
            actual_units,
        }),
        (None, Some(legs)) => Ok(GatewayRequest::SettleLegs {
            reservation,
            operation_id: body.operation_id,
            legs,
        }),
        (None, None) => Err(invalid_request(
            "actualUnits",
            "field `actualUnits`: missing field `actualUnits` (or `legs`, per leg)",
        )),
        (Some(_), Some(_)) => Err(invalid_request(
            "legs",
            "field `legs`: give `actualUnits` (one pair) or `legs` (per leg), not both",
        )),
    }
}

async fn settle(
    State(state): State<AppState>,
    Segments(reservation): Segments<String>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    respond(&state, settle_request(&reservation, body_bytes(body))).await
}

fn release_request(
    reservation: &str,
    body: Result<Bytes, Refusal>,
) -> Result<GatewayRequest, Refusal> {
    let reservation = reservation_id(reservation)?;
    parse_empty(&body?)?;
    Ok(GatewayRequest::Release { reservation })
}

async fn release(
    State(state): State<AppState>,
    Segments(reservation): Segments<String>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    respond(&state, release_request(&reservation, body_bytes(body))).await
}

async fn cancel(
    State(state): State<AppState>,
    Segments(reservation): Segments<String>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let request = reservation_id(&reservation).and_then(|reservation| {
        parse_empty(&body_bytes(body)?)?;
        Ok(GatewayRequest::Cancel { reservation })
    });
    respond(&state, request).await
}

/// `GET /v1/status` as JSON (without the shell's `journalBytes` and
/// `centralError`).
pub fn status_json(status: &AgentStatus) -> Value {
    serde_json::to_value(crate::openapi::StatusBody::new(status)).unwrap_or_default()
}

async fn status(State(state): State<AppState>) -> Response {
    match state.daemon.status().await {
        Ok(status) => {
            let mut body = status_json(&status);
            body["journalBytes"] = state.daemon.journal_bytes().into();
            // A center that cannot be reached or trusted is not healthy
            // (`partitioned`, when a pair already is, says as much).
            let central_error = state.daemon.metrics().central_error();
            if central_error.is_some() && status.mode == "healthy" {
                body["mode"] = "central_unreachable".into();
            }
            body["centralError"] = central_error.into();
            (StatusCode::OK, axum::Json(body)).into_response()
        }
        Err(stopped_error) => stopped(stopped_error),
    }
}

/// The query of `GET /v1/shards`, as text: each parameter is checked
/// with a message of its own.
#[derive(Debug, Deserialize)]
struct ShardsQuery {
    after: Option<String>,
    limit: Option<String>,
}

/// 400 `invalid_query`, naming the parameter.
fn invalid_query(field: &str, message: impl Into<String>) -> Refusal {
    Refusal {
        status: StatusCode::BAD_REQUEST,
        body: json!({"error": ErrorCode::InvalidQuery, "field": field, "message": message.into()}),
    }
}

impl ShardsQuery {
    /// The page's start and size.
    fn page(self) -> Result<(Option<ShardId>, usize), Refusal> {
        let after = self
            .after
            .map(|after| {
                after
                    .parse::<ShardId>()
                    .map_err(|error| invalid_query("after", format!("not a shard ID: {error}")))
            })
            .transpose()?;
        let limit = match self.limit {
            None => SHARDS_PAGE_MAX,
            Some(limit) => limit
                .parse::<usize>()
                .ok()
                .filter(|limit| (1..=SHARDS_PAGE_MAX).contains(limit))
                .ok_or_else(|| {
                    invalid_query(
                        "limit",
                        format!("{limit:?} is not a whole number from 1 to {SHARDS_PAGE_MAX}"),
                    )
                })?,
        };
        Ok((after, limit))
    }
}

/// `GET /v1/shards`: a page of the shards, closed ones too.
async fn shards(
    State(state): State<AppState>,
    query: Result<Query<ShardsQuery>, QueryRejection>,
) -> Response {
    let page = query
        .map_err(|rejection| {
            invalid_query(
                "",
                format!("the query cannot be read: {}", rejection.body_text()),
            )
        })
        .and_then(|Query(query)| query.page());
    let (after, limit) = match page {
        Ok(page) => page,
        Err(refusal) => return refusal.into_response(),
    };
    match state.daemon.shards(after, limit).await {
        Ok(page) => {
            let body = crate::openapi::ShardsBody::new(page);
            (StatusCode::OK, axum::Json(body)).into_response()
        }
        Err(stopped_error) => stopped(stopped_error),
    }
}

/// `GET /openapi.json`: the socket API's OpenAPI 3.1 document.
async fn openapi() -> Response {
    static DOCUMENT: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    let text = DOCUMENT.get_or_init(crate::openapi::document_text);
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/json")],
        text.as_str(),
    )
        .into_response()
}

async fn metrics(State(state): State<AppState>) -> Response {
    let gauges = match state.daemon.gauges().await {
        Ok(gauges) => gauges,
        Err(stopped_error) => return stopped(stopped_error),
    };
    let metrics = state.daemon.metrics();
    (
        StatusCode::OK,
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        metrics.render() + &metrics.render_gauges(&gauges),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field_of(refusal: Refusal) -> (StatusCode, String) {
        let response = refusal.into_response();
        let status = response.status();
        let body = futures_body(response);
        (status, body["field"].as_str().unwrap_or("").to_owned())
    }

    fn futures_body(response: Response) -> Value {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        runtime.block_on(async {
            let bytes = axum::body::to_bytes(response.into_body(), BODY_BYTES_MAX)
                .await
                .expect("body");
            serde_json::from_slice(&bytes).expect("json")
        })
    }

    #[test]
    fn a_shards_query_takes_a_page_size_from_1_to_the_most_and_a_shard_id() {
        let page = |after: Option<&str>, limit: Option<&str>| {
            ShardsQuery {
                after: after.map(str::to_owned),
                limit: limit.map(str::to_owned),
            }
            .page()
        };
        let (after, limit) = page(None, None).expect("the defaults");
        assert_eq!((after, limit), (None, SHARDS_PAGE_MAX));
        let (after, limit) = page(Some("sh-7"), Some("1")).expect("the least");
        assert_eq!(after.as_ref().map(ShardId::as_str), Some("sh-7"));
        assert_eq!(limit, 1);
        let most = SHARDS_PAGE_MAX.to_string();
        assert_eq!(
            page(None, Some(&most)).expect("the most").1,
            SHARDS_PAGE_MAX
        );
        let over = (SHARDS_PAGE_MAX + 1).to_string();
        for (after, limit, field) in [
            (None, Some("0"), "limit"),
            (None, Some(over.as_str()), "limit"),
            (None, Some("-1"), "limit"),
            (None, Some("ten"), "limit"),
            (None, Some(""), "limit"),
            (Some("sh/7"), None, "after"),
            (Some(""), None, "after"),
        ] {
            let refusal = page(after, limit).expect_err("refused");
            assert_eq!(refusal.body["error"], "invalid_query", "{:?}", refusal.body);
            assert_eq!(
                field_of(refusal),
                (StatusCode::BAD_REQUEST, field.to_owned()),
                "{after:?} {limit:?}"
            );
        }
    }

    /// Through the socket, the router sees the admission routes only with
    /// an encoded segment; it keeps them for that and for the 405 of other
    /// methods. Called directly, its handlers parse, refuse and hand on
    /// to the daemon as the admission routes do.
    #[test]
    fn the_routers_admission_handlers_answer_as_the_admission_routes() {
        use tower_service::Service as _;
        let state = Arc::new(App {
            daemon: DaemonHandle::stopped(),
            peers: PeerPolicy::default(),
            in_flight: Arc::new(Semaphore::new(1)),
        });
        let mut routes = router(state);
        let reserve = r#"{"idempotencyKey":"k","subject":"s","route":"r","units":1}"#;
        let cases = [
            ("/v1/reservations", reserve, 503, "stopping", ""),
            (
                "/v1/reservations",
                r#"{"idempotencyKey":"k"}"#,
                400,
                "invalid_body",
                "subject",
            ),
            (
                "/v1/reservations/rl-1/start",
                r#"{"operationId":"o"}"#,
                503,
                "stopping",
                "",
            ),
            (
                "/v1/reservations/rl-1/start",
                "{}",
                400,
                "invalid_body",
                "operationId",
            ),
            (
                "/v1/reservations/rl-1/settle",
                r#"{"operationId":"o","actualUnits":1}"#,
                503,
                "stopping",
                "",
            ),
            (
                "/v1/reservations/rl-1/settle",
                r#"{"operationId":"o"}"#,
                400,
                "invalid_body",
                "actualUnits",
            ),
            ("/v1/reservations/rl-1/release", "", 503, "stopping", ""),
            (
                "/v1/reservations/rl-1/release",
                r#"{"x":1}"#,
                400,
                "invalid_body",
                "x",
            ),
            ("/v1/reservations/rl-1/cancel", "", 503, "stopping", ""),
            (
                "/v1/reservations/rl-1/cancel",
                r#"{"x":1}"#,
                400,
                "invalid_body",
                "x",
            ),
        ];
        for (path, body, status, code, field) in cases {
            let request = Request::post(path)
                .body(Body::from(body))
                .expect("a request");
            let runtime = tokio::runtime::Builder::new_current_thread()
                .build()
                .expect("runtime");
            let Ok(response) = runtime.block_on(routes.call(request));
            assert_eq!(response.status().as_u16(), status, "{path} {body}");
            let answer = futures_body(response);
            assert_eq!(answer["error"], code, "{path} {body}: {answer}");
            assert_eq!(
                answer["field"].as_str().unwrap_or(""),
                field,
                "{path} {body}: {answer}"
            );
        }
    }

    #[test]
    fn only_the_four_admission_routes_bypass_the_router() {
        use AdmissionRoute::*;
        let post = Method::POST;
        let recognized = [
            ("/v1/reservations", Reserve),
            ("/v1/reservations/rl-1/start", Start("rl-1".into())),
            ("/v1/reservations/rl-1/settle", Settle("rl-1".into())),
            ("/v1/reservations/rl-1/release", Release("rl-1".into())),
        ];
        for (path, route) in recognized {
            assert_eq!(AdmissionRoute::of(&post, path), Some(route), "{path}");
            // Another method on the same path is the router's (a 405).
            assert_eq!(AdmissionRoute::of(&Method::GET, path), None, "{path}");
            assert_eq!(AdmissionRoute::of(&Method::PUT, path), None, "{path}");
        }
        for path in [
            // Decoded (or refused) by the router's path extractor.
            "/v1/reservations/rl%2D1/settle",
            "/v1/reservations/%E2%82/start",
            // Not the four routes.
            "/v1/reservations/",
            "/v1/reservations//start",
            "/v1/reservations/rl-1",
            "/v1/reservations/rl-1/",
            "/v1/reservations/rl-1/cancel",
            "/v1/reservations/rl-1/settle/",
            "/v1/reservations/rl-1/settle/again",
            "/v1/reservationsX",
            "/v1/reservations-x/rl-1/start",
            "/v1/status",
            "/v2/reservations",
        ] {
            assert_eq!(AdmissionRoute::of(&post, path), None, "{path}");
        }
    }

    #[test]
    fn bad_input_names_the_field() {
        let cases: &[(&str, &str)] = &[
            (
                r#"{"idempotencyKey":"k","subject":"s","route":"r","units":1,"extra":1}"#,
                "extra",
            ),
            (
                r#"{"idempotencyKey":"k","subject":"s","route":"r"}"#,
                "units",
            ),
            (
                r#"{"idempotencyKey":"k","subject":"s","route":"r","units":-1}"#,
                "units",
            ),
            (
                r#"{"idempotencyKey":"k","subject":"s","route":"r","units":1,"priority":900}"#,
                "priority",
            ),
            (r#"[1,2]"#, ""),
            ("not json", ""),
        ];
        for (body, field) in cases {
            let response = parse_reserve(body.as_bytes()).expect_err(body);
            assert_eq!(
                field_of(response),
                (StatusCode::BAD_REQUEST, (*field).to_owned()),
                "{body}"
            );
        }
        assert!(parse_empty(b"").is_ok());
        assert!(parse_empty(b" {} ").is_ok());
        assert_eq!(
            field_of(parse_empty(br#"{"x":1}"#).expect_err("unknown")),
            (StatusCode::BAD_REQUEST, "x".to_owned())
        );
    }

    #[test]
    fn supplementary_groups_come_from_the_groups_line() {
        let status = "Name:\tgateway\nUid:\t1000\t1000\t1000\t1000\nGid:\t1000\t1000\t1000\t1000\nGroups:\t27 998 4242 \nVmPeak:\t1 kB\n";
        assert_eq!(groups_from_proc_status(status), Some(vec![27, 998, 4242]));
        // A process in no supplementary group: the line is there, empty.
        assert_eq!(
            groups_from_proc_status("Gid:\t0\nGroups:\t\n"),
            Some(vec![])
        );
        assert_eq!(groups_from_proc_status("Gid:\t0\n"), None);
        assert_eq!(groups_from_proc_status("Groups:\t27 x\n"), None);
        assert_eq!(groups_from_proc_status("Groups:\t4294967296\n"), None);
    }

    #[test]
    fn allowed_gids_match_the_primary_or_a_supplementary_group() {
        let policy = PeerPolicy {
            allowed_uids: vec![],
            allowed_gids: vec![998],
        };
        let peer = |gid| Peer {
            uid: Some(1000),
            gid: Some(gid),
            pid: Some(4321),
        };
        let never = |_: i32| -> Option<Vec<u32>> { panic!("the primary group matched") };
        assert_eq!(policy.check(&peer(998), never), Ok(()));
        assert_eq!(policy.check(&peer(1000), |_| Some(vec![27, 998])), Ok(()));
        assert_eq!(
            policy.check(&peer(1000), |_| Some(vec![27, 999])),
            Err(PeerRefusal::Gid)
        );
        assert_eq!(
            policy.check(&peer(1000), |_| None),
            Err(PeerRefusal::GroupsUnreadable)
        );
        for pid in [None, Some(0)] {
            let no_pid = Peer { pid, ..peer(1000) };
            assert_eq!(
                policy.check(&no_pid, |_| Some(vec![998])),
                Err(PeerRefusal::GroupsUnreadable)
            );
        }
        // The uid list is checked first; groups cannot widen it.
        let uids = PeerPolicy {
            allowed_uids: vec![0],
            ..policy.clone()
        };
        assert_eq!(uids.check(&peer(998), never), Err(PeerRefusal::Uid));
        assert_eq!(PeerPolicy::default().check(&peer(1), never), Ok(()));
    }

    /// The real path: the kernel's credentials of a connected peer (this
    /// process) and its groups from `/proc`.
    #[test]
    fn this_process_is_judged_by_its_own_groups() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .build()
            .expect("runtime");
        let (ours, _theirs) = std::os::unix::net::UnixStream::pair().expect("socket pair");
        let cred = runtime.block_on(async {
            ours.set_nonblocking(true).expect("nonblocking");
            tokio::net::UnixStream::from_std(ours)
                .expect("tokio stream")
                .peer_cred()
                .expect("peer credentials")
        });
        let peer = Peer {
            uid: Some(cred.uid()),
            gid: Some(cred.gid()),
            pid: cred.pid(),
        };
        assert_eq!(
            peer.pid,
            Some(i32::try_from(std::process::id()).expect("pid"))
        );
        let groups = supplementary_groups(peer.pid.expect("pid")).expect("own groups readable");
        let own_status = std::fs::read_to_string("/proc/self/status").expect("status");
        assert_eq!(Some(groups.clone()), groups_from_proc_status(&own_status));
        // A gid this process is in neither as primary nor supplementary.
        let outsider = (1..u32::MAX)
            .find(|gid| Some(*gid) != peer.gid && !groups.contains(gid))
            .expect("a free gid");
        let refuse = PeerPolicy {
            allowed_uids: vec![],
            allowed_gids: vec![outsider],
        };
        assert_eq!(
            refuse.check(&peer, supplementary_groups),
            Err(PeerRefusal::Gid)
        );
        // Each group this process has (supplementary ones when it has
        // any) lets it in.
        for gid in peer.gid.into_iter().chain(groups) {
            let allow = PeerPolicy {
                allowed_uids: vec![],
                allowed_gids: vec![gid],
            };
            assert_eq!(
                allow.check(&peer, supplementary_groups),
                Ok(()),
                "gid {gid}"
            );
        }
    }

    /// The typed parse straight from the bytes answers exactly as the
    /// parse through a `Value` does, on good bodies and bad ones.
    #[test]
    fn the_quick_parse_answers_as_the_parse_naming_the_fault() {
        let bodies = [
            r#"{"idempotencyKey":"k","subject":"s","route":"r","units":1}"#,
            r#"  {"idempotencyKey":"k","subject":"s","route":"r","units":1,"minUnits":1,"deadlineMs":5,"priority":3,"request":{"model":"m","n":[1,2]}}  "#,
            r#"{"idempotencyKey":"k","legs":[{"subject":"s","route":"r","units":2}]}"#,
            r#"{"idempotencyKey":"k","subject":"s","route":"r","units":1,"units":2}"#,
            r#"{"idempotencyKey":"k","subject":"s","route":"r","units":1,"extra":1}"#,
            r#"{"idempotencyKey":"k","subject":"s","route":"r","units":1,"request":{"a":1,"a":2}}"#,
            r#"{"idempotencyKey":"k","legs":[{"subject":"s","route":"r","units":2,"x":1}]}"#,
            r#"{"idempotencyKey":"k","subject":"s","route":"r","units":1.5}"#,
            r#"{"idempotencyKey":"k","subject":"s","route":"r","units":1} trailing"#,
            r#"{"idempotencyKey":"k","subject":"s","route":"r","units":1"#,
            // A struct reads from an array too: only objects are bodies.
            r#"["k","s","r",1]"#,
            r#""k""#,
            "",
            "{}",
        ];
        for body in bodies {
            assert_eq!(
                format!(
                    "{:?}",
                    parse_strict::<ReserveBody>(body.as_bytes(), RESERVE_FIELDS)
                ),
                format!(
                    "{:?}",
                    parse_naming_the_fault::<ReserveBody>(body.as_bytes(), RESERVE_FIELDS)
                ),
                "{body}"
            );
        }
        for body in [
            r#"{"operationId":"a"}"#,
            r#"{"operationId":"a","actualUnits":3}"#,
            r#"{"operationId":"a","other":1}"#,
        ] {
            let fields = &["operationId"];
            assert_eq!(
                format!("{:?}", parse_strict::<StartBody>(body.as_bytes(), fields)),
                format!(
                    "{:?}",
                    parse_naming_the_fault::<StartBody>(body.as_bytes(), fields)
                ),
                "{body}"
            );
        }
        // A type that takes any member: the fields asked for still bound it.
        for body in ["{}", r#"{"x":1}"#] {
            assert_eq!(
                format!(
                    "{:?}",
                    parse_strict::<serde_json::Map<String, Value>>(body.as_bytes(), &[])
                ),
                format!(
                    "{:?}",
                    parse_naming_the_fault::<serde_json::Map<String, Value>>(body.as_bytes(), &[])
                ),
                "{body}"
            );
        }
    }

    #[test]
    fn the_walk_finds_the_first_repeated_or_unknown_member() {
        let fields: &[&str] = &["a", "b"];
        let cases = [
            (r#"{"a":1,"b":{"a":1}}"#, None),
            (
                r#"{"a":1,"a":2}"#,
                Some(Offending::Repeated("a".to_owned())),
            ),
            (
                r#"{"b":[{"c":1,"c":1}]}"#,
                Some(Offending::Repeated("b[0].c".to_owned())),
            ),
            (r#"{"a":1,"c":1}"#, Some(Offending::Unknown("c".to_owned()))),
            (r#"{"a":1,"#, Some(Offending::Unreadable)),
        ];
        for (body, found) in cases {
            assert_eq!(
                first_offending_member(body.as_bytes(), Some(fields)),
                found,
                "{body}"
            );
        }
        // Without fields, any member name is known.
        assert_eq!(first_offending_member(br#"{"c":1}"#, None), None);
    }

    /// The walk lists the first names of an object and hashes the rest: a
    /// repeat is found either side of that boundary, and an object of
    /// more distinct members than it lists passes.
    #[test]
    fn a_repeat_is_found_among_listed_and_hashed_names() {
        let object = |names: &[String]| {
            let members: Vec<String> = names.iter().map(|name| format!("\"{name}\":1")).collect();
            format!("{{{}}}", members.join(","))
        };
        let distinct: Vec<String> = (0..MEMBERS_LISTED_MAX + 2)
            .map(|index| format!("m{index}"))
            .collect();
        assert_eq!(
            first_offending_member(object(&distinct).as_bytes(), None),
            None
        );
        for repeated in [
            0,
            MEMBERS_LISTED_MAX - 1,
            MEMBERS_LISTED_MAX,
            MEMBERS_LISTED_MAX + 1,
        ] {
            let mut names = distinct.clone();
            names.push(distinct[repeated].clone());
            assert_eq!(
                first_offending_member(object(&names).as_bytes(), None),
                Some(Offending::Repeated(distinct[repeated].clone())),
                "member {repeated} again"
            );
        }
    }

    /// serde_json keeps the last of two equal members; the center refuses
    /// them, so the agent does too, naming the member, at any depth.
    #[test]
    fn a_member_twice_is_refused_and_named() {
        let cases: &[(&str, &str)] = &[
            (
                r#"{"idempotencyKey":"k","subject":"s","route":"r","units":1,"units":900}"#,
                "units",
            ),
            (
                r#"{"idempotencyKey":"k","subject":"s","route":"r","units":1,"request":{"a":[{"b":1,"b":2}]}}"#,
                "request.a[0].b",
            ),
            (
                r#"{"idempotencyKey":"k","subject":"s","route":"r","units":1,"request":{"a":[[1,{"c":1,"c":2}]]}}"#,
                "request.a[0][1].c",
            ),
            // An escaped name is the same name.
            (
                r#"{"idempotencyKey":"k","subject":"s","route":"r","units":1,"request":{"\u0062":1,"b":2}}"#,
                "request.b",
            ),
        ];
        for (body, field) in cases {
            let refusal = parse_reserve(body.as_bytes()).expect_err(body);
            let response = refusal.into_response();
            assert_eq!(response.status(), StatusCode::BAD_REQUEST, "{body}");
            let answer = futures_body(response);
            assert_eq!(answer["error"], "invalid_body", "{body}");
            assert_eq!(answer["field"], *field, "{body}");
            assert!(
                answer["message"]
                    .as_str()
                    .is_some_and(|message| message.contains("more than once")),
                "{answer}"
            );
        }
        // The same members once each, and equal names in different objects,
        // pass.
        let once = r#"{"idempotencyKey":"k","subject":"s","route":"r","units":1,"request":{"units":2,"a":{"units":3}}}"#;
        let reserve = parse_reserve(once.as_bytes()).expect("no duplicate");
        assert_eq!(reserve.units, 1);
        assert_eq!(
            field_of(parse_empty(br#"{"x":1,"x":1}"#).expect_err("duplicate")),
            (StatusCode::BAD_REQUEST, "x".to_owned())
        );
        assert_eq!(
            field_of(
                parse_strict::<StartBody>(
                    br#"{"operationId":"a","operationId":"b"}"#,
                    &["operationId"]
                )
                .expect_err("duplicate")
            ),
            (StatusCode::BAD_REQUEST, "operationId".to_owned())
        );
    }
}
