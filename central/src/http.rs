//! The HTTP shell: parse and authenticate, send one [`Operation`] to the
//! writer, map its [`Reply`] to a status, headers and a JSON body
//! (docs/design.md §6.3). No decision is taken here.

use std::collections::HashSet;
use std::sync::{Arc, RwLock};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::header::{AUTHORIZATION, CONTENT_TYPE, RETRY_AFTER};
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use central_client::http_signature::{self, SignatureRefusal};
use central_client::wire::{
    AbandonResponse, AdmissionBody, BootResponse, EmptyBody, EnrollResponse, ErrorBody, FreezeBody,
    IssueShardBody, NotEnforcedResponse, OUTCOME_HEADER, PublishResponse, ReconcileResponse,
    ReserveBody, RouteControlResponse, SettleBody, StartBody, WOULD_REJECT_HEADER,
};
use ledger::{
    AbandonOutcome, Dimension, EnrollOutcome, IssueShardOutcome, IssueShardRequest, PairKey,
    PublishOutcome, ReconcileOutcome, RegisterOutcome, Rejection, ReleaseOutcome, ReserveOutcome,
    RouteControlOutcome, SettleOutcome, StartOutcome,
};
use serde::Serialize;
use shard_format::limits::DOCUMENT_SIZE_MAX;
use shard_format::{
    AdmissionBudgetV1, BootNonce, Document, KeyId, ReservationId, ReservationState, Route, ShardId,
    ShardTerminalReceiptV1, Subject,
};

use crate::metrics::Metrics;
use crate::operations::{Operation, RateLimitState, Reply};
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
}

pub(crate) fn router(state: AppState) -> Router {
    Router::new()
        .route("/healthz", get(health))
        .route("/metrics", get(metrics))
        .route("/v1/policies", put(publish_policy))
        .route("/v1/reservations", post(reserve))
        .route("/v1/reservations/{reservation}", get(get_reservation))
        .route("/v1/reservations/{reservation}/start", post(start))
        .route("/v1/reservations/{reservation}/settle", post(settle))
        .route("/v1/reservations/{reservation}/release", post(release))
        .route("/v1/reservations/{reservation}/abandon", post(abandon))
        .route("/v1/accounts/{subject}/{route}", get(accounts))
        .route("/v1/accounts/{subject}/{route}/admission", post(admission))
        .route("/v1/accounts/{subject}/{route}/freeze", post(freeze))
        .route("/v1/audit", get(audit))
        .route("/v1/gateways/{identity}", put(enroll))
        .route("/v1/gateways/{identity}/boot", post(boot))
        .route("/v1/shards", post(issue_shard))
        .route("/v1/shards/{shard}/receipt", post(reconcile))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(BODY_SIZE_MAX))
        .with_state(state)
}

// ----- errors -----

/// An error answer: `{"error": code, "message": sentence, …details}`.
#[derive(Debug)]
pub(crate) struct ApiError(Box<ErrorAnswer>);

#[derive(Debug)]
struct ErrorAnswer {
    status: StatusCode,
    code: &'static str,
    message: String,
    details: serde_json::Map<String, serde_json::Value>,
    headers: HeaderMap,
}

impl ApiError {
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self(Box::new(ErrorAnswer {
            status,
            code,
            message: message.into(),
            details: serde_json::Map::new(),
            headers: HeaderMap::new(),
        }))
    }

    fn detail(mut self, name: &str, value: impl Serialize) -> Self {
        self.0.details.insert(
            name.to_owned(),
            serde_json::to_value(value).expect("details serialize"),
        );
        self
    }

    fn header(mut self, name: &'static str, value: String) -> Self {
        if let Ok(value) = HeaderValue::from_str(&value) {
            self.0.headers.insert(HeaderName::from_static(name), value);
        }
        self
    }

    fn bad_request(code: &'static str, field: &str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, code, message).detail("field", field)
    }

    fn conflict(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, code, message)
    }

    fn not_found(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, code, message)
    }

    fn unauthorized(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, code, message)
    }

    fn overflow() -> Self {
        Self::conflict(
            "overflow",
            "the operation would overflow an account's unit terms; nothing changed",
        )
    }

    fn illegal_state(reservation: &ReservationId, state: ReservationState) -> Self {
        Self::conflict(
            "illegal_state",
            format!(
                "reservation {reservation} is {state:?}; this transition is not allowed from it"
            ),
        )
        .detail("state", state)
    }

    fn reservation_not_found(reservation: &ReservationId) -> Self {
        Self::not_found(
            "reservation_not_found",
            format!("no reservation {reservation} exists"),
        )
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let answer = *self.0;
        let body = ErrorBody {
            error: answer.code.to_owned(),
            message: answer.message,
            details: answer.details,
        };
        (answer.status, answer.headers, axum::Json(body)).into_response()
    }
}

