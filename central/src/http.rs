//! The HTTP shell: parse and authenticate, send one [`Operation`] to the
//! writer, and write the wire form of its [`Reply`]
//! ([`Reply::into_answer`], the ledger protocol's one mapping of outcomes to
//! statuses, codes and bodies) as a response (docs/design.md §6.3). A batch
//! (`POST /v1/batch`) is the same per operation: one function per
//! reservation call builds its operation from the caller, the reservation
//! and the body, and [`Sent::answer`] logs and counts every answer, so a
//! call alone and a call in a batch are parsed, owned, counted and
//! answered alike. No decision is taken here.

use std::borrow::Cow;
use std::collections::HashSet;
use std::sync::{Arc, RwLock};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, PathRejection};
use axum::extract::{DefaultBodyLimit, FromRequestParts, Path, State};
use axum::http::header::{AUTHORIZATION, CONTENT_TYPE, RETRY_AFTER};
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use central_client::http_signature::{self, SignatureRefusal};
use central_client::wire::{
    AbandonBody, AdmissionBody, BATCH_BODY_SIZE_MAX, BATCH_OPERATIONS_MAX, BatchOp, BootBody,
    EmptyBody, FreezeBody, IssueShardBody, OUTCOME_HEADER, ReserveBody, SettleBody, StartBody,
    WOULD_REJECT_HEADER,
};
use ledger::protocol::{About, Answer, Answered, Body, ErrorCode, Operation, Refusal, Reply};
use ledger::{AbandonRequest, Caller, IssueShardRequest, PairKey};
use serde_json::value::RawValue;
use shard_format::limits::DOCUMENT_SIZE_MAX;
use shard_format::{
    AdmissionBudgetV1, BootNonce, Document, GatewayIdentity, KeyId, MemberName, ReservationId,
    Route, ShardId, ShardTerminalReceiptV1, Subject,
};

use crate::keys::GatewayKeys;
use crate::metrics::Metrics;
use crate::writer::{LedgerHandle, Unavailable};

/// Largest request body: one document.
pub const BODY_SIZE_MAX: usize = DOCUMENT_SIZE_MAX;

/// What every handler shares.
#[derive(Debug, Clone)]
pub(crate) struct AppState {
    pub ledger: LedgerHandle,
    pub operator_token: Arc<str>,
    /// Identities known to be enrolled (enrolment is never revoked).
    pub enrolled: Arc<RwLock<HashSet<KeyId>>>,
    pub metrics: Arc<Metrics>,
    /// Signature nonces seen while they could still verify: a replayed
    /// agent call is refused.
    pub replays: Arc<std::sync::Mutex<http_signature::ReplayGuard>>,
    /// Enrolled identities' keys, decompressed once.
    pub gateway_keys: GatewayKeys,
}

pub(crate) fn router(state: AppState) -> Router {
    Router::new()
        .route("/healthz", get(health))
        .route("/metrics", get(metrics))
        .route("/openapi.json", get(openapi))
        .route("/v1/policies", put(publish_policy))
        .route("/v1/reservations", post(reserve))
        .route("/v1/reservations/{reservation}", get(get_reservation))
        .route("/v1/reservations/{reservation}/start", post(start))
        .route("/v1/reservations/{reservation}/settle", post(settle))
        .route("/v1/reservations/{reservation}/release", post(release))
        .route("/v1/reservations/{reservation}/abandon", post(abandon))
        .route("/v1/batch", post(batch).layer(batch_body_limit()))
        .route("/v1/accounts/{subject}/{route}", get(accounts))
        .route("/v1/accounts/{subject}/{route}/admission", post(admission))
        .route("/v1/accounts/{subject}/{route}/freeze", post(freeze))
        .route("/v1/audit", get(audit))
        .route("/v1/gateways/{identity}", put(enroll))
        .route("/v1/gateways/{identity}/boot", post(boot))
        .route("/v1/shards", post(issue_shard))
        .route("/v1/shards/{shard}/receipt", post(reconcile))
        // After every route: it applies to the routes registered before it.
        .method_not_allowed_fallback(method_not_allowed)
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(BODY_SIZE_MAX))
        .with_state(state)
}

/// A batch's body may be larger than one document's.
fn batch_body_limit() -> DefaultBodyLimit {
    DefaultBodyLimit::max(BATCH_BODY_SIZE_MAX)
}

// ----- answers -----

/// An error answer: the ledger protocol's [`Refusal`] as a response.
#[derive(Debug)]
pub(crate) struct ApiError(Box<Refusal>);

impl ApiError {
    fn new(status: StatusCode, code: ErrorCode, message: impl Into<String>) -> Self {
        Self(Box::new(Refusal::new(status.as_u16(), code, message)))
    }

    fn bad_request(code: ErrorCode, field: &str, message: impl Into<String>) -> Self {
        Self(Box::new(Refusal::bad_request(code, field, message)))
    }

    fn unauthorized(code: ErrorCode, message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, code, message)
    }
}

impl From<Refusal> for ApiError {
    fn from(refusal: Refusal) -> Self {
        Self(Box::new(refusal))
    }
}

