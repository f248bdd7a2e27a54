//! What a call can end in besides its answer.

use ledger::Dimension;

use crate::wire::{ErrorBody, RejectionDetails};

/// A call that did not produce its typed answer. The split matters to the
/// agent: after [`CallError::Rejected`] nothing changed at the center; after
/// [`CallError::OutcomeUnknown`] the call may have taken effect, so a
/// reservation is `RESERVATION_UNKNOWN` until the same request (same
/// reservation ID) is answered or the ID is abandoned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CallError {
    /// A definite answer refusing the call (4xx): nothing changed.
    #[error("rejected: {0}")]
    Rejected(Box<ApiError>),
    /// The request may have been sent and no answer arrived (deadline passed,
    /// connection lost, 5xx): the call may or may not have taken effect.
    /// Resolve by repeating it under the same ID.
    #[error("outcome unknown: {0}")]
    OutcomeUnknown(String),
    /// The request never left this process (no connection, no key or
    /// token): nothing happened.
    #[error("not sent: {0}")]
    NotSent(String),
    /// The service answered something this client cannot read.
    #[error("protocol error: {0}")]
    Protocol(String),
}

impl CallError {
    /// The refusal, if the service gave one.
    pub fn rejection(&self) -> Option<&ApiError> {
        match self {
            Self::Rejected(error) => Some(error),
            _ => None,
        }
    }

    /// Whether the call may have taken effect unseen.
    pub fn is_outcome_unknown(&self) -> bool {
        matches!(self, Self::OutcomeUnknown(_))
    }
}

/// The service's refusal: its status, stable code and message, and for a
/// 429 the limit that was hit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{status} {code}: {message}")]
pub struct ApiError {
    pub status: u16,
    /// The stable code (`rate_limited`, `idempotency_conflict`, …).
    pub code: String,
    pub message: String,
    /// 429 only: the dimension, the generation applied and Retry-After.
    pub rate_limit: Option<RateLimited>,
    /// Every other member of the error body.
    pub details: serde_json::Map<String, serde_json::Value>,
}

/// A 429: the limit hit and how long to wait.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RateLimited {
    pub dimension: Dimension,
    pub policy_generation: u64,
    /// From `Retry-After` (whole seconds); `None` when waiting alone will
    /// not help.
    pub retry_after_seconds: Option<u64>,
    /// The `RateLimit-Policy` field, for the caller's own subject.
    pub ratelimit_policy: Option<String>,
    /// The `RateLimit` field, for the caller's own subject.
    pub ratelimit: Option<String>,
}

impl ApiError {
    pub(crate) fn from_answer(
        status: u16,
        headers: &reqwest::header::HeaderMap,
        body: &[u8],
    ) -> Self {
        let header = |name: &str| {
            headers
                .get(name)
                .and_then(|value| value.to_str().ok())
                .map(str::to_owned)
        };
        let retry_after = header("retry-after");
        let Ok(parsed) = serde_json::from_slice::<ErrorBody>(body) else {
            return Self {
                status,
                code: "unreadable".to_owned(),
                message: String::from_utf8_lossy(body).into_owned(),
                rate_limit: None,
                details: serde_json::Map::new(),
            };
        };
        let rate_limit = (status == 429)
            .then(|| {
                serde_json::from_value::<RejectionDetails>(serde_json::Value::Object(
                    parsed.details.clone(),
                ))
                .ok()
            })
            .flatten()
            .map(|details| RateLimited {
                dimension: details.dimension,
                policy_generation: details.policy_generation,
                retry_after_seconds: retry_after
                    .as_deref()
                    .and_then(|value| value.trim().parse().ok())
                    .or(details.retry_after_seconds),
                ratelimit_policy: header("ratelimit-policy"),
                ratelimit: header("ratelimit"),
            });
        Self {
            status,
            code: parsed.error,
            message: parsed.message,
            rate_limit,
            details: parsed.details,
        }
    }
}