impl From<Unavailable> for ApiError {
    fn from(why: Unavailable) -> Self {
        let code = match why {
            Unavailable::CommitFailed => "commit_failed",
            Unavailable::Stopped => "unavailable",
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
                "body_too_large",
                format!("the request body is above {BODY_SIZE_MAX} bytes"),
            )
        } else {
            Self::new(
                StatusCode::BAD_REQUEST,
                "unreadable_body",
                rejection.body_text(),
            )
        }
    }
}

type Answer = Result<Response, ApiError>;

/// A reply the operation could not have produced: a bug in the shell.
fn unexpected(reply: &Reply) -> ApiError {
    tracing::error!(
        ?reply,
        "the writer answered an operation with another's reply"
    );
    ApiError::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "internal",
        "the service answered inconsistently; this is a bug",
    )
}

// ----- parsing -----

/// Parses a body strictly ([`shard_format::parse`]): 400 naming the field.
fn parse_body<D: Document>(body: &[u8]) -> Result<D, ApiError> {
    shard_format::parse(body)
        .map_err(|error| ApiError::bad_request("invalid_body", &error.field, error.to_string()))
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
            "invalid_path",
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
                ApiError::unauthorized(
                    "operator_token_required",
                    "this is an operator call: send Authorization: Bearer <operator token>",
                )
            })?;
        if same_secret(token.trim().as_bytes(), self.operator_token.as_bytes()) {
            Ok(())
        } else {
            Err(ApiError::unauthorized(
                "operator_token_invalid",
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
            ApiError::new(status, "signature_invalid", refusal.to_string())
        };
        let parsed = http_signature::parse(
            header(headers, http_signature::CONTENT_DIGEST),
            header(headers, http_signature::SIGNATURE_INPUT),
            header(headers, http_signature::SIGNATURE),
        )
        .map_err(refused)?;
        if !self.is_enrolled(&parsed.key_id).await? {
            return Err(ApiError::unauthorized(
                "unknown_identity",
                format!(
                    "identity {} is not enrolled; an operator enrols it with PUT /v1/gateways/{}",
                    parsed.key_id, parsed.key_id
                ),
            ));
        }
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |elapsed| elapsed.as_secs());
        parsed
            .verify(method.as_str(), uri.path(), body, now)
            .map_err(refused)?;
        Ok(parsed.key_id)
    }
}

// ----- success answers -----

fn outcome_header(outcome: &'static str) -> [(HeaderName, HeaderValue); 1] {
    [(
        HeaderName::from_static(OUTCOME_HEADER),
        HeaderValue::from_static(outcome),
    )]
}

/// A v1 document as its canonical bytes.
fn document<D: Document>(status: StatusCode, outcome: &'static str, value: &D) -> Response {
    (
        status,
        outcome_header(outcome),
        [(CONTENT_TYPE, HeaderValue::from_static("application/json"))],
        shard_format::canonical_bytes(value),
    )
        .into_response()
}

fn json<T: Serialize>(status: StatusCode, outcome: &'static str, value: &T) -> Response {
    (status, outcome_header(outcome), axum::Json(value)).into_response()
}

fn dimension_name(dimension: Dimension) -> &'static str {
    match dimension {
        Dimension::Capacity => "capacity",
        Dimension::Debt => "debt",
        Dimension::Frozen => "frozen",
        Dimension::PolicyGeneration => "policyGeneration",
        Dimension::ReservationUnitsMax => "reservationUnitsMax",
    }
}