/// Logs the security event of a refusal about to be answered (alone or
/// as a batch's result): every 403, wherever it was decided (the shell or
/// the ledger), is a caller acting for another identity.
fn log_refusal(refusal: &Refusal) {
    if refusal.status == StatusCode::FORBIDDEN.as_u16() {
        tracing::warn!(
            event = "call_forbidden",
            code = refusal.error.as_str(),
            detail = %refusal.message,
            "security event: a call was refused"
        );
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let refusal = *self.0;
        log_refusal(&refusal);
        let status =
            StatusCode::from_u16(refusal.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut headers = HeaderMap::new();
        if let Some(seconds) = refusal.details.retry_after_seconds {
            headers.insert(RETRY_AFTER, HeaderValue::from(seconds));
        }
        if let Some(rejection) = refusal.rejection()
            && let Some(state) = rejection.rate_limit
        {
            let fields = [
                ("ratelimit-policy", state.policy_field()),
                (
                    "ratelimit",
                    state.limit_field(rejection.retry_after_seconds),
                ),
            ];
            for (name, value) in fields {
                if let Ok(value) = HeaderValue::from_str(&value) {
                    headers.insert(HeaderName::from_static(name), value);
                }
            }
        }
        (status, headers, axum::Json(refusal)).into_response()
    }
}

impl From<Unavailable> for ApiError {
    fn from(why: Unavailable) -> Self {
        let code = match why {
            Unavailable::CommitFailed => ErrorCode::CommitFailed,
            Unavailable::Stopped => ErrorCode::Unavailable,
        };
        Self::new(StatusCode::SERVICE_UNAVAILABLE, code, why.to_string())
    }
}

impl From<BytesRejection> for ApiError {
    fn from(rejection: BytesRejection) -> Self {
        let status = rejection.status();
        if status == StatusCode::PAYLOAD_TOO_LARGE {
            Self::new(
                status,
                ErrorCode::BodyTooLarge,
                format!(
                    "the request body is above {BODY_SIZE_MAX} bytes ({BATCH_BODY_SIZE_MAX} for a batch)"
                ),
            )
        } else {
            Self::new(
                StatusCode::BAD_REQUEST,
                ErrorCode::UnreadableBody,
                rejection.body_text(),
            )
        }
    }
}

impl From<PathRejection> for ApiError {
    fn from(rejection: PathRejection) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            ErrorCode::InvalidPath,
            format!("a path segment cannot be read: {}", rejection.body_text()),
        )
    }
}

/// The path's segments, or a 400 `invalid_path` in the error contract's
/// shape when one does not decode (broken percent-encoding, not UTF-8):
/// axum's own [`Path`] would answer plain text.
pub(crate) struct Segments<T>(pub T);

impl<T, S> FromRequestParts<S> for Segments<T>
where
    T: serde::de::DeserializeOwned + Send,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &S,
    ) -> Result<Self, Self::Rejection> {
        let Path(segments) = Path::<T>::from_request_parts(parts, state).await?;
        Ok(Self(segments))
    }
}

type Handled = Result<Response, ApiError>;

/// A successful answer as a response: the status, the outcome header, and
/// the body ([`body_bytes`]).
fn respond(answered: Answered) -> Response {
    let status = StatusCode::from_u16(answered.status).unwrap_or(StatusCode::OK);
    let mut headers = HeaderMap::new();
    headers.insert(
        HeaderName::from_static(OUTCOME_HEADER),
        HeaderValue::from_static(answered.outcome.as_str()),
    );
    if let Some(dimension) = answered.would_reject {
        headers.insert(
            HeaderName::from_static(WOULD_REJECT_HEADER),
            HeaderValue::from_static(dimension.as_str()),
        );
    }
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    (status, headers, body_bytes(&answered.body)).into_response()
}

/// A successful answer's body: v1 documents as their canonical bytes, the
/// other bodies as JSON.
fn body_bytes(body: &Body) -> Vec<u8> {
    fn json<T: serde::Serialize>(value: &T) -> Vec<u8> {
        serde_json::to_vec(value).expect("answer bodies serialize")
    }
    match body {
        Body::Reservation(receipt) => shard_format::canonical_bytes(receipt.as_ref()),
        Body::Settlement(receipt) => shard_format::canonical_bytes(receipt.as_ref()),
        Body::Shard(shard) => shard_format::canonical_bytes(shard.as_ref()),
        Body::NotEnforced(body) => json(body),
        Body::Published(body) => json(body),
        Body::Enrolled(body) => json(body),
        Body::RouteControl(body) => json(body),
        Body::Abandon(body) => json(body),
        Body::Boot(body) => json(body),
        Body::Reconciled(body) => json(body),
        Body::Accounts(body) => json(body),
        Body::Audit(body) => json(body),
    }
}

/// What the shell counts and logs of an answer, by the operation it
/// answers: the same for a single call and a batch's operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Counted {
    Reservation,
    Settlement,
    Other,
}

impl Counted {
    fn of(operation: &Operation) -> Self {
        match operation {
            Operation::Reserve(_) => Self::Reservation,
            Operation::Settle { .. } => Self::Settlement,
            _ => Self::Other,
        }
    }
}

