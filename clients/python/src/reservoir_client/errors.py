"""The errors a Reservoir agent answers, as exceptions.

Callers branch on the exception's class or on ``code`` (the stable
``error`` member, docs/design.md §6.1), never on ``message``. The agent
answers the center's codes with the center's statuses: its own refusals use
the center's code for the same thing, and a refusal of the center (say 404
``no_policy``) is passed on as it came.

::

    ReservoirError                 every refusal or failure
    ├── Rejected                   429 rate_limited: not admitted now (retry_after, dimension, generation)
    ├── Retryable                  retry under the same idempotency key / operation ID
    │   ├── OutcomeUnknown         the call may or may not have taken effect
    │   └── Unavailable            503: the agent could not decide; nothing happened
    ├── Conflict                   409 (IdempotencyConflict, OperationConflict, IllegalState, ...)
    ├── NotFound                   404 (NoPolicy; reservation_not_found, no_such_endpoint)
    ├── InvalidRequest             400 (``field`` names the member)
    ├── Forbidden                  403 (PeerNotAllowed; reservation_id_foreign)
    ├── MethodNotAllowed           405
    └── BodyTooLarge               413
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class ReservoirError(Exception):
    """An answer that is not a success, or no answer at all.

    ``status`` is the HTTP status (0 when no answer came), ``code`` the
    agent's stable error code, ``body`` the whole JSON body.
    """

    def __init__(
        self,
        message: str,
        *,
        status: int = 0,
        code: str = "",
        body: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code
        self.body: Mapping[str, Any] = body or {}

    def __str__(self) -> str:
        prefix = f"{self.status} {self.code}: " if self.status else (f"{self.code}: " if self.code else "")
        return prefix + self.message


class Rejected(ReservoirError):
    """429: the center did not admit the reservation now (§6.4).

    ``retry_after`` is the agent's ``Retry-After`` in seconds; ``dimension``
    is why (``capacity``, ``debt``, ``frozen``, ``policyGeneration``,
    ``reservationUnitsMax``); ``generation`` is the policy generation whose
    rules refused. A retry under the same idempotency key asks again under
    the same reservation ID. ``rate_limit`` and ``rate_limit_policy`` are
    the center's IETF ``RateLimit`` / ``RateLimit-Policy`` fields for the
    caller's own subject and route, when it sent them.

    A refused multi-leg reserve names its limiting leg (the refused one with
    the longest ``Retry-After``): ``leg`` is its index in the reserve's
    legs, ``subject`` and ``route`` its pair, and the other fields are its
    rejection's. All three are ``None`` for a one-pair reserve.
    """

    def __init__(
        self,
        message: str,
        *,
        status: int = 429,
        code: str = "rate_limited",
        body: Mapping[str, Any] | None = None,
        retry_after: int,
        dimension: str,
        generation: int | None,
        reservation: str | None = None,
        leg: int | None = None,
        subject: str | None = None,
        route: str | None = None,
        rate_limit: str | None = None,
        rate_limit_policy: str | None = None,
    ) -> None:
        super().__init__(message, status=status, code=code, body=body)
        self.retry_after = retry_after
        self.dimension = dimension
        self.generation = generation
        self.reservation = reservation
        self.leg = leg
        self.subject = subject
        self.route = route
        self.rate_limit = rate_limit
        self.rate_limit_policy = rate_limit_policy

    def __str__(self) -> str:
        where = f" on leg {self.leg} ({self.subject}, {self.route})" if self.leg is not None else ""
        return (
            f"429 {self.code}: {self.dimension}{where} (policy generation {self.generation}); "
            f"retry after {self.retry_after} s"
        )


class Retryable(ReservoirError):
    """Safe to retry with the same idempotency key or operation ID, after
    ``retry_after`` seconds."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 0,
        code: str = "",
        body: Mapping[str, Any] | None = None,
        retry_after: int = 1,
    ) -> None:
        super().__init__(message, status=status, code=code, body=body)
        self.retry_after = retry_after


