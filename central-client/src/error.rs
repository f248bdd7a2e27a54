//! What a call can end in besides its answer.

use ledger::protocol::{ErrorCode, Refusal};

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

/// The service's refusal: its status, stable [`ErrorCode`](ledger::protocol::ErrorCode),
/// message and details; a 429's rejection (the limit hit, the generation
/// applied, Retry-After and the caller's own limit state) is
/// [`Refusal::rejection`].
pub type ApiError = Refusal;

/// Reads an error answer: its JSON body, with the status from the response
/// and `Retry-After` from the header where the body lacks it.
pub(crate) fn refusal_of_answer(
    status: u16,
    headers: &reqwest::header::HeaderMap,
    body: &[u8],
) -> Refusal {
    let retry_after = headers
        .get("retry-after")
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.trim().parse().ok());
    let mut refusal = serde_json::from_slice::<Refusal>(body).unwrap_or_else(|_| {
        Refusal::new(
            status,
            ErrorCode::Unrecognized,
            String::from_utf8_lossy(body).into_owned(),
        )
    });
    refusal.status = status;
    if refusal.details.retry_after_seconds.is_none() {
        refusal.details.retry_after_seconds = retry_after;
    }
    refusal
}