/// A 429: `Retry-After` (always: see [`ledger::RETRY_AFTER_NO_HORIZON_SECONDS`]), the `RateLimit-Policy`/`RateLimit` fields for the
/// caller's own subject, and `{error, policyGeneration, dimension,
/// retryAfterSeconds}`.
fn rate_limited(rejection: Rejection, state: Option<RateLimitState>) -> ApiError {
    let dimension = dimension_name(rejection.dimension);
    let why = match rejection.dimension {
        Dimension::Capacity => "not enough capacity is available",
        Dimension::Debt => "the subject owes debt; admission resumes when refills repay it",
        Dimension::Frozen => "the route is frozen after a breach; an operator must unfreeze it",
        Dimension::PolicyGeneration => {
            "the policy generation named is not admitting (replaced or rolled back)"
        }
        Dimension::ReservationUnitsMax => "the units are above the policy's reservationUnitsMax",
    };
    let mut error = ApiError::new(
        StatusCode::TOO_MANY_REQUESTS,
        "rate_limited",
        format!("{why} (policy generation {})", rejection.policy_generation),
    )
    .detail("policyGeneration", rejection.policy_generation)
    .detail("dimension", dimension)
    .detail("retryAfterSeconds", rejection.retry_after_header_seconds())
    .header(
        RETRY_AFTER.as_str(),
        rejection.retry_after_header_seconds().to_string(),
    );
    if let Some(state) = state {
        let reset = rejection
            .retry_after_seconds
            .unwrap_or(state.window_seconds);
        error = error
            .header(
                "ratelimit-policy",
                format!("\"budget\";q={};w={}", state.quota, state.window_seconds),
            )
            .header(
                "ratelimit",
                format!("\"budget\";r={};t={reset}", state.remaining),
            );
    }
    error
}

// ----- handlers -----

async fn health() -> &'static str {
    "ok\n"
}

async fn not_found(uri: Uri) -> ApiError {
    ApiError::not_found("no_such_endpoint", format!("no endpoint at {}", uri.path()))
}

async fn metrics(State(state): State<AppState>) -> Response {
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
) -> Answer {
    state.operator(&headers)?;
    let policy: AdmissionBudgetV1 = parse_body(&body?)?;
    let response = PublishResponse {
        subject: policy.subject.clone(),
        route: policy.route.clone(),
        policy_generation: policy.policy_generation,
    };
    match state
        .ledger
        .call(Operation::Publish(Box::new(policy)))
        .await?
    {
        Reply::Publish(PublishOutcome::Published) => {
            tracing::info!(subject = %response.subject, route = %response.route,
                generation = response.policy_generation, "policy published");
            Ok(json(StatusCode::CREATED, "published", &response))
        }
        Reply::Publish(PublishOutcome::GenerationNotRising { current }) => Err(ApiError::conflict(
            "generation_not_rising",
            format!(
                "policyGeneration must be above the current generation {current} of {}/{}",
                response.subject, response.route
            ),
        )
        .detail("currentGeneration", current)),
        Reply::Publish(PublishOutcome::Invalid(message)) => {
            Err(ApiError::bad_request("invalid_policy", "", message))
        }
        other => Err(unexpected(&other)),
    }
}

async fn enroll(
    State(state): State<AppState>,
    Path(identity): Path<String>,
    headers: HeaderMap,
) -> Answer {
    state.operator(&headers)?;
    let identity: KeyId = path_value("identity", &identity)?;
    if identity.ed25519_public_key().is_none() {
        return Err(ApiError::bad_request(
            "invalid_path",
            "identity",
            "a gateway identity is ed25519:<64 lowercase hex digits of the public key>",
        ));
    }
    let reply = state
        .ledger
        .call(Operation::Enroll(identity.clone()))
        .await?;
    let (status, outcome, enrolled) = match reply {
        Reply::Enroll(EnrollOutcome::Enrolled) => (StatusCode::CREATED, "enrolled", true),
        Reply::Enroll(EnrollOutcome::AlreadyEnrolled) => (StatusCode::OK, "duplicate", false),
        other => return Err(unexpected(&other)),
    };
    state.remember_enrolled(identity.clone());
    Ok(json(
        status,
        outcome,
        &EnrollResponse { identity, enrolled },
    ))
}

