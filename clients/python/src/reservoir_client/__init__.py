"""A client for a Reservoir agent's socket API, sync and async, and a
LiteLLM hook (:mod:`reservoir_client.litellm_hook`).

Reserve before the work, start right before it begins, settle with what it
used (or release if it never began), exactly once::

    from reservoir_client import Client, Rejected

    with Client("/run/reservoir-agent/agent.sock") as agent:
        try:
            with agent.lease("req-42", "tenant-7", "chat.generate", units=600) as lease:
                lease.start()
                lease.actual_units = run_the_work()
        except Rejected as rejected:
            retry_in(rejected.retry_after)
"""

from ._protocol import Leg, Reservation, ReservationLeg, RetryPolicy
from .aio import AsyncClient, AsyncLease
from .client import DEFAULT_SOCKET, Client, Lease
from .errors import (
    BodyTooLarge,
    Conflict,
    Forbidden,
    IdempotencyConflict,
    IllegalState,
    InvalidRequest,
    MethodNotAllowed,
    NoPolicy,
    NotFound,
    OperationConflict,
    OutcomeUnknown,
    PeerNotAllowed,
    Rejected,
    ReservationAbandoned,
    ReservationExpired,
    ReservoirError,
    Retryable,
    SettlementConflict,
    Unavailable,
)

__all__ = [
    "DEFAULT_SOCKET",
    "AsyncClient",
    "AsyncLease",
    "BodyTooLarge",
    "Client",
    "Conflict",
    "Forbidden",
    "IdempotencyConflict",
    "IllegalState",
    "InvalidRequest",
    "Lease",
    "Leg",
    "MethodNotAllowed",
    "NoPolicy",
    "NotFound",
    "OperationConflict",
    "OutcomeUnknown",
    "PeerNotAllowed",
    "Rejected",
    "Reservation",
    "ReservationAbandoned",
    "ReservationLeg",
    "ReservationExpired",
    "ReservoirError",
    "Retryable",
    "RetryPolicy",
    "SettlementConflict",
    "Unavailable",
]

__version__ = "0.1.0"
