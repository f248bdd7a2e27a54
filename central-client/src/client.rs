//! [`CentralClient`]: one typed call per endpoint.

use std::borrow::Cow;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use ledger::{Dimension, ReservationOrigin, ReserveRequest};
use reqwest::header::{AUTHORIZATION, CONTENT_TYPE, HeaderMap, HeaderValue};
use reqwest::{Method, StatusCode};
use shard_format::{
    AdmissionBudgetV1, Document, DocumentSigner as _, Ed25519Signer, EmergencyShardV1,
    GatewayIdentity, KeyId, LimitReservationV1, ReservationId, Route, SettlementReceiptV1,
    ShardTerminalReceiptV1, Subject,
};

use crate::error::{CallError, refusal_of_answer};
use crate::http_signature;
use crate::wire::{
    AbandonBody, AbandonResponse, AccountsResponse, AdmissionBody, AuditResponse, BatchBody,
    BatchOperation, BootBody, BootResponse, EnrollResponse, FreezeBody, IssueShardBody,
    OUTCOME_HEADER, PublishResponse, ReconcileResponse, ReserveBody, RouteControlResponse,
    SettleBody, StartBody, WOULD_REJECT_HEADER,
};
use ledger::protocol::{Answer, Answered, Body, ErrorCode, Outcome};

/// How often and how long a retried call is repeated. Only calls that are
/// idempotent under their IDs are retried (reservation calls, shard
/// issuance under its shard ID, receipts), and always with the very same
/// body: a retry never picks a new reservation ID.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Attempts in all, the first included.
    pub attempts_max: u32,
    pub backoff_initial: Duration,
    pub backoff_max: Duration,
    /// No new attempt starts after this much time since the first.
    pub deadline: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            attempts_max: 5,
            backoff_initial: Duration::from_millis(50),
            backoff_max: Duration::from_secs(2),
            deadline: Duration::from_secs(10),
        }
    }
}

/// Where the service is, whom to trust, and how long one call may take.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientConfig {
    /// `https://host:port` (or `http://` on loopback), without a trailing
    /// path.
    pub base_url: String,
    /// PEM CA certificates the center's certificate must chain to; `None`:
    /// the operating system's roots.
    pub ca_file: Option<PathBuf>,
    /// Allow `http://` to a host that is not loopback: the operator token,
    /// the signed calls and the center's answers (admissions, shards)
    /// then cross the network in clear and unauthenticated, so anyone on
    /// the path can read the token and forge admissions.
    pub insecure_http: bool,
    /// Deadline of one attempt, from sending to the last byte of the answer.
    pub call_timeout: Duration,
    pub connect_timeout: Duration,
    pub retry: RetryPolicy,
}

impl ClientConfig {
    pub fn new(base_url: impl Into<String>) -> Self {
        Self {
            base_url: base_url.into().trim_end_matches('/').to_owned(),
            ca_file: None,
            insecure_http: false,
            call_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(2),
            retry: RetryPolicy::default(),
        }
    }
}

/// The answer to a reservation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReserveReply {
    /// 201: units moved from `available` to `reserved`.
    Reserved(LimitReservationV1),
    /// 200: the same reservation ID and digest again; the receipt as it is now.
    Duplicate(LimitReservationV1),
    /// 200, route in `shadow` mode: recorded and admitted, nothing held.
    Shadow {
        receipt: LimitReservationV1,
        would_reject: Option<Dimension>,
    },
    /// 200, route in `off` mode: admitted without a record.
    NotEnforced,
}

/// The answer to a start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StartReply {
    Started(LimitReservationV1),
    Duplicate(LimitReservationV1),
}

/// The answer to a settle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SettleReply {
    Settled(SettlementReceiptV1),
    /// The same settle again: the first settlement receipt; nothing moved.
    Duplicate(SettlementReceiptV1),
    /// A genuine receipt corrected a conservative settlement (once).
    Corrected(SettlementReceiptV1),
}

/// The answer to a release.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReleaseReply {
    Released(LimitReservationV1),
    Duplicate(LimitReservationV1),
}

/// The answer to a shard request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ShardReply {
    Issued(EmergencyShardV1),
    /// The shard ID was issued before to this very request.
    Duplicate(EmergencyShardV1),
}

