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
        code: ErrorCode::Expired,
        message: format!(
            "reservation {} expired before it started; reserve again",
            record.reservation
        ),
    }
}

pub(crate) fn illegal_state(record: &AgentReservation, operation: &str) -> GatewayResponse {
    GatewayResponse::Conflict {
        code: ErrorCode::IllegalTransition,
        message: format!(
            "reservation {} is {:?}; {operation} is not allowed from there",
            record.reservation, record.state
        ),
    }
}

pub(crate) fn refused_response(code: ErrorCode, message: String) -> GatewayResponse {
    if code == ErrorCode::ReservationNotFound {
        return GatewayResponse::NotFound;
    }
    GatewayResponse::Conflict {
        code: ErrorCode::CentralRefused,
        message: format!("{code}: {message}"),
    }
}