/// An operation on its way to the writer: what its answer needs.
struct Sent {
    about: About,
    counted: Counted,
}

impl Sent {
    fn of(operation: &Operation) -> Self {
        Self {
            about: operation.about(),
            counted: Counted::of(operation),
        }
    }

    /// The wire form of the writer's `reply`, with its security event and
    /// its counters.
    fn answer(self, metrics: &Metrics, reply: Reply) -> Answer {
        if let Reply::NotOwner {
            reservation,
            caller,
        } = &reply
        {
            tracing::warn!(event = "not_owner", %reservation, %caller,
                "security event: a call named a reservation the caller does not own");
        }
        let answer = reply.into_answer(&self.about);
        match (self.counted, &answer) {
            (Counted::Reservation, Ok(answered)) => metrics.count_reservation(
                answered.outcome.as_str(),
                answered
                    .would_reject
                    .map_or("", |dimension| dimension.as_str()),
            ),
            (Counted::Reservation, Err(refusal)) => match refusal.rejection() {
                Some(rejection) => {
                    metrics.count_reservation("rejected", rejection.dimension.as_str());
                }
                None => metrics.count_reservation(refusal.error.as_str(), ""),
            },
            (Counted::Settlement, Ok(answered)) => {
                if let Body::Settlement(receipt) = &answered.body {
                    // Only a first settlement refunds; a duplicate or a
                    // correction reports what moved before.
                    let refunded = match answered.outcome {
                        ledger::protocol::Outcome::Settled => receipt.refunded_units,
                        _ => 0,
                    };
                    metrics.count_settlement(answered.outcome.as_str(), refunded);
                }
            }
            _ => {}
        }
        answer
    }
}

/// Sends `operation` to the writer and returns the wire form of its reply.
async fn call(state: &AppState, operation: Operation) -> Result<Answer, ApiError> {
    let sent = Sent::of(&operation);
    let reply = state.ledger.call(operation).await?;
    Ok(sent.answer(&state.metrics, reply))
}

/// [`call`], as a response.
async fn answer(state: &AppState, operation: Operation) -> Handled {
    Ok(respond(call(state, operation).await??))
}

// ----- parsing -----

/// Parses a body strictly ([`shard_format::parse`]): 400 naming the field.
fn parse_body<D: Document>(body: &[u8]) -> Result<D, ApiError> {
    shard_format::parse(body).map_err(|error| {
        ApiError::bad_request(ErrorCode::InvalidBody, &error.field, error.to_string())
    })
}

/// An empty body, or `{}`.
fn parse_empty(body: &[u8]) -> Result<(), ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(());
    }
    parse_body::<EmptyBody>(body).map(|_| ())
}

fn path_value<T: std::str::FromStr<Err = shard_format::ValueError>>(
    name: &str,
    value: &str,
) -> Result<T, ApiError> {
    value.parse().map_err(|error: shard_format::ValueError| {
        ApiError::bad_request(
            ErrorCode::InvalidPath,
            name,
            format!("path segment `{name}` {error}"),
        )
    })
}

fn pair_from_path(subject: &str, route: &str) -> Result<PairKey, ApiError> {
    Ok(PairKey::new(
        path_value::<Subject>("subject", subject)?,
        path_value::<Route>("route", route)?,
    ))
}

// ----- authentication -----

fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|value| value.to_str().ok())
}

/// Constant-time comparison of two byte strings.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |diff, (x, y)| diff | (x ^ y)) == 0
}

impl AppState {
    fn operator(&self, headers: &HeaderMap) -> Result<(), ApiError> {
        let token = header(headers, AUTHORIZATION.as_str())
            .and_then(|value| value.strip_prefix("Bearer "))
            .ok_or_else(|| {
                security_event(
                    "operator_token_missing",
                    "an operator call came without a token",
                );
                ApiError::unauthorized(
                    ErrorCode::OperatorTokenRequired,
                    "this is an operator call: send Authorization: Bearer <operator token>",
                )
            })?;
        if same_secret(token.trim().as_bytes(), self.operator_token.as_bytes()) {
            Ok(())
        } else {
            security_event(
                "operator_token_refused",
                "an operator call's token does not match",
            );
            Err(ApiError::unauthorized(
                ErrorCode::OperatorTokenInvalid,
                "the operator token does not match",
            ))
        }
    }

    async fn is_enrolled(&self, identity: &KeyId) -> Result<bool, ApiError> {
        if self
            .enrolled
            .read()
            .unwrap_or_else(|poison| poison.into_inner())
            .contains(identity)
        {
            return Ok(true);
        }
        let known = match self
            .ledger
            .call(Operation::IsEnrolled(identity.clone()))
            .await?
        {
            Reply::IsEnrolled(known) => known,
            other => return Err(unexpected(&other)),
        };
        if known {
            self.remember_enrolled(identity.clone());
        }
        Ok(known)
    }

    fn remember_enrolled(&self, identity: KeyId) {
        self.enrolled
            .write()
            .unwrap_or_else(|poison| poison.into_inner())
            .insert(identity);
    }