/// An agent call, for a caller that reads every answer through one
/// mapping of the protocol's wire form ([`CentralClient::answer`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AgentCall {
    /// `POST /v1/gateways/{identity}/boot` with a fresh request
    /// ([`BootBody::fresh`]), sent once.
    Boot(BootBody),
    /// `POST /v1/reservations`, retried under the same ID.
    Reserve(ReserveRequest),
    /// `GET /v1/reservations/{reservation}`.
    Get(ReservationId),
    Start(ReservationId, StartBody),
    Settle(ReservationId, SettleBody),
    Release(ReservationId),
    /// `POST /v1/reservations/{reservation}/abandon`, with what the ID was
    /// derived from.
    Abandon(ReservationId, AbandonBody),
    /// `POST /v1/shards`: retried only when the body names the shard ID.
    IssueShard(IssueShardBody),
    /// `POST /v1/shards/{shard}/receipt`.
    Reconcile(Box<ShardTerminalReceiptV1>),
}

impl AgentCall {
    /// Whether the call can go in a batch ([`Self::batch_operation`]).
    pub fn is_batchable(&self) -> bool {
        !matches!(
            self,
            Self::Boot(_) | Self::IssueShard(_) | Self::Reconcile(_)
        )
    }

    /// This call as an operation of `POST /v1/batch`: the reservation
    /// calls; boots, shards and receipts go alone (`None`).
    pub fn batch_operation(&self) -> Option<BatchOperation> {
        Some(match self {
            Self::Reserve(request) => BatchOperation::Reserve(ReserveBody::from(request.clone())),
            Self::Get(reservation) => BatchOperation::GetReservation {
                reservation: reservation.clone(),
            },
            Self::Start(reservation, body) => BatchOperation::Start {
                reservation: reservation.clone(),
                body: body.clone(),
            },
            Self::Settle(reservation, body) => BatchOperation::Settle {
                reservation: reservation.clone(),
                body: body.clone(),
            },
            Self::Release(reservation) => BatchOperation::Release {
                reservation: reservation.clone(),
            },
            Self::Abandon(reservation, body) => BatchOperation::Abandon {
                reservation: reservation.clone(),
                body: body.clone(),
            },
            Self::Boot(_) | Self::IssueShard(_) | Self::Reconcile(_) => return None,
        })
    }
}

/// The answer to `POST /v1/batch`: per operation, in order, the status,
/// the outcome and would-reject headers and the body the single call
/// would have answered. Read borrowing from the answer's bytes: each body
/// is copied once, into its own answer.
#[derive(Debug, serde::Deserialize)]
struct BatchAnswer<'a> {
    #[serde(borrow)]
    results: Vec<BatchResult<'a>>,
}

#[derive(Debug, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct BatchResult<'a> {
    status: u16,
    #[serde(default, borrow)]
    outcome: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    would_reject: Option<Cow<'a, str>>,
    #[serde(borrow)]
    body: &'a serde_json::value::RawValue,
}

/// Who signs a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Auth {
    None,
    Operator,
    Agent,
}

/// One answered request.
#[derive(Debug)]
struct HttpAnswer {
    status: StatusCode,
    headers: HeaderMap,
    body: Vec<u8>,
}

impl HttpAnswer {
    /// A shadow admission's dimension that enforcement would have hit.
    fn would_reject(&self) -> Option<Dimension> {
        self.headers
            .get(WOULD_REJECT_HEADER)
            .and_then(|value| value.to_str().ok())
            .and_then(|value| {
                serde_json::from_value(serde_json::Value::String(value.to_owned())).ok()
            })
    }

    /// Sorts the answer into answered (2xx; with `drift_is_answer` also a
    /// 500, the audit's drift), rejected (4xx: nothing changed) or unknown
    /// (5xx: a commit that failed may still have reached the database
    /// (PostgreSQL), and a proxy's 502/504 says nothing at all).
    fn sorted(self, drift_is_answer: bool) -> Result<Self, CallError> {
        let status = self.status;
        if status.is_success() || (drift_is_answer && status == StatusCode::INTERNAL_SERVER_ERROR) {
            return Ok(self);
        }
        if status.is_server_error() {
            return Err(CallError::OutcomeUnknown(format!(
                "the service answered {status}: {}",
                String::from_utf8_lossy(&self.body)
            )));
        }
        Err(CallError::Rejected(Box::new(refusal_of_answer(
            status.as_u16(),
            &self.headers,
            &self.body,
        ))))
    }

    fn outcome(&self) -> Outcome {
        Outcome::from_wire(
            self.headers
                .get(OUTCOME_HEADER)
                .and_then(|value| value.to_str().ok())
                .unwrap_or(""),
        )
    }
}

/// A typed client of the central API. Cheap to clone.
#[derive(Debug, Clone)]
pub struct CentralClient {
    http: reqwest::Client,
    config: ClientConfig,
    identity: Option<Arc<Ed25519Signer>>,
    operator_token: Option<Arc<str>>,
}