async fn route_control(state: &AppState, operation: Operation, pair: &PairKey) -> Answer {
    match state.ledger.call(operation).await? {
        Reply::RouteControl(RouteControlOutcome::Done) => Ok(json(
            StatusCode::OK,
            "changed",
            &RouteControlResponse { changed: true },
        )),
        Reply::RouteControl(RouteControlOutcome::Unchanged) => Ok(json(
            StatusCode::OK,
            "unchanged",
            &RouteControlResponse { changed: false },
        )),
        Reply::RouteControl(RouteControlOutcome::NoPolicy) => Err(ApiError::not_found(
            "no_policy",
            format!("no policy is published for {}/{}", pair.subject, pair.route),
        )),
        Reply::RouteControl(RouteControlOutcome::NotCurrentGeneration { current }) => {
            Err(ApiError::conflict(
                "not_current_generation",
                format!(
                    "policyGeneration must name the current generation {current} of {}/{}",
                    pair.subject, pair.route
                ),
            )
            .detail("currentGeneration", current))
        }
        other => Err(unexpected(&other)),
    }
}

async fn admission(
    State(state): State<AppState>,
    Path((subject, route)): Path<(String, String)>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Answer {
    state.operator(&headers)?;
    let pair = pair_from_path(&subject, &route)?;
    let body: AdmissionBody = parse_body(&body?)?;
    tracing::info!(%subject, %route, generation = body.policy_generation,
        stopped = body.stopped, "admission control");
    let operation = Operation::SetAdmissionStopped {
        pair: pair.clone(),
        generation: body.policy_generation,
        stopped: body.stopped,
    };
    route_control(&state, operation, &pair).await
}

async fn freeze(
    State(state): State<AppState>,
    Path((subject, route)): Path<(String, String)>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Answer {
    state.operator(&headers)?;
    let pair = pair_from_path(&subject, &route)?;
    let body: FreezeBody = parse_body(&body?)?;
    tracing::info!(%subject, %route, frozen = body.frozen, "freeze control");
    let operation = Operation::SetFrozen {
        pair: pair.clone(),
        frozen: body.frozen,
    };
    route_control(&state, operation, &pair).await
}

async fn accounts(
    State(state): State<AppState>,
    Path((subject, route)): Path<(String, String)>,
    headers: HeaderMap,
) -> Answer {
    state.operator(&headers)?;
    let pair = pair_from_path(&subject, &route)?;
    match state
        .ledger
        .call(Operation::GetAccounts(pair.clone()))
        .await?
    {
        Reply::Accounts(Some(view)) => Ok(json(StatusCode::OK, "found", &view)),
        Reply::Accounts(None) => Err(ApiError::not_found(
            "no_policy",
            format!("no policy is published for {subject}/{route}"),
        )),
        other => Err(unexpected(&other)),
    }
}

async fn audit(State(state): State<AppState>, headers: HeaderMap) -> Answer {
    state.operator(&headers)?;
    match state.ledger.call(Operation::Audit).await? {
        Reply::Audit(report) => {
            let status = if report.ok {
                StatusCode::OK
            } else {
                tracing::error!(
                    violations = report.violations.len(),
                    "the audit found drift"
                );
                StatusCode::INTERNAL_SERVER_ERROR
            };
            Ok(json(
                status,
                if report.ok { "clean" } else { "drift" },
                &report,
            ))
        }
        other => Err(unexpected(&other)),
    }
}

async fn reserve(
    State(state): State<AppState>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Answer {
    let body = body?;
    state.agent(&method, &uri, &headers, &body).await?;
    let request: ReserveBody = parse_body(&body)?;
    let reservation = request.reservation.clone();
    let pair = format!("{}/{}", request.subject, request.route);
    let Reply::Reserve {
        outcome,
        rate_limit,
    } = state
        .ledger
        .call(Operation::Reserve(request.into()))
        .await?
    else {
        return Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "the service answered inconsistently; this is a bug",
        ));
    };
    let metrics = &state.metrics;
    match outcome {
        ReserveOutcome::Reserved(receipt) => {
            metrics.count_reservation("reserved", "");
            Ok(document(StatusCode::CREATED, "reserved", &receipt))
        }
        ReserveOutcome::Duplicate(receipt) => {
            metrics.count_reservation("duplicate", "");
            Ok(document(StatusCode::OK, "duplicate", &receipt))
        }
        ReserveOutcome::Shadow {
            receipt,
            would_reject,
        } => {
            metrics.count_reservation(
                "shadow",
                would_reject.map_or("", |rejection| dimension_name(rejection.dimension)),
            );
            let mut response = document(StatusCode::OK, "shadow", &receipt);
            if let Some(rejection) = would_reject {
                response.headers_mut().insert(
                    HeaderName::from_static(WOULD_REJECT_HEADER),
                    HeaderValue::from_static(dimension_name(rejection.dimension)),
                );
            }
            Ok(response)
        }
        ReserveOutcome::NotEnforced => {
            metrics.count_reservation("not_enforced", "");
            Ok(json(
                StatusCode::OK,
                "not_enforced",
                &NotEnforcedResponse {
                    mode: "off".to_owned(),
                },
            ))
        }
        ReserveOutcome::Rejected(rejection) => {
            metrics.count_reservation("rejected", dimension_name(rejection.dimension));
            Err(rate_limited(rejection, rate_limit))
        }
        ReserveOutcome::IdempotencyConflict { .. } => {
            metrics.count_reservation("idempotency_conflict", "");
            Err(ApiError::conflict(
                "idempotency_conflict",
                format!(
                    "reservation {reservation} exists with another request; a retry must send the same request under its ID"
                ),
            ))
        }
        ReserveOutcome::Abandoned => {
            metrics.count_reservation("abandoned", "");
            Err(ApiError::conflict(
                "reservation_abandoned",
                format!("reservation {reservation} was abandoned; it never reserves"),
            ))
        }
        ReserveOutcome::NoPolicy => {
            metrics.count_reservation("no_policy", "");
            Err(ApiError::not_found(
                "no_policy",
                format!("no policy is published for {pair}"),
            ))
        }
        ReserveOutcome::InvalidUnits => {
            metrics.count_reservation("invalid", "");
            Err(ApiError::bad_request(
                "invalid_units",
                "units",
                "field `units`: must be between 1 and 2^53 - 1",
            ))
        }
        ReserveOutcome::Overflow(_) => {
            metrics.count_reservation("overflow", "");
            Err(ApiError::overflow())
        }
    }
}

async fn get_reservation(
    State(state): State<AppState>,
    Path(reservation): Path<String>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
) -> Answer {
    state.agent(&method, &uri, &headers, b"").await?;
    let reservation: ReservationId = path_value("reservation", &reservation)?;
    match state
        .ledger
        .call(Operation::GetReservation(reservation.clone()))
        .await?
    {
        Reply::Reservation {
            receipt: Some(receipt),
            ..
        } => Ok(document(StatusCode::OK, "found", &receipt)),
        Reply::Reservation {
            tombstoned: true, ..
        } => Err(ApiError::not_found(
            "reservation_abandoned",
            format!("reservation {reservation} was abandoned before it reserved"),
        )),
        Reply::Reservation { .. } => Err(ApiError::reservation_not_found(&reservation)),
        other => Err(unexpected(&other)),
    }
}

async fn start(
    State(state): State<AppState>,
    Path(reservation): Path<String>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Answer {
    let body = body?;
    state.agent(&method, &uri, &headers, &body).await?;
    let reservation: ReservationId = path_value("reservation", &reservation)?;
    let body: StartBody = parse_body(&body)?;
    let operation = Operation::Start {
        reservation: reservation.clone(),
        operation_id: body.operation_id,
        deadline_ms: body.deadline_ms,
    };
    match state.ledger.call(operation).await? {
        Reply::Start(StartOutcome::Started(receipt)) => {
            Ok(document(StatusCode::OK, "started", &receipt))
        }
        Reply::Start(StartOutcome::Duplicate(receipt)) => {
            Ok(document(StatusCode::OK, "duplicate", &receipt))
        }
        Reply::Start(StartOutcome::NotFound) => Err(ApiError::reservation_not_found(&reservation)),
        Reply::Start(StartOutcome::OperationConflict { bound }) => Err(ApiError::conflict(
            "operation_conflict",
            format!("reservation {reservation} is bound to another operation"),
        )
        .detail("boundOperationId", bound)),
        Reply::Start(StartOutcome::Expired(receipt)) => Err(ApiError::conflict(
            "reservation_expired",
            format!(
                "reservation {reservation} expired at {} before it started; its units are back",
                receipt.expires_at
            ),
        )
        .detail("state", receipt.state)),
        Reply::Start(StartOutcome::IllegalState(state)) => {
            Err(ApiError::illegal_state(&reservation, state))
        }
        other => Err(unexpected(&other)),
    }
}

async fn settle(
    State(state): State<AppState>,
    Path(reservation): Path<String>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Answer {
    let body = body?;
    state.agent(&method, &uri, &headers, &body).await?;
    let reservation: ReservationId = path_value("reservation", &reservation)?;
    let body: SettleBody = parse_body(&body)?;
    let operation = Operation::Settle {
        reservation: reservation.clone(),
        operation_id: body.operation_id,
        actual_units: body.actual_units,
    };
    let metrics = &state.metrics;
    match state.ledger.call(operation).await? {
        Reply::Settle(SettleOutcome::Settled(receipt)) => {
            metrics.count_settlement("settled", receipt.refunded_units);
            Ok(document(StatusCode::OK, "settled", &receipt))
        }
        Reply::Settle(SettleOutcome::Duplicate(receipt)) => {
            metrics.count_settlement("duplicate", 0);
            Ok(document(StatusCode::OK, "duplicate", &receipt))
        }
        Reply::Settle(SettleOutcome::Corrected(receipt)) => {
            metrics.count_settlement("corrected", 0);
            Ok(document(StatusCode::OK, "corrected", &receipt))
        }
        Reply::Settle(SettleOutcome::NotFound) => {
            Err(ApiError::reservation_not_found(&reservation))
        }
        Reply::Settle(SettleOutcome::OperationConflict { bound }) => Err(ApiError::conflict(
            "operation_conflict",
            format!("reservation {reservation} is bound to another operation"),
        )
        .detail("boundOperationId", bound)),
        Reply::Settle(SettleOutcome::SettlementConflict(receipt)) => Err(ApiError::conflict(
            "settlement_conflict",
            format!(
                "reservation {reservation} was settled already with other actual units; a settle happens once"
            ),
        )
        .detail("actualUnits", receipt.actual_units)),
        Reply::Settle(SettleOutcome::NotStarted(state)) => Err(ApiError::conflict(
            "not_started",
            format!("reservation {reservation} is {state:?}: start binds the operation before a settle"),
        )
        .detail("state", state)),
        Reply::Settle(SettleOutcome::IllegalState(state)) => {
            Err(ApiError::illegal_state(&reservation, state))
        }
        Reply::Settle(SettleOutcome::Overflow(_)) => Err(ApiError::overflow()),
        other => Err(unexpected(&other)),
    }
}

async fn release(
    State(state): State<AppState>,
    Path(reservation): Path<String>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Answer {
    let body = body?;
    state.agent(&method, &uri, &headers, &body).await?;
    let reservation: ReservationId = path_value("reservation", &reservation)?;
    parse_empty(&body)?;
    match state
        .ledger
        .call(Operation::Release(reservation.clone()))
        .await?
    {
        Reply::Release(ReleaseOutcome::Released(receipt)) => {
            Ok(document(StatusCode::OK, "released", &receipt))
        }
        Reply::Release(ReleaseOutcome::Duplicate(receipt)) => {
            Ok(document(StatusCode::OK, "duplicate", &receipt))
        }
        Reply::Release(ReleaseOutcome::NotFound) => {
            Err(ApiError::reservation_not_found(&reservation))
        }
        Reply::Release(ReleaseOutcome::IllegalState(state)) => {
            Err(ApiError::illegal_state(&reservation, state))
        }
        Reply::Release(ReleaseOutcome::Overflow(_)) => Err(ApiError::overflow()),
        other => Err(unexpected(&other)),
    }
}

async fn abandon(
    State(state): State<AppState>,
    Path(reservation): Path<String>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Answer {
    let body = body?;
    state.agent(&method, &uri, &headers, &body).await?;
    let reservation: ReservationId = path_value("reservation", &reservation)?;
    parse_empty(&body)?;
    let outcome = match state
        .ledger
        .call(Operation::Abandon(reservation.clone()))
        .await?
    {
        Reply::Abandon(AbandonOutcome::Tombstoned) => "tombstoned",
        Reply::Abandon(AbandonOutcome::Abandoned(_)) => "abandoned",
        Reply::Abandon(AbandonOutcome::Duplicate) => "duplicate",
        Reply::Abandon(AbandonOutcome::IllegalState(receipt)) => {
            return Err(ApiError::conflict(
                "illegal_state",
                format!(
                    "reservation {reservation} is {:?}: its outcome is known, nothing to abandon",
                    receipt.state
                ),
            )
            .detail("state", receipt.state));
        }
        Reply::Abandon(AbandonOutcome::Overflow(_)) => return Err(ApiError::overflow()),
        other => return Err(unexpected(&other)),
    };
    Ok(json(
        StatusCode::OK,
        outcome,
        &AbandonResponse {
            reservation,
            outcome: outcome.to_owned(),
        },
    ))
}

async fn boot(
    State(state): State<AppState>,
    Path(identity): Path<String>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Answer {
    let body = body?;
    let caller = state.agent(&method, &uri, &headers, &body).await?;
    let identity: KeyId = path_value("identity", &identity)?;
    if identity != caller {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "wrong_identity",
            format!("{caller} cannot register a boot of {identity}"),
        ));
    }
    parse_empty(&body)?;
    let mut nonce = [0u8; 16];
    getrandom::fill(&mut nonce).map_err(|error| {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable",
            format!("no randomness for a boot nonce: {error}"),
        )
    })?;
    let operation = Operation::Register {
        identity: identity.clone(),
        boot_nonce: BootNonce(nonce),
    };
    match state.ledger.call(operation).await? {
        Reply::Register(RegisterOutcome::Registered {
            boot_epoch,
            boot_nonce,
        }) => {
            tracing::info!(%identity, boot_epoch, "gateway boot registered");
            Ok(json(
                StatusCode::CREATED,
                "registered",
                &BootResponse {
                    identity,
                    boot_epoch,
                    boot_nonce,
                },
            ))
        }
        Reply::Register(RegisterOutcome::UnknownGateway) => Err(ApiError::unauthorized(
            "unknown_identity",
            format!("identity {identity} is not enrolled"),
        )),
        Reply::Register(RegisterOutcome::Overflow(_)) => Err(ApiError::overflow()),
        other => Err(unexpected(&other)),
    }
}

async fn issue_shard(
    State(state): State<AppState>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Answer {
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
                    "unavailable",
                    format!("no randomness for a shard ID: {error}"),
                )
            })?;
            path_value::<ShardId>("shard", &format!("es-{}", hex::encode(id)))?
        }
    };
    let pair = format!("{}/{}", body.subject, body.route);
    let operation = Operation::IssueShard(IssueShardRequest {
        identity: caller.clone(),
        boot_epoch: body.boot_epoch,
        boot_nonce: body.boot_nonce,
        subject: body.subject,
        route: body.route,
        shard,
    });
    match state.ledger.call(operation).await? {
        Reply::IssueShard(IssueShardOutcome::Issued(shard)) => {
            tracing::info!(shard = %shard.shard, %caller, units = shard.allocated_units,
                fence = shard.fence, "shard issued");
            Ok(document(StatusCode::CREATED, "issued", shard.as_ref()))
        }
        Reply::ShardDuplicate(shard) => Ok(document(StatusCode::OK, "duplicate", shard.as_ref())),
        Reply::IssueShard(IssueShardOutcome::UnknownGateway) => Err(ApiError::unauthorized(
            "unknown_identity",
            format!("identity {caller} is not enrolled"),
        )),
        Reply::IssueShard(IssueShardOutcome::SupersededBoot { current_epoch }) => {
            Err(ApiError::conflict(
                "superseded_boot",
                format!(
                    "boot epoch {} with this nonce is not {caller}'s current boot ({current_epoch}); register the boot first",
                    body.boot_epoch
                ),
            )
            .detail("currentBootEpoch", current_epoch))
        }
        Reply::IssueShard(IssueShardOutcome::NoPolicy) => Err(ApiError::not_found(
            "no_policy",
            format!("no policy is published for {pair}"),
        )),
        Reply::IssueShard(IssueShardOutcome::EmergencyDisabled) => Err(ApiError::conflict(
            "emergency_disabled",
            format!("the policy of {pair} does not enable emergency shards"),
        )),
        Reply::IssueShard(IssueShardOutcome::TooManyOpenShards) => Err(ApiError::conflict(
            "too_many_open_shards",
            format!("this boot holds the most open shards allowed for {pair}; reconcile one first"),
        )),
        Reply::IssueShard(IssueShardOutcome::Rejected(rejection)) => {
            Err(rate_limited(rejection, None))
        }
        Reply::IssueShard(IssueShardOutcome::ShardIdTaken) => Err(ApiError::conflict(
            "shard_id_taken",
            "the shard ID was issued to another request; choose a new one",
        )),
        Reply::IssueShard(IssueShardOutcome::Overflow(_)) => Err(ApiError::overflow()),
        other => Err(unexpected(&other)),
    }
}