    /// Verifies an agent call's signature; returns the caller's identity.
    async fn agent(
        &self,
        method: &Method,
        uri: &Uri,
        headers: &HeaderMap,
        body: &[u8],
    ) -> Result<KeyId, ApiError> {
        let refused = |refusal: SignatureRefusal| {
            let status = match refusal {
                SignatureRefusal::DigestMismatch => StatusCode::BAD_REQUEST,
                _ => StatusCode::UNAUTHORIZED,
            };
            let event = match refusal {
                SignatureRefusal::Replayed => "signature_replayed",
                _ => "signature_refused",
            };
            security_event(event, &refusal.to_string());
            ApiError::new(status, ErrorCode::SignatureInvalid, refusal.to_string())
        };
        let parsed = http_signature::parse(
            header(headers, http_signature::CONTENT_DIGEST),
            header(headers, http_signature::SIGNATURE_INPUT),
            header(headers, http_signature::SIGNATURE),
        )
        .map_err(refused)?;
        if !self.is_enrolled(&parsed.key_id).await? {
            tracing::warn!(event = "unknown_identity", identity = %parsed.key_id,
                "a signed call from an identity that is not enrolled");
            return Err(ApiError::unauthorized(
                ErrorCode::UnknownIdentity,
                format!(
                    "identity {} is not enrolled; an operator enrols it with PUT /v1/gateways/{}",
                    parsed.key_id, parsed.key_id
                ),
            ));
        }
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |elapsed| elapsed.as_secs());
        let key = self
            .gateway_keys
            .key(&parsed.key_id)
            .map_err(|_| refused(SignatureRefusal::BadSignature(parsed.key_id.clone())))?;
        parsed
            .verify_under(&key, method.as_str(), uri.path(), body, now)
            .map_err(refused)?;
        self.replays
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .admit(&parsed, now)
            .map_err(refused)?;
        Ok(parsed.key_id)
    }

    /// The caller of an endpoint both the operator and agents may call: the
    /// operator when the call carries `Authorization` (and the token
    /// matches), else the agent whose signature verifies.
    async fn caller(
        &self,
        method: &Method,
        uri: &Uri,
        headers: &HeaderMap,
        body: &[u8],
    ) -> Result<Caller, ApiError> {
        if headers.contains_key(AUTHORIZATION) {
            self.operator(headers)?;
            return Ok(Caller::Operator);
        }
        let identity = self.agent(method, uri, headers, body).await?;
        Ok(Caller::Gateway(identity))
    }
}

/// Logs a refused credential under a stable event name operators alert on.
fn security_event(event: &'static str, detail: &str) {
    tracing::warn!(event, detail, "security event: a call was refused");
}

/// A reply the operation could not have produced: a bug in the shell.
fn unexpected(reply: &Reply) -> ApiError {
    tracing::error!(
        ?reply,
        "the writer answered an operation with another's reply"
    );
    Refusal::internal("the service answered inconsistently; this is a bug").into()
}

// ----- agent operations -----
//
// One function per reservation call turns the caller, the reservation of
// the path and the body into its operation, for the single call and for a
// batch's operation alike.

/// `POST /v1/reservations`: the body names the reservation; the owner is
/// the signer, never the body.
fn reserve_operation(caller: GatewayIdentity, body: &[u8]) -> Result<Operation, ApiError> {
    let request: ReserveBody = parse_body(body)?;
    Ok(Operation::Reserve(request.into_request(caller)))
}

/// `GET /v1/reservations/{reservation}`.
fn get_operation(caller: Caller, reservation: ReservationId) -> Operation {
    Operation::GetReservation {
        reservation,
        caller,
    }
}

/// `POST /v1/reservations/{reservation}/start`.
fn start_operation(
    caller: GatewayIdentity,
    reservation: ReservationId,
    body: &[u8],
) -> Result<Operation, ApiError> {
    let body: StartBody = parse_body(body)?;
    Ok(Operation::Start {
        reservation,
        operation_id: body.operation_id,
        deadline_ms: body.deadline_ms,
        caller,
    })
}

/// `POST /v1/reservations/{reservation}/settle`.
fn settle_operation(
    caller: GatewayIdentity,
    reservation: ReservationId,
    body: &[u8],
) -> Result<Operation, ApiError> {
    let body: SettleBody = parse_body(body)?;
    Ok(Operation::Settle {
        reservation,
        actuals: body.actuals(),
        operation_id: body.operation_id,
        caller,
    })
}

/// `POST /v1/reservations/{reservation}/release`: empty or `{}`.
fn release_operation(
    caller: GatewayIdentity,
    reservation: ReservationId,
    body: &[u8],
) -> Result<Operation, ApiError> {
    parse_empty(body)?;
    Ok(Operation::Release {
        reservation,
        caller,
    })
}

/// `POST /v1/reservations/{reservation}/abandon`: an agent names what the
/// ID was derived from; the operator sends nothing.
fn abandon_operation(
    caller: Caller,
    reservation: ReservationId,
    body: &[u8],
) -> Result<Operation, ApiError> {
    let origin = match caller {
        Caller::Operator => {
            parse_empty(body)?;
            None
        }
        Caller::Gateway(_) => Some(parse_body::<AbandonBody>(body)?.into()),
    };
    Ok(Operation::Abandon(AbandonRequest {
        reservation,
        caller,
        origin,
    }))
}