class OutcomeUnknown(Retryable):
    """The call may have taken effect or not: a reserve whose reply the
    agent lost (503 ``reservation_unknown``), a start whose reply was lost
    (503 ``start_unknown``), or no answer from the agent at all (timeout,
    broken connection; ``status`` 0).

    Retry **under the same idempotency key** (the same operation ID for a
    start, the same actual units for a settle): the agent maps the key to
    the same reservation ID, so a retry can never reserve twice. Never
    treat this as a refusal, and never make up a new key for it.
    """


class Unavailable(Retryable):
    """503: the agent could not decide (``central_unreachable`` with no
    shard, ``emergency_debt``, ``too_many_open_reservations``,
    ``overloaded``, ``stopping``). Retry with the same key after
    ``retry_after``."""


class Conflict(ReservoirError):
    """409: the request contradicts what the agent recorded."""


class IdempotencyConflict(Conflict):
    """409 ``idempotency_conflict``: the key was used with another request."""


class OperationConflict(Conflict):
    """409 ``operation_conflict``: another operation ID is bound."""


class SettlementConflict(Conflict):
    """409 ``settlement_conflict``: settled already with other actual units."""


class IllegalState(Conflict):
    """409 ``illegal_state``: not allowed in the reservation's state
    (e.g. a release after start)."""


class ReservationExpired(Conflict):
    """409 ``reservation_expired``: the hold ran out before the start."""


class ReservationAbandoned(Conflict):
    """409 ``reservation_abandoned``: the reservation ID was abandoned; it
    never reserves (use another idempotency key)."""


class NotFound(ReservoirError):
    """404: no such reservation (``reservation_not_found``), no such
    endpoint (``no_such_endpoint``), or :class:`NoPolicy`."""


class NoPolicy(NotFound):
    """404 ``no_policy``: the center has no policy for the subject and route."""


class InvalidRequest(ReservoirError):
    """400 ``invalid_body``, ``invalid_path``, ``invalid_units``,
    ``invalid_legs``, a leg's ``no_policy`` or ``unreadable_body``:
    ``field`` names the offending member, when one is (a leg's as
    ``legs[2].route``)."""

    @property
    def field(self) -> str:
        value = self.body.get("field", "")
        return value if isinstance(value, str) else ""


class Forbidden(ReservoirError):
    """403: not this caller's to do (``reservation_id_foreign``: the ID is
    not in the agent's namespace at the center), or :class:`PeerNotAllowed`."""


class PeerNotAllowed(Forbidden):
    """403 ``peer_not_allowed``: the socket's allow-list refused this uid/gid."""


class MethodNotAllowed(ReservoirError):
    """405 ``method_not_allowed``: the path does not answer that method
    (a client bug)."""


class BodyTooLarge(ReservoirError):
    """413 ``body_too_large``: bodies are limited to 64 KiB."""


#: 409 codes with their own class; any other 409 is a plain ``Conflict``.
CONFLICTS: dict[str, type[Conflict]] = {
    "idempotency_conflict": IdempotencyConflict,
    "operation_conflict": OperationConflict,
    "settlement_conflict": SettlementConflict,
    "illegal_state": IllegalState,
    "reservation_expired": ReservationExpired,
    "reservation_abandoned": ReservationAbandoned,
}

#: Codes of other statuses with their own class; any other answer gets its
#: status's class (``BY_STATUS``).
BY_CODE: dict[str, type[ReservoirError]] = {
    "no_policy": NoPolicy,
    "peer_not_allowed": PeerNotAllowed,
}

#: The class of each status that has one.
BY_STATUS: dict[int, type[ReservoirError]] = {
    400: InvalidRequest,
    403: Forbidden,
    404: NotFound,
    405: MethodNotAllowed,
    413: BodyTooLarge,
}

#: 503 codes that leave the outcome unknown; every other 503 is ``Unavailable``.
UNKNOWN_CODES = frozenset({"reservation_unknown", "start_unknown"})