/// Why a client could not be built.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error("cannot build the HTTP client: {0}")]
    Http(#[from] reqwest::Error),
    #[error("the central URL {url:?} is not an http:// or https:// URL: {reason}")]
    Url { url: String, reason: String },
    #[error(
        "refusing plain http:// to {host}, which is not loopback: the operator token and the \
         center's answers would cross the network in clear; use https:// (with the center's CA \
         file) or allow it explicitly with the insecure-http option"
    )]
    InsecureHttp { host: String },
    #[error("cannot read the CA file {path}: {message}", path = .path.display())]
    CaFile { path: PathBuf, message: String },
    #[error("the CA file {path} holds no usable certificate", path = .path.display())]
    NoCa { path: PathBuf },
    #[error("cannot build the TLS configuration: {0}")]
    Tls(String),
}

/// Whether `host` is this machine (`localhost`, `127.0.0.0/8`, `::1`).
fn is_loopback(host: &url::Host<&str>) -> bool {
    match host {
        url::Host::Domain(name) => {
            name.eq_ignore_ascii_case("localhost")
                || name.to_ascii_lowercase().ends_with(".localhost")
        }
        url::Host::Ipv4(address) => address.is_loopback(),
        url::Host::Ipv6(address) => address.is_loopback(),
    }
}

/// Checks the URL's scheme against the loopback rule.
fn check_url(config: &ClientConfig) -> Result<(), BuildError> {
    let invalid = |reason: &str| BuildError::Url {
        url: config.base_url.clone(),
        reason: reason.to_owned(),
    };
    let url = reqwest::Url::parse(&config.base_url).map_err(|error| invalid(&error.to_string()))?;
    let host = url.host().ok_or_else(|| invalid("it names no host"))?;
    match url.scheme() {
        "https" => Ok(()),
        "http" if config.insecure_http || is_loopback(&host) => Ok(()),
        "http" => Err(BuildError::InsecureHttp {
            host: host.to_string(),
        }),
        _ => Err(invalid("the scheme must be https or http")),
    }
}

/// The TLS configuration: the CA file's roots, or the system's.
fn tls_config(config: &ClientConfig) -> Result<rustls::ClientConfig, BuildError> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject as _;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|error| BuildError::Tls(error.to_string()))?;
    let mut tls = match &config.ca_file {
        Some(path) => {
            let certificates = CertificateDer::pem_file_iter(path)
                .and_then(Iterator::collect::<Result<Vec<_>, _>>)
                .map_err(|error| BuildError::CaFile {
                    path: path.clone(),
                    message: error.to_string(),
                })?;
            let mut roots = rustls::RootCertStore::empty();
            let (added, _ignored) = roots.add_parsable_certificates(certificates);
            if added == 0 {
                return Err(BuildError::NoCa { path: path.clone() });
            }
            builder.with_root_certificates(roots).with_no_client_auth()
        }
        None => {
            let verifier = rustls_platform_verifier::Verifier::new(provider)
                .map_err(|error| BuildError::Tls(error.to_string()))?;
            builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(verifier))
                .with_no_client_auth()
        }
    };
    tls.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(tls)
}

fn unix_seconds() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_secs())
}