// ----- batches -----

/// A batch body as read before its operations are: each operation's raw
/// JSON, parsed on its own.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct BatchEnvelope<'a> {
    #[serde(borrow)]
    operations: Vec<&'a RawValue>,
}

/// The operations of a batch body: 400 `invalid_body` naming `operations`
/// (or the member at fault) unless it is `{"operations": [...]}` with 1 to
/// [`BATCH_OPERATIONS_MAX`] of them.
fn batch_operations(body: &[u8]) -> Result<Vec<&RawValue>, ApiError> {
    let envelope: BatchEnvelope<'_> = serde_json::from_slice(body).map_err(|error| {
        let message = error.to_string();
        let field = message
            .strip_prefix("unknown field `")
            .and_then(|rest| rest.split_once('`'))
            .map_or("operations", |(field, _)| field);
        let field = if error.is_data() { field } else { "" };
        ApiError::bad_request(
            ErrorCode::InvalidBody,
            field,
            format!("a batch is {{\"operations\": [...]}}: {message}"),
        )
    })?;
    let count = envelope.operations.len();
    if count == 0 {
        return Err(ApiError::bad_request(
            ErrorCode::InvalidBody,
            "operations",
            "field `operations`: a batch carries at least one operation",
        ));
    }
    if count > BATCH_OPERATIONS_MAX {
        return Err(ApiError::bad_request(
            ErrorCode::InvalidBody,
            "operations",
            format!(
                "field `operations`: {count} operations; a batch carries at most {BATCH_OPERATIONS_MAX}, send the rest in another"
            ),
        ));
    }
    Ok(envelope.operations)
}

/// A JSON object's members in order, each as its raw JSON borrowed from
/// the operation's text (a name is copied only when it has escapes); a
/// duplicate member is refused.
#[derive(Debug)]
struct Members<'a>(Vec<(Cow<'a, str>, &'a RawValue)>);

impl<'de> serde::Deserialize<'de> for Members<'de> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = Members<'de>;

            fn expecting(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                formatter.write_str("a JSON object")
            }

            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<Members<'de>, A::Error> {
                let mut members = Vec::new();
                while let Some(name) = map.next_key_seed(MemberName)? {
                    members.push((name, map.next_value()?));
                }
                // Sorted rather than hashed: an operation has a handful of
                // members, and sorting stays O(n log n) for one that has
                // thousands.
                let mut names: Vec<&str> = members.iter().map(|(name, _)| name.as_ref()).collect();
                names.sort_unstable();
                if let Some(pair) = names.windows(2).find(|pair| pair[0] == pair[1]) {
                    return Err(serde::de::Error::custom(format_args!(
                        "duplicate field `{}`",
                        pair[0]
                    )));
                }
                Ok(Members(members))
            }
        }
        deserializer.deserialize_map(Visitor)
    }
}

impl<'a> Members<'a> {
    fn take(&mut self, name: &str) -> Option<&'a RawValue> {
        let index = self.0.iter().position(|(member, _)| member == name)?;
        Some(self.0.remove(index).1)
    }

    /// The members left, as a JSON object's bytes, written into room for
    /// `room` bytes (the operation's length, which they do not exceed).
    fn into_body(self, room: usize) -> Vec<u8> {
        let mut body = Vec::with_capacity(room);
        body.push(b'{');
        for (index, (name, value)) in self.0.iter().enumerate() {
            if index > 0 {
                body.push(b',');
            }
            serde_json::to_writer(&mut body, name).expect("a string serializes");
            body.push(b':');
            body.extend_from_slice(value.get().as_bytes());
        }
        body.push(b'}');
        body
    }
}

