//! The answers gateways get, shared by every concern.

use crate::{AgentReservation, GatewayResponse};
use ledger::protocol::ErrorCode;

pub(crate) fn reservation_response(record: &AgentReservation, created: bool) -> GatewayResponse {
    GatewayResponse::Reservation {
        created,
        reservation: Box::new(record.clone()),
    }
}

pub(crate) fn unknown_response(record: &AgentReservation) -> GatewayResponse {
    GatewayResponse::Unavailable {
        code: ErrorCode::ReservationUnknown,
        message: format!(
            "the outcome of reservation {} is unknown; retry with the same idempotency key",
            record.reservation
        ),
        retry_after_seconds: 1,
    }
}

pub(crate) fn expired_response(record: &AgentReservation) -> GatewayResponse {
    GatewayResponse::Conflict {
        code: ErrorCode::ReservationExpired,
        message: format!(
            "reservation {} expired before it started; reserve again",
            record.reservation
        ),
    }
}

pub(crate) fn illegal_state(record: &AgentReservation, operation: &str) -> GatewayResponse {
    GatewayResponse::Conflict {
        code: ErrorCode::IllegalState,
        message: format!(
            "reservation {} is {:?}; {operation} is not allowed from there",
            record.reservation, record.state
        ),
    }
}

/// The center's definite refusal, passed on as it came: its status, its
/// code and its sentence mean the same at the agent (docs/design.md §6.1).
pub(crate) fn refused_response(status: u16, code: ErrorCode, message: String) -> GatewayResponse {
    GatewayResponse::Refused {
        status,
        code,
        message,
    }
}

/// A 400 naming leg `index`'s field at fault, as the center names it.
pub(crate) fn invalid_leg(index: usize, problem: ledger::LegProblem) -> GatewayResponse {
    let refusal = ledger::protocol::Refusal::invalid_leg(index, problem);
    GatewayResponse::Invalid {
        code: refusal.error,
        field: refusal.details.field.unwrap_or_default(),
        message: refusal.message,
    }
}