/// An error and its causes, `a: b: c`: reqwest's own message leaves out
/// why a connection failed (refused, TLS: unknown issuer, …).
fn with_causes(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

fn parse_json<'a, T: serde::Deserialize<'a>>(answer: &'a HttpAnswer) -> Result<T, CallError> {
    serde_json::from_slice(&answer.body).map_err(|error| {
        CallError::Protocol(format!(
            "the {} answer is not the expected JSON: {error}",
            answer.status
        ))
    })
}

fn parse_document<T: Document>(answer: &HttpAnswer) -> Result<T, CallError> {
    shard_format::parse(&answer.body).map_err(|error| {
        CallError::Protocol(format!(
            "the {} answer is not a valid {}: {error}",
            answer.status,
            T::SCHEMA
        ))
    })
}

impl CentralClient {
    /// A client of `config.base_url`: `https://` verified against
    /// `config.ca_file` (or the system's roots); `http://` only to loopback
    /// unless `config.insecure_http`.
    pub fn new(config: ClientConfig) -> Result<Self, BuildError> {
        check_url(&config)?;
        let http = reqwest::Client::builder()
            .connect_timeout(config.connect_timeout)
            .tls_backend_preconfigured(tls_config(&config)?)
            .build()?;
        Ok(Self {
            http,
            config,
            identity: None,
            operator_token: None,
        })
    }

    /// Signs agent calls with `signer` (the agent's identity key).
    pub fn with_identity(mut self, signer: Ed25519Signer) -> Self {
        self.identity = Some(Arc::new(signer));
        self
    }

    /// Sends `token` as `Authorization: Bearer` on operator calls.
    pub fn with_operator_token(mut self, token: impl Into<String>) -> Self {
        self.operator_token = Some(Arc::from(token.into()));
        self
    }

    pub fn config(&self) -> &ClientConfig {
        &self.config
    }

    /// The gateway identity agent calls are signed with.
    pub fn identity(&self) -> Option<&KeyId> {
        self.identity.as_deref().map(|signer| signer.key_id())
    }

    /// One attempt: send, wait for the whole answer (at most
    /// `call_timeout`), and sort the result into answered, rejected or
    /// unknown.
    async fn send(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
        auth: Auth,
        drift_is_answer: bool,
    ) -> Result<HttpAnswer, CallError> {
        let url = format!("{}{path}", self.config.base_url);
        let body = body.unwrap_or_default();
        let mut request = self
            .http
            .request(method.clone(), &url)
            .timeout(self.config.call_timeout);
        if !body.is_empty() {
            request = request.header(CONTENT_TYPE, "application/json");
        }
        match auth {
            Auth::None => {}
            Auth::Operator => {
                let token = self.operator_token.as_deref().ok_or_else(|| {
                    CallError::NotSent("an operator call needs an operator token".to_owned())
                })?;
                request = request.header(AUTHORIZATION, format!("Bearer {token}"));
            }
            Auth::Agent => {
                let signer = self.identity.as_deref().ok_or_else(|| {
                    CallError::NotSent("an agent call needs an identity key".to_owned())
                })?;
                let signed = http_signature::sign(
                    signer,
                    method.as_str(),
                    path,
                    &body,
                    unix_seconds(),
                    &http_signature::Nonce::random(),
                );
                request = request
                    .header(http_signature::CONTENT_DIGEST, signed.content_digest)
                    .header(http_signature::SIGNATURE_INPUT, signed.signature_input)
                    .header(http_signature::SIGNATURE, signed.signature);
            }
        }
        let response = request.body(body).send().await.map_err(|error| {
            if error.is_builder() || error.is_connect() {
                CallError::NotSent(with_causes(&error))
            } else {
                CallError::OutcomeUnknown(with_causes(&error))
            }
        })?;
        let status = response.status();
        let headers = response.headers().clone();
        let body = response
            .bytes()
            .await
            .map_err(|error| CallError::OutcomeUnknown(error.to_string()))?
            .to_vec();
        HttpAnswer {
            status,
            headers,
            body,
        }
        .sorted(drift_is_answer)
    }

    /// Repeats `send` with the same body while the outcome is unknown or
    /// the request was not sent, within the retry policy.
    async fn send_with_retry(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
        auth: Auth,
        drift_is_answer: bool,
    ) -> Result<HttpAnswer, CallError> {
        let policy = self.config.retry;
        let started = Instant::now();
        let mut backoff = policy.backoff_initial;
        let mut attempt = 1;
        loop {
            let result = self
                .send(method.clone(), path, body.clone(), auth, drift_is_answer)
                .await;
            match result {
                Err(CallError::OutcomeUnknown(_) | CallError::NotSent(_))
                    if attempt < policy.attempts_max
                        && started.elapsed() + backoff < policy.deadline =>
                {
                    tracing::debug!(path, attempt, "retrying under the same request");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(policy.backoff_max);
                    attempt += 1;
                }
                other => return other,
            }
        }
    }

    fn encode<T: serde::Serialize>(value: &T) -> Vec<u8> {
        serde_json::to_vec(value).expect("request bodies serialize")
    }

    // ----- unauthenticated -----

    /// `GET /healthz`: whether the service is up and its store loaded.
    pub async fn health(&self) -> Result<(), CallError> {
        self.send(Method::GET, "/healthz", None, Auth::None, false)
            .await
            .map(|_| ())
    }

    /// `GET /metrics`: Prometheus text. An operator call.
    pub async fn metrics(&self) -> Result<String, CallError> {
        let answer = self
            .send(Method::GET, "/metrics", None, Auth::Operator, false)
            .await?;
        String::from_utf8(answer.body)
            .map_err(|_| CallError::Protocol("metrics are not UTF-8".to_owned()))
    }

    // ----- operator calls -----

    /// `PUT /v1/policies`.
    pub async fn publish_policy(
        &self,
        policy: &AdmissionBudgetV1,
    ) -> Result<PublishResponse, CallError> {
        let body = shard_format::canonical_bytes(policy);
        let answer = self
            .send_with_retry(
                Method::PUT,
                "/v1/policies",
                Some(body),
                Auth::Operator,
                false,
            )
            .await;
        match answer {
            Ok(answer) => parse_json(&answer),
            // A retried publish of the same generation finds it published.
            Err(CallError::Rejected(error))
                if error.error == ErrorCode::GenerationNotRising
                    && error.details.current_generation == Some(policy.policy_generation) =>
            {
                Ok(PublishResponse {
                    subject: policy.subject.clone(),
                    route: policy.route.clone(),
                    policy_generation: policy.policy_generation,
                })
            }
            Err(error) => Err(error),
        }
    }

    /// `PUT /v1/gateways/{identity}`: enrols an agent's identity.
    pub async fn enroll_gateway(
        &self,
        identity: &GatewayIdentity,
    ) -> Result<EnrollResponse, CallError> {
        let path = format!("/v1/gateways/{identity}");
        let answer = self
            .send_with_retry(Method::PUT, &path, None, Auth::Operator, false)
            .await?;
        parse_json(&answer)
    }

    /// `POST /v1/accounts/{subject}/{route}/admission`: stops (rolls back)
    /// or resumes admission under the pair's current generation.
    pub async fn set_admission_stopped(
        &self,
        subject: &Subject,
        route: &Route,
        policy_generation: u64,
        stopped: bool,
    ) -> Result<RouteControlResponse, CallError> {
        let path = format!("/v1/accounts/{subject}/{route}/admission");
        let body = Self::encode(&AdmissionBody {
            policy_generation,
            stopped,
        });
        let answer = self
            .send_with_retry(Method::POST, &path, Some(body), Auth::Operator, false)
            .await?;
        parse_json(&answer)
    }

    /// `POST /v1/accounts/{subject}/{route}/freeze`.
    pub async fn set_frozen(
        &self,
        subject: &Subject,
        route: &Route,
        frozen: bool,
    ) -> Result<RouteControlResponse, CallError> {
        let path = format!("/v1/accounts/{subject}/{route}/freeze");
        let body = Self::encode(&FreezeBody { frozen });
        let answer = self
            .send_with_retry(Method::POST, &path, Some(body), Auth::Operator, false)
            .await?;
        parse_json(&answer)
    }

    /// `GET /v1/audit`. Drift is an answer too: `ok: false` (the service's
    /// 500) comes back as `Ok`.
    pub async fn audit(&self) -> Result<AuditResponse, CallError> {
        let answer = self
            .send_with_retry(Method::GET, "/v1/audit", None, Auth::Operator, true)
            .await?;
        parse_json(&answer)
    }

    /// `GET /v1/accounts/{subject}/{route}` (operator).
    pub async fn accounts(
        &self,
        subject: &Subject,
        route: &Route,
    ) -> Result<AccountsResponse, CallError> {
        let path = format!("/v1/accounts/{subject}/{route}");
        let answer = self
            .send_with_retry(Method::GET, &path, None, Auth::Operator, false)
            .await?;
        parse_json(&answer)
    }

    // ----- agent calls -----

    /// `POST /v1/reservations`, one attempt. On
    /// [`CallError::OutcomeUnknown`] the caller holds `RESERVATION_UNKNOWN`
    /// and resolves it with the same request (or [`Self::abandon`]).
    pub async fn reserve(&self, request: &ReserveRequest) -> Result<ReserveReply, CallError> {
        let body = Self::encode(&ReserveBody::from(request.clone()));
        let answer = self
            .send(
                Method::POST,
                "/v1/reservations",
                Some(body),
                Auth::Agent,
                false,
            )
            .await?;
        Self::reserve_reply(&answer)
    }

    /// `POST /v1/reservations`, repeated under the same reservation ID while
    /// the outcome is unknown (within the retry policy).
    pub async fn reserve_with_retry(
        &self,
        request: &ReserveRequest,
    ) -> Result<ReserveReply, CallError> {
        let body = Self::encode(&ReserveBody::from(request.clone()));
        let answer = self
            .send_with_retry(
                Method::POST,
                "/v1/reservations",
                Some(body),
                Auth::Agent,
                false,
            )
            .await?;
        Self::reserve_reply(&answer)
    }

    fn reserve_reply(answer: &HttpAnswer) -> Result<ReserveReply, CallError> {
        match answer.outcome() {
            Outcome::NotEnforced => Ok(ReserveReply::NotEnforced),
            Outcome::Shadow => Ok(ReserveReply::Shadow {
                receipt: parse_document(answer)?,
                would_reject: answer.would_reject(),
            }),
            Outcome::Duplicate => Ok(ReserveReply::Duplicate(parse_document(answer)?)),
            _ if answer.status == StatusCode::CREATED => {
                Ok(ReserveReply::Reserved(parse_document(answer)?))
            }
            other => Err(CallError::Protocol(format!(
                "unexpected reservation outcome {other:?} with {}",
                answer.status
            ))),
        }
    }

    /// `GET /v1/reservations/{reservation}`: the receipt as it is now.
    pub async fn reservation(&self, id: &ReservationId) -> Result<LimitReservationV1, CallError> {
        let path = format!("/v1/reservations/{id}");
        let answer = self
            .send_with_retry(Method::GET, &path, None, Auth::Agent, false)
            .await?;
        parse_document(&answer)
    }

    /// `POST /v1/reservations/{reservation}/start` (retried: idempotent
    /// under the operation ID).
    pub async fn start(
        &self,
        id: &ReservationId,
        body: &StartBody,
    ) -> Result<StartReply, CallError> {
        let path = format!("/v1/reservations/{id}/start");
        let answer = self
            .send_with_retry(
                Method::POST,
                &path,
                Some(Self::encode(body)),
                Auth::Agent,
                false,
            )
            .await?;
        let receipt = parse_document(&answer)?;
        Ok(match answer.outcome() {
            Outcome::Duplicate => StartReply::Duplicate(receipt),
            _ => StartReply::Started(receipt),
        })
    }

    /// `POST /v1/reservations/{reservation}/settle` (retried: a repeat
    /// returns the first settlement receipt).
    pub async fn settle(
        &self,
        id: &ReservationId,
        body: &SettleBody,
    ) -> Result<SettleReply, CallError> {
        let path = format!("/v1/reservations/{id}/settle");
        let answer = self
            .send_with_retry(
                Method::POST,
                &path,
                Some(Self::encode(body)),
                Auth::Agent,
                false,
            )
            .await?;
        let receipt = parse_document(&answer)?;
        Ok(match answer.outcome() {
            Outcome::Duplicate => SettleReply::Duplicate(receipt),
            Outcome::Corrected => SettleReply::Corrected(receipt),
            _ => SettleReply::Settled(receipt),
        })
    }

    /// `POST /v1/reservations/{reservation}/release` (retried).
    pub async fn release(&self, id: &ReservationId) -> Result<ReleaseReply, CallError> {
        let path = format!("/v1/reservations/{id}/release");
        let answer = self
            .send_with_retry(Method::POST, &path, None, Auth::Agent, false)
            .await?;
        let receipt = parse_document(&answer)?;
        Ok(match answer.outcome() {
            Outcome::Duplicate => ReleaseReply::Duplicate(receipt),
            _ => ReleaseReply::Released(receipt),
        })
    }

    /// `POST /v1/reservations/{reservation}/abandon` (retried): tombstones an
    /// ID whose reserve outcome is unknown, so a late duplicate never
    /// reserves. `origin` shows the ID is this identity's own.
    pub async fn abandon(
        &self,
        id: &ReservationId,
        origin: &ReservationOrigin,
    ) -> Result<AbandonResponse, CallError> {
        let path = format!("/v1/reservations/{id}/abandon");
        let body = Self::encode(&AbandonBody::from(origin.clone()));
        let answer = self
            .send_with_retry(Method::POST, &path, Some(body), Auth::Agent, false)
            .await?;
        parse_json(&answer)
    }

    /// `POST /v1/reservations/{reservation}/abandon` with the operator token:
    /// releases any identity's unstarted reservation.
    pub async fn abandon_as_operator(
        &self,
        id: &ReservationId,
    ) -> Result<AbandonResponse, CallError> {
        let path = format!("/v1/reservations/{id}/abandon");
        let answer = self
            .send_with_retry(Method::POST, &path, None, Auth::Operator, false)
            .await?;
        parse_json(&answer)
    }

    /// `GET /v1/reservations/{reservation}` with the operator token: any
    /// identity's reservation.
    pub async fn reservation_as_operator(
        &self,
        id: &ReservationId,
    ) -> Result<LimitReservationV1, CallError> {
        let path = format!("/v1/reservations/{id}");
        let answer = self
            .send_with_retry(Method::GET, &path, None, Auth::Operator, false)
            .await?;
        parse_document(&answer)
    }

    /// `POST /v1/gateways/{identity}/boot`: registers this process's boot
    /// with a fresh request ([`BootBody::fresh`]). Never retried: every
    /// registration supersedes the previous boot, and a repeat of the same
    /// request is refused as a replay (`boot_replayed`). After an unknown
    /// outcome, register again.
    pub async fn boot(&self) -> Result<BootResponse, CallError> {
        let body = BootBody::fresh().map_err(|error| {
            CallError::NotSent(format!("no randomness for a boot nonce: {error}"))
        })?;
        self.boot_with(&body).await
    }

    /// [`Self::boot`] with the request `body` (a test may replay one).
    pub async fn boot_with(&self, body: &BootBody) -> Result<BootResponse, CallError> {
        let identity = self
            .identity()
            .ok_or_else(|| CallError::NotSent("a boot needs an identity key".to_owned()))?;
        let path = format!("/v1/gateways/{identity}/boot");
        let answer = self
            .send(
                Method::POST,
                &path,
                Some(Self::encode(body)),
                Auth::Agent,
                false,
            )
            .await?;
        parse_json(&answer)
    }

    /// `POST /v1/shards`: an emergency shard for the current boot. With
    /// `body.shard` set the call is idempotent and retried; without, the
    /// service picks the ID and the call is sent once.
    pub async fn issue_shard(&self, body: &IssueShardBody) -> Result<ShardReply, CallError> {
        let encoded = Some(Self::encode(body));
        let answer = if body.shard.is_some() {
            self.send_with_retry(Method::POST, "/v1/shards", encoded, Auth::Agent, false)
                .await?
        } else {
            self.send(Method::POST, "/v1/shards", encoded, Auth::Agent, false)
                .await?
        };
        let shard = parse_document(&answer)?;
        Ok(match answer.outcome() {
            Outcome::Duplicate => ShardReply::Duplicate(shard),
            _ => ShardReply::Issued(shard),
        })
    }

    /// `POST /v1/shards/{shard}/receipt` (retried: reconciliation is exactly
    /// once, a repeat reports the first).
    pub async fn reconcile_shard(
        &self,
        receipt: &ShardTerminalReceiptV1,
    ) -> Result<ReconcileResponse, CallError> {
        let path = format!("/v1/shards/{}/receipt", receipt.shard);
        let body = shard_format::canonical_bytes(receipt);
        let answer = self
            .send_with_retry(Method::POST, &path, Some(body), Auth::Agent, false)
            .await?;
        parse_json(&answer)
    }

    /// Sends an agent call and reads its answer in the protocol's wire form:
    /// `Ok(Ok(answered))` or `Ok(Err(refusal))` for a definite answer,
    /// `Err` when the outcome is unknown, the call was not sent or the
    /// answer is unreadable.
    pub async fn answer(&self, call: AgentCall) -> Result<Answer, CallError> {
        let identity = self.identity().cloned();
        let (method, path, body, retried) = match &call {
            AgentCall::Boot(body) => {
                let identity = identity
                    .ok_or_else(|| CallError::NotSent("a boot needs an identity key".to_owned()))?;
                let path = format!("/v1/gateways/{identity}/boot");
                (Method::POST, path, Some(Self::encode(body)), false)
            }
            AgentCall::Reserve(request) => (
                Method::POST,
                "/v1/reservations".to_owned(),
                Some(Self::encode(&ReserveBody::from(request.clone()))),
                true,
            ),
            AgentCall::Get(id) => (Method::GET, format!("/v1/reservations/{id}"), None, true),
            AgentCall::Start(id, body) => (
                Method::POST,
                format!("/v1/reservations/{id}/start"),
                Some(Self::encode(body)),
                true,
            ),
            AgentCall::Settle(id, body) => (
                Method::POST,
                format!("/v1/reservations/{id}/settle"),
                Some(Self::encode(body)),
                true,
            ),
            AgentCall::Release(id) => (
                Method::POST,
                format!("/v1/reservations/{id}/release"),
                None,
                true,
            ),
            AgentCall::Abandon(id, body) => (
                Method::POST,
                format!("/v1/reservations/{id}/abandon"),
                Some(Self::encode(body)),
                true,
            ),
            AgentCall::IssueShard(body) => (
                Method::POST,
                "/v1/shards".to_owned(),
                Some(Self::encode(body)),
                body.shard.is_some(),
            ),
            AgentCall::Reconcile(receipt) => (
                Method::POST,
                format!("/v1/shards/{}/receipt", receipt.shard),
                Some(shard_format::canonical_bytes(receipt.as_ref())),
                true,
            ),
        };
        let sent = if retried {
            self.send_with_retry(method, &path, body, Auth::Agent, false)
                .await
        } else {
            self.send(method, &path, body, Auth::Agent, false).await
        };
        Self::read_answer(&call, sent)
    }

    /// `POST /v1/batch`: the reservation calls of `calls` in one signed
    /// request (retried as a whole under the same body while its outcome
    /// is unknown), applied in order at the center. One result per call,
    /// in order, each what [`Self::answer`] would have returned for the
    /// call alone: when the batch gets no answer every call's outcome is
    /// unknown; when it is refused as a whole (a bad signature, an unknown
    /// identity) every call is refused so. A call that cannot go in a
    /// batch ([`AgentCall::batch_operation`]) is [`CallError::NotSent`].
    pub async fn batch(&self, calls: &[AgentCall]) -> Vec<Result<Answer, CallError>> {
        let operations: Option<Vec<BatchOperation>> =
            calls.iter().map(AgentCall::batch_operation).collect();
        let Some(operations) = operations else {
            let refused =
                CallError::NotSent("boots, shards and receipts are not batched".to_owned());
            return calls.iter().map(|_| Err(refused.clone())).collect();
        };
        let body = Self::encode(&BatchBody { operations });
        let sent = self
            .send_with_retry(Method::POST, "/v1/batch", Some(body), Auth::Agent, false)
            .await;
        let answers = match sent {
            Ok(answer) => Self::batch_answers(&answer, calls.len()),
            Err(error) => Err(error),
        };
        match answers {
            Ok(answers) => calls
                .iter()
                .zip(answers)
                .map(|(call, answer)| Self::read_answer(call, answer))
                .collect(),
            Err(error) => calls
                .iter()
                .map(|call| Self::read_answer(call, Err(error.clone())))
                .collect(),
        }
    }

    /// A batch's 200 answer, one answer per operation, each sorted as a
    /// single call's answer is.
    fn batch_answers(
        answer: &HttpAnswer,
        count: usize,
    ) -> Result<Vec<Result<HttpAnswer, CallError>>, CallError> {
        let read: BatchAnswer<'_> = parse_json(answer)?;
        if read.results.len() != count {
            return Err(CallError::Protocol(format!(
                "the batch of {count} operations was answered with {} results",
                read.results.len()
            )));
        }
        let mut answers = Vec::with_capacity(count);
        for result in read.results {
            let status = StatusCode::from_u16(result.status).map_err(|_| {
                CallError::Protocol(format!("a batch result has status {}", result.status))
            })?;
            let mut headers = HeaderMap::new();
            let named = [
                (OUTCOME_HEADER, result.outcome),
                (WOULD_REJECT_HEADER, result.would_reject),
            ];
            for (name, value) in named {
                if let Some(value) = value.and_then(|value| HeaderValue::from_str(&value).ok()) {
                    headers.insert(name, value);
                }
            }
            let item = HttpAnswer {
                status,
                headers,
                body: result.body.get().as_bytes().to_vec(),
            };
            answers.push(item.sorted(false));
        }
        Ok(answers)
    }

    /// Reads the answer to `call` in the protocol's wire form.
    fn read_answer(
        call: &AgentCall,
        sent: Result<HttpAnswer, CallError>,
    ) -> Result<Answer, CallError> {
        let answer = match sent {
            Ok(answer) => answer,
            Err(CallError::Rejected(refusal)) => return Ok(Err(*refusal)),
            Err(error) => return Err(error),
        };
        let outcome = answer.outcome();
        let body = match call {
            AgentCall::Boot(_) => Body::Boot(parse_json(&answer)?),
            AgentCall::Reserve(_) if outcome == Outcome::NotEnforced => {
                Body::NotEnforced(parse_json(&answer)?)
            }
            AgentCall::Reserve(_)
            | AgentCall::Get(_)
            | AgentCall::Start(..)
            | AgentCall::Release(_) => Body::Reservation(Box::new(parse_document(&answer)?)),
            AgentCall::Settle(..) => Body::Settlement(Box::new(parse_document(&answer)?)),
            AgentCall::Abandon(..) => Body::Abandon(parse_json(&answer)?),
            AgentCall::IssueShard(_) => Body::Shard(Box::new(parse_document(&answer)?)),
            AgentCall::Reconcile(_) => Body::Reconciled(parse_json(&answer)?),
        };
        Ok(Ok(Answered {
            status: answer.status.as_u16(),
            outcome,
            body,
            would_reject: answer.would_reject(),
        }))
    }
}