/// One operation of a batch, parsed as strictly as its single call: `op`,
/// then `reservation` (the single call's path) where the call names one,
/// then the other members as the single call's body. A refusal names the
/// field within the operation.
fn batch_operation(caller: &GatewayIdentity, item: &RawValue) -> Result<Operation, ApiError> {
    let invalid = |field: &str, message: String| {
        ApiError::bad_request(
            ErrorCode::InvalidBody,
            field,
            format!("field `{field}`: {message}"),
        )
    };
    let mut members: Members<'_> = serde_json::from_str(item.get()).map_err(|error| {
        ApiError::bad_request(
            ErrorCode::InvalidBody,
            "",
            format!("an operation is a JSON object of its `op` and its call's members: {error}"),
        )
    })?;
    let known = || {
        BatchOp::ALL
            .iter()
            .map(|op| serde_json::to_string(op).expect("a name serializes"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let op: BatchOp = match members.take("op") {
        Some(op) => serde_json::from_str(op.get())
            .map_err(|_| invalid("op", format!("{} is not one of {}", op.get(), known())))?,
        None => return Err(invalid("op", format!("is required: one of {}", known()))),
    };
    let reservation = if op.names_reservation() {
        let raw = members
            .take("reservation")
            .ok_or_else(|| invalid("reservation", "is required".to_owned()))?;
        let reservation: ReservationId = serde_json::from_str(raw.get())
            .map_err(|error| invalid("reservation", error.to_string()))?;
        Some(reservation)
    } else {
        None
    };
    let body = members.into_body(item.get().len());
    let caller = caller.clone();
    match (op, reservation) {
        (BatchOp::Reserve, _) => reserve_operation(caller, &body),
        (BatchOp::GetReservation, Some(reservation)) => {
            parse_empty(&body)?;
            Ok(get_operation(Caller::Gateway(caller), reservation))
        }
        (BatchOp::Start, Some(reservation)) => start_operation(caller, reservation, &body),
        (BatchOp::Settle, Some(reservation)) => settle_operation(caller, reservation, &body),
        (BatchOp::Release, Some(reservation)) => release_operation(caller, reservation, &body),
        (BatchOp::Abandon, Some(reservation)) => {
            abandon_operation(Caller::Gateway(caller), reservation, &body)
        }
        (_, None) => Err(Refusal::internal("a batch operation lost its reservation").into()),
    }
}

/// Appends one result of a batch: `{status, outcome, wouldReject?, body}`
/// for an answer, `{status, body}` for a refusal (its security event
/// logged as the single call's would be).
fn write_result(out: &mut Vec<u8>, answer: &Answer) {
    match answer {
        Ok(answered) => {
            out.extend_from_slice(
                format!(
                    "{{\"status\":{},\"outcome\":\"{}\"",
                    answered.status,
                    answered.outcome.as_str()
                )
                .as_bytes(),
            );
            if let Some(dimension) = answered.would_reject {
                out.extend_from_slice(
                    format!(",\"wouldReject\":\"{}\"", dimension.as_str()).as_bytes(),
                );
            }
            out.extend_from_slice(b",\"body\":");
            out.extend_from_slice(&body_bytes(&answered.body));
        }
        Err(refusal) => {
            log_refusal(refusal);
            out.extend_from_slice(format!("{{\"status\":{},\"body\":", refusal.status).as_bytes());
            serde_json::to_writer(&mut *out, refusal).expect("a refusal serializes");
        }
    }
    out.push(b'}');
}

// ----- handlers -----

async fn health() -> &'static str {
    "ok\n"
}

/// `GET /openapi.json`: the API's OpenAPI 3.1 document (no credentials).
async fn openapi() -> Response {
    static DOCUMENT: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    let text = DOCUMENT.get_or_init(crate::openapi::document_text);
    (
        [(CONTENT_TYPE, HeaderValue::from_static("application/json"))],
        text.as_str(),
    )
        .into_response()
}

/// A known path called with a method it does not answer; axum adds the
/// `Allow` header naming the methods it does.
async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        ErrorCode::MethodNotAllowed,
        format!(
            "{} does not answer {method}; the Allow header names the methods it does",
            uri.path()
        ),
    )
}

async fn not_found(uri: Uri) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        ErrorCode::NoSuchEndpoint,
        format!("no endpoint at {}", uri.path()),
    )
}

/// `GET /metrics`, behind the operator token: the counters and gauges name
/// every subject's and route's traffic and debt.
async fn metrics(State(state): State<AppState>, headers: HeaderMap) -> Response {
    if let Err(refused) = state.operator(&headers) {
        return refused.into_response();
    }
    let gauges = match state.ledger.call(Operation::Gauges).await {
        Ok(Reply::Gauges(gauges)) => Some(gauges),
        _ => None,
    };
    (
        [(
            CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4"),
        )],
        state.metrics.render(gauges),
    )
        .into_response()
}