async fn reconcile(
    State(state): State<AppState>,
    Path(shard): Path<String>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Answer {
    let body = body?;
    let caller = state.agent(&method, &uri, &headers, &body).await?;
    let shard: ShardId = path_value("shard", &shard)?;
    let receipt: ShardTerminalReceiptV1 = parse_body(&body)?;
    if receipt.shard != shard {
        return Err(ApiError::bad_request(
            "invalid_body",
            "shard",
            format!(
                "field `shard`: the receipt is for {}, the path names {shard}",
                receipt.shard
            ),
        ));
    }
    let operation = Operation::Reconcile {
        receipt: Box::new(receipt),
        caller: caller.clone(),
    };
    match state.ledger.call(operation).await? {
        Reply::Reconcile(ReconcileOutcome::Reconciled(reconciliation)) => {
            tracing::info!(%shard, reminted = reconciliation.reminted_units,
                debt = reconciliation.overdraft_debt_units, "shard reconciled");
            Ok(json(
                StatusCode::OK,
                "reconciled",
                &ReconcileResponse {
                    shard,
                    duplicate: false,
                    reconciliation,
                },
            ))
        }
        Reply::Reconcile(ReconcileOutcome::Duplicate(reconciliation)) => Ok(json(
            StatusCode::OK,
            "duplicate",
            &ReconcileResponse {
                shard,
                duplicate: true,
                reconciliation,
            },
        )),
        Reply::Reconcile(ReconcileOutcome::UnknownShard) => Err(ApiError::not_found(
            "shard_not_found",
            format!("no shard {shard} was issued"),
        )),
        Reply::Reconcile(ReconcileOutcome::WrongIdentity) => Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "wrong_identity",
            format!("shard {shard} is bound to another identity than {caller}"),
        )),
        Reply::Reconcile(ReconcileOutcome::BadSignature(error)) => Err(ApiError::bad_request(
            "invalid_body",
            "signature",
            format!("field `signature`: {error}"),
        )),
        Reply::Reconcile(ReconcileOutcome::Mismatch(field)) => Err(ApiError::bad_request(
            "receipt_mismatch",
            field,
            format!("the receipt's {field} differs from the issued shard's"),
        )),
        Reply::Reconcile(ReconcileOutcome::Overflow(_)) => Err(ApiError::overflow()),
        other => Err(unexpected(&other)),
    }
}