async fn publish_policy(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Handled {
    state.operator(&headers)?;
    let policy: AdmissionBudgetV1 = parse_body(&body?)?;
    let answered = call(&state, Operation::Publish(Box::new(policy))).await??;
    if let Body::Published(published) = &answered.body {
        tracing::info!(subject = %published.subject, route = %published.route,
            generation = published.policy_generation, "policy published");
    }
    Ok(respond(answered))
}

async fn enroll(
    State(state): State<AppState>,
    Segments(identity): Segments<String>,
    headers: HeaderMap,
) -> Handled {
    state.operator(&headers)?;
    let identity: KeyId = path_value("identity", &identity)?;
    if !identity.is_usable_ed25519_key() {
        return Err(ApiError::bad_request(
            ErrorCode::InvalidPath,
            "identity",
            "a gateway identity is ed25519:<64 lowercase hex digits of a public key on the curve, not of small order>",
        ));
    }
    let answered = call(&state, Operation::Enroll(identity.clone())).await??;
    state.remember_enrolled(identity);
    Ok(respond(answered))
}

async fn admission(
    State(state): State<AppState>,
    Segments((subject, route)): Segments<(String, String)>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Handled {
    state.operator(&headers)?;
    let pair = pair_from_path(&subject, &route)?;
    let body: AdmissionBody = parse_body(&body?)?;
    tracing::info!(%subject, %route, generation = body.policy_generation,
        stopped = body.stopped, "admission control");
    let operation = Operation::SetAdmissionStopped {
        pair,
        generation: body.policy_generation,
        stopped: body.stopped,
    };
    answer(&state, operation).await
}

async fn freeze(
    State(state): State<AppState>,
    Segments((subject, route)): Segments<(String, String)>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Handled {
    state.operator(&headers)?;
    let pair = pair_from_path(&subject, &route)?;
    let body: FreezeBody = parse_body(&body?)?;
    tracing::info!(%subject, %route, frozen = body.frozen, "freeze control");
    let operation = Operation::SetFrozen {
        pair,
        frozen: body.frozen,
    };
    answer(&state, operation).await
}

async fn accounts(
    State(state): State<AppState>,
    Segments((subject, route)): Segments<(String, String)>,
    headers: HeaderMap,
) -> Handled {
    state.operator(&headers)?;
    let pair = pair_from_path(&subject, &route)?;
    answer(&state, Operation::GetAccounts(pair)).await
}

async fn audit(State(state): State<AppState>, headers: HeaderMap) -> Handled {
    state.operator(&headers)?;
    let answered = call(&state, Operation::Audit).await??;
    if let Body::Audit(report) = &answered.body
        && !report.ok
    {
        tracing::error!(
            violations = report.violations.len(),
            "the audit found drift"
        );
    }
    Ok(respond(answered))
}

async fn reserve(
    State(state): State<AppState>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Handled {
    let body = body?;
    let caller = state.agent(&method, &uri, &headers, &body).await?;
    answer(&state, reserve_operation(caller, &body)?).await
}

async fn get_reservation(
    State(state): State<AppState>,
    Segments(reservation): Segments<String>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
) -> Handled {
    let caller = state.caller(&method, &uri, &headers, b"").await?;
    let reservation: ReservationId = path_value("reservation", &reservation)?;
    answer(&state, get_operation(caller, reservation)).await
}

async fn start(
    State(state): State<AppState>,
    Segments(reservation): Segments<String>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Handled {
    let body = body?;
    let caller = state.agent(&method, &uri, &headers, &body).await?;
    let reservation: ReservationId = path_value("reservation", &reservation)?;
    answer(&state, start_operation(caller, reservation, &body)?).await
}

async fn settle(
    State(state): State<AppState>,
    Segments(reservation): Segments<String>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Handled {
    let body = body?;
    let caller = state.agent(&method, &uri, &headers, &body).await?;
    let reservation: ReservationId = path_value("reservation", &reservation)?;
    answer(&state, settle_operation(caller, reservation, &body)?).await
}

async fn release(
    State(state): State<AppState>,
    Segments(reservation): Segments<String>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Handled {
    let body = body?;
    let caller = state.agent(&method, &uri, &headers, &body).await?;
    let reservation: ReservationId = path_value("reservation", &reservation)?;
    answer(&state, release_operation(caller, reservation, &body)?).await
}

async fn abandon(
    State(state): State<AppState>,
    Segments(reservation): Segments<String>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Handled {
    let body = body?;
    let caller = state.caller(&method, &uri, &headers, &body).await?;
    let reservation: ReservationId = path_value("reservation", &reservation)?;
    answer(&state, abandon_operation(caller, reservation, &body)?).await
}

async fn boot(
    State(state): State<AppState>,
    Segments(identity): Segments<String>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Handled {
    let body = body?;
    let caller = state.agent(&method, &uri, &headers, &body).await?;
    let identity: KeyId = path_value("identity", &identity)?;
    if identity != caller {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            ErrorCode::WrongIdentity,
            format!("{caller} cannot register a boot of {identity}"),
        ));
    }
    let request: BootBody = parse_body(&body)?;
    let mut nonce = [0u8; 16];
    getrandom::fill(&mut nonce).map_err(|error| {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            ErrorCode::Unavailable,
            format!("no randomness for a boot nonce: {error}"),
        )
    })?;
    let operation = Operation::Register {
        identity: identity.clone(),
        boot_nonce: BootNonce(nonce),
        request: request.into(),
    };
    let answered = match call(&state, operation).await? {
        Ok(answered) => answered,
        Err(refusal) => {
            if refusal.error == ErrorCode::BootReplayed {
                tracing::warn!(event = "boot_replayed", %identity,
                    requested_at = %request.requested_at, reason = %refusal.message,
                    "a boot request was refused as a replay");
            }
            return Err(refusal.into());
        }
    };
    if let Body::Boot(boot) = &answered.body {
        tracing::info!(identity = %boot.identity, boot_epoch = boot.boot_epoch,
            "gateway boot registered");
    }
    Ok(respond(answered))
}

async fn issue_shard(
    State(state): State<AppState>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Handled {
    let body = body?;
    let caller = state.agent(&method, &uri, &headers, &body).await?;
    let body: IssueShardBody = parse_body(&body)?;
    let shard = match body.shard {
        Some(shard) => shard,
        None => {
            let mut id = [0u8; 16];
            getrandom::fill(&mut id).map_err(|error| {
                ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    ErrorCode::Unavailable,
                    format!("no randomness for a shard ID: {error}"),
                )
            })?;
            path_value::<ShardId>("shard", &format!("es-{}", hex::encode(id)))?
        }
    };
    let operation = Operation::IssueShard(IssueShardRequest {
        identity: caller.clone(),
        boot_epoch: body.boot_epoch,
        boot_nonce: body.boot_nonce,
        subject: body.subject,
        route: body.route,
        shard,
    });
    let answered = call(&state, operation).await??;
    if let (Body::Shard(shard), ledger::protocol::Outcome::Issued) =
        (&answered.body, answered.outcome)
    {
        tracing::info!(shard = %shard.shard, %caller, units = shard.allocated_units,
            fence = shard.fence, "shard issued");
    }
    Ok(respond(answered))
}

async fn reconcile(
    State(state): State<AppState>,
    Segments(shard): Segments<String>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Handled {
    let body = body?;
    let caller = state.agent(&method, &uri, &headers, &body).await?;
    let shard: ShardId = path_value("shard", &shard)?;
    let receipt: ShardTerminalReceiptV1 = parse_body(&body)?;
    if receipt.shard != shard {
        return Err(ApiError::bad_request(
            ErrorCode::InvalidBody,
            "shard",
            format!(
                "field `shard`: the receipt is for {}, the path names {shard}",
                receipt.shard
            ),
        ));
    }
    let operation = Operation::Reconcile {
        receipt: Box::new(receipt),
        caller,
    };
    let answered = call(&state, operation).await??;
    if let Body::Reconciled(done) = &answered.body
        && !done.duplicate
    {
        tracing::info!(shard = %done.shard, reminted = done.reconciliation.reminted_units,
            debt = done.reconciliation.overdraft_debt_units, "shard reconciled");
    }
    Ok(respond(answered))
}

/// `POST /v1/batch`: one signature over the body, then each operation
/// parsed on its own (a malformed one is answered as its own 400), the
/// parsed ones sent to the writer together and in order
/// ([`LedgerHandle::call_many`]), and 200 with one result per operation,
/// in order: the status and body its single call would have answered.
async fn batch(
    State(state): State<AppState>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Handled {
    let body = body?;
    let caller = state.agent(&method, &uri, &headers, &body).await?;
    let items = batch_operations(&body)?;
    let mut operations = Vec::with_capacity(items.len());
    let mut slots = Vec::with_capacity(items.len());
    for item in items {
        match batch_operation(&caller, item) {
            Ok(operation) => {
                slots.push(Ok(Sent::of(&operation)));
                operations.push(operation);
            }
            Err(refused) => slots.push(Err(refused)),
        }
    }
    let mut replies = state.ledger.call_many(operations).await.into_iter();
    let mut written = Vec::with_capacity(body.len() * 2);
    written.extend_from_slice(b"{\"results\":[");
    for (index, slot) in slots.into_iter().enumerate() {
        if index > 0 {
            written.push(b',');
        }
        let answer = match slot {
            Err(refused) => Err(*refused.0),
            Ok(sent) => match replies.next() {
                Some(Ok(reply)) => sent.answer(&state.metrics, reply),
                Some(Err(why)) => Err(*ApiError::from(why).0),
                None => Err(Refusal::internal(
                    "the writer answered fewer operations than sent",
                )),
            },
        };
        write_result(&mut written, &answer);
    }
    written.extend_from_slice(b"]}");
    let content_type = [(CONTENT_TYPE, HeaderValue::from_static("application/json"))];
    Ok((StatusCode::OK, content_type, written).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn members(text: &str) -> Result<Members<'_>, serde_json::Error> {
        serde_json::from_str(text)
    }

    #[test]
    fn an_operations_members_are_read_with_escaped_names_too() {
        let text = r#"{"op":"start","re\u0073ervation":"r-1","operationId":"o-1","deadlineMs":5}"#;
        let mut read = members(text).expect("an object");
        assert_eq!(read.take("op").map(RawValue::get), Some(r#""start""#));
        assert_eq!(
            read.take("reservation").map(RawValue::get),
            Some(r#""r-1""#)
        );
        assert!(read.take("reservation").is_none(), "taken once");
        assert_eq!(
            read.into_body(text.len()),
            br#"{"operationId":"o-1","deadlineMs":5}"#
        );
    }

    #[test]
    fn a_member_named_twice_is_refused_however_it_is_written() {
        for text in [
            r#"{"a":1,"b":2,"a":3}"#,
            r#"{"a":1,"b":2,"\u0061":3}"#,
            r#"{"b":1,"a":2,"c":3,"a":4}"#,
        ] {
            let error = members(text).expect_err(text).to_string();
            assert!(error.contains("duplicate field `a`"), "{text}: {error}");
        }
        let many: Vec<String> = (0..2_000).map(|n| format!(r#""m{n}":{n}"#)).collect();
        let text = format!("{{{}}}", many.join(","));
        assert_eq!(members(&text).expect("distinct names").0.len(), 2_000);
        let text = format!("{{{},\"m1999\":0}}", many.join(","));
        assert!(members(&text).is_err(), "the last of 2,001 repeats one");
    }

    #[test]
    fn an_operation_that_is_not_an_object_is_refused() {
        for text in ["[]", "1", r#""op""#, "null"] {
            assert!(members(text).is_err(), "{text}");
        }
    }
}
