"""The agent's socket API (docs/design.md §6.5) without I/O: the requests
to send and what each answer means. The sync and async clients are thin
shells that carry these requests over a Unix socket and hand the answers
back here, so both read every answer the same way.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from . import errors

#: The host name in request URLs; the socket decides where they go.
BASE_URL = "http://reservoir-agent"

#: A leg's ``(subject, route)`` pair: how a settle names the leg.
Pair = tuple[str, str]


@dataclass(frozen=True)
class Leg:
    """One leg of a multi-leg reserve (docs/design.md §3.13): ``units`` of
    the pair ``(subject, route)``, flexible down to ``min_units`` when
    given. The legs of one reservation are admitted all or none, each
    against its own pair's policy and account; their pairs are distinct."""

    subject: str
    route: str
    units: int
    min_units: int | None = None

    @property
    def pair(self) -> Pair:
        return (self.subject, self.route)


@dataclass(frozen=True)
class ReservationLeg:
    """One leg of a reservation as the agent answered it.

    ``units`` is what the leg asked for, ``min_units`` its floor (``None``
    for a fixed leg), :attr:`reserved_units` its grant (``None`` before it
    was admitted), ``actual_units`` what it settled at (``None`` before the
    settle) and ``shard`` the emergency shard its units came from, if any.
    """

    subject: str
    route: str
    units: int
    min_units: int | None = None
    reserved_units: int | None = None
    actual_units: int | None = None
    shard: str | None = None

    @property
    def pair(self) -> Pair:
        return (self.subject, self.route)

    @classmethod
    def from_record(cls, leg: Mapping[str, Any]) -> ReservationLeg:
        return cls(
            subject=_text(leg.get("subject")) or "",
            route=_text(leg.get("route")) or "",
            units=_integer(leg.get("units")) or 0,
            min_units=_integer(leg.get("minUnits")),
            reserved_units=_integer(leg.get("reservedUnits")),
            actual_units=_integer(leg.get("actualUnits")),
            shard=_text(leg.get("shard")),
        )


@dataclass(frozen=True)
class Request:
    """One call to the agent."""

    method: str
    path: str
    body: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class RetryPolicy:
    """How often, and how long, a lease retries an answer that is safe to
    retry under the same key (:class:`errors.Retryable`).

    ``attempts_max`` bounds the calls (the first included); each wait is the
    agent's ``Retry-After`` capped by ``wait_max_s``. A lease that runs out
    of attempts raises the last error.
    """

    attempts_max: int = 5
    wait_max_s: float = 2.0

    def delay(self, error: errors.ReservoirError, attempt: int) -> float | None:
        """Seconds to wait before attempt ``attempt + 1``, or ``None`` to give
        up and raise ``error``. ``attempt`` counts from 1."""
        if not isinstance(error, errors.Retryable) or attempt >= self.attempts_max:
            return None
        return float(min(max(error.retry_after, 0), self.wait_max_s))


@dataclass(frozen=True)
class Reservation:
    """The agent's record of one reservation, as it answered it.

    ``state`` is the agent's state (docs/design.md §3.1: ``RESERVED``,
    ``STARTED``, ``SETTLED``, ``SETTLED_WITH_DEBT``, ``RELEASED``, …), or
    ``NOT_ENFORCED`` for a route in mode ``off`` (admitted without a record;
    ``reservation`` is then ``None`` and start, settle and release are
    no-ops in a lease). ``accepted`` is true for a 202: the settle or
    release is journaled and the agent delivers it to the center later.
    ``raw`` is the whole record (``receipt``, ``settlement``, ``path`` …).

    ``units`` is what the reserve asked for; :attr:`reserved_units` is what
    the agent holds for it (the grant), which a flexible reserve
    (``min_units``) may have lowered.

    A multi-leg reservation's top-level ``subject``, ``route``, ``units``
    and grant are its first leg's; :attr:`legs` lists every leg.
    """

    reservation: str | None
    state: str
    units: int
    subject: str | None = None
    route: str | None = None
    idempotency_key: str | None = None
    operation_id: str | None = None
    actual_units: int | None = None
    shadow: bool = False
    created: bool = False
    accepted: bool = False
    raw: Mapping[str, Any] = field(default_factory=dict)

    @property
    def enforced(self) -> bool:
        """False for a route in mode ``off``."""
        return self.reservation is not None

    @property
    def reserved_units(self) -> int:
        """The units held: the grant (the answer's ``reservedUnits``). All of
        :attr:`units` for a fixed reserve; for a flexible one (``min_units``)
        the largest amount from :attr:`min_units` to :attr:`units` that could
        be covered when it was admitted. An answer without ``reservedUnits``
        (an agent older than flexible reservations) held all of ``units``.
        Settling above it is overage, charged like any other."""
        reserved = _integer(self.raw.get("reservedUnits"))
        return self.units if reserved is None else reserved

    @property
    def min_units(self) -> int | None:
        """A flexible reservation's floor, as the agent echoed it (``None``
        for a fixed one)."""
        return _integer(self.raw.get("minUnits"))

    @property
    def granted_units(self) -> int:
        """The units the caller may use: :attr:`reserved_units`. Size the
        work from it (the LiteLLM hook lowers ``max_tokens`` to it)."""
        return self.reserved_units

    @property
    def legs(self) -> tuple[ReservationLeg, ...]:
        """Every leg, the first included, in the order of the reserve, each
        with its grant (``reserved_units``) and, once settled, its
        ``actual_units``. A one-pair reservation has one leg (its own
        fields); a route in mode ``off`` has none."""
        legs = self.raw.get("legs")
        if isinstance(legs, list) and legs:
            return tuple(ReservationLeg.from_record(leg) for leg in legs if isinstance(leg, Mapping))
        if not self.enforced:
            return ()
        return (
            ReservationLeg(
                subject=self.subject or "",
                route=self.route or "",
                units=self.units,
                min_units=self.min_units,
                reserved_units=self.reserved_units,
                actual_units=self.actual_units,
            ),
        )

    @property
    def multi_leg(self) -> bool:
        """True for a reservation of several legs (settle it per leg)."""
        legs = self.raw.get("legs")
        return isinstance(legs, list) and len(legs) > 1

    def leg(self, subject: str, route: str) -> ReservationLeg:
        """The leg of the pair ``(subject, route)``; ``KeyError`` if none."""
        for leg in self.legs:
            if leg.pair == (subject, route):
                return leg
        raise KeyError((subject, route))

    @property
    def settlement(self) -> Mapping[str, Any] | None:
        value = self.raw.get("settlement")
        return value if isinstance(value, Mapping) else None

    @classmethod
    def from_record(cls, record: Mapping[str, Any], *, created: bool, accepted: bool) -> Reservation:
        if record.get("mode") == "off" and "reservation" not in record:
            return cls(reservation=None, state="NOT_ENFORCED", units=0, raw=record)
        return cls(
            reservation=_text(record.get("reservation")),
            state=_text(record.get("state")) or "",
            units=_integer(record.get("units")) or 0,
            subject=_text(record.get("subject")),
            route=_text(record.get("route")),
            idempotency_key=_text(record.get("idempotencyKey")),
            operation_id=_text(record.get("operationId")),
            actual_units=_integer(record.get("actualUnits")),
            shadow=bool(record.get("shadow", False)),
            created=created,
            accepted=accepted,
            raw=record,
        )


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _integer(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def reserve(
    idempotency_key: str,
    subject: str | None = None,
    route: str | None = None,
    units: int | None = None,
    *,
    legs: Iterable[Leg] | None = None,
    min_units: int | None = None,
    deadline_ms: int | None = None,
    priority: int | None = None,
    request: Any = None,
) -> Request:
    """``POST /v1/reservations``, for one pair (``subject``, ``route``,
    ``units``) or for several ``legs`` at once (docs/design.md §3.13), not
    both. ``min_units`` (1 to ``units``) makes the reserve flexible: the
    agent admits the largest amount from ``min_units`` to ``units`` it can
    cover now, instead of refusing what is not there whole (a leg gives its
    own ``Leg.min_units``). ``request`` is the gateway's free-form
    description of the work; it is part of the request digest. A retry under
    the same key must send the same ``request``, legs and floors.

    Raises ``ValueError`` for a call that gives both forms or neither, or
    no leg; the agent judges the legs themselves (a 400 names
    ``legs[i]...``)."""
    asked = reserve_form(subject, route, units, legs=legs, min_units=min_units)
    body: dict[str, Any] = {"idempotencyKey": idempotency_key}
    if asked is not None:
        body["legs"] = [_leg_body(leg) for leg in asked]
    else:
        body.update({"subject": subject, "route": route, "units": units})
        if min_units is not None:
            body["minUnits"] = min_units
    if deadline_ms is not None:
        body["deadlineMs"] = deadline_ms
    if priority is not None:
        body["priority"] = priority
    if request is not None:
        body["request"] = request
    return Request("POST", "/v1/reservations", body)


def reserve_form(
    subject: str | None,
    route: str | None,
    units: int | None,
    *,
    legs: Iterable[Leg] | None,
    min_units: int | None,
) -> tuple[Leg, ...] | None:
    """Checks that a reserve gives one pair or ``legs``, not both and not
    neither (``ValueError``); returns the legs (``None`` for one pair)."""
    if legs is None:
        if subject is None or route is None or units is None:
            raise ValueError("give subject, route and units, or legs")
        return None
    if subject is not None or route is not None or units is not None or min_units is not None:
        raise ValueError("give legs, or subject, route, units (and min_units), not both")
    asked = tuple(legs)
    if not asked:
        raise ValueError("a reservation has at least one leg")
    return asked


def _leg_body(leg: Leg) -> dict[str, Any]:
    asked: dict[str, Any] = {"subject": leg.subject, "route": leg.route, "units": leg.units}
    if leg.min_units is not None:
        asked["minUnits"] = leg.min_units
    return asked


def get(reservation: str) -> Request:
    return Request("GET", f"/v1/reservations/{reservation}")


def start(reservation: str, operation_id: str) -> Request:
    return Request("POST", f"/v1/reservations/{reservation}/start", {"operationId": operation_id})


def settle(
    reservation: str,
    operation_id: str,
    actual_units: int | None = None,
    *,
    legs: Mapping[Pair, int] | None = None,
) -> Request:
    """``POST /v1/reservations/{reservation}/settle`` with one number
    (``actual_units``, a one-pair reservation) or per leg (``legs``: the
    actual units of each ``(subject, route)``; a leg left out settles at its
    grant), not both. Raises ``ValueError`` for both or neither."""
    body: dict[str, Any] = {"operationId": operation_id}
    if (actual_units is None) == (legs is None):
        raise ValueError("give actual_units (one pair) or legs (per leg), not both")
    if legs is not None:
        body["legs"] = [
            {"subject": subject, "route": route, "actualUnits": actual}
            for (subject, route), actual in legs.items()
        ]
    else:
        body["actualUnits"] = actual_units
    return Request("POST", f"/v1/reservations/{reservation}/settle", body)


def release(reservation: str) -> Request:
    return Request("POST", f"/v1/reservations/{reservation}/release", {})


def cancel(reservation: str) -> Request:
    return Request("POST", f"/v1/reservations/{reservation}/cancel", {})


def status() -> Request:
    return Request("GET", "/v1/status")


def no_answer(request: Request, cause: BaseException) -> errors.OutcomeUnknown:
    """The error for a call that got no answer (timeout, refused or broken
    connection): its outcome is unknown."""
    return errors.OutcomeUnknown(
        f"no answer from the agent to {request.method} {request.path}: {cause!r}; "
        "retry under the same idempotency key",
        code="no_answer",
        retry_after=1,
    )


def _retry_after(headers: Mapping[str, str], body: Mapping[str, Any]) -> int:
    for value in (headers.get("retry-after"), body.get("retryAfterSeconds")):
        try:
            if value is not None:
                return max(int(value), 0)
        except (TypeError, ValueError):
            continue
    return 1


def interpret(status: int, headers: Mapping[str, str], content: bytes) -> Mapping[str, Any]:
    """The JSON body of a 2xx answer; any other answer raises its
    :mod:`errors` class. ``headers`` must be case-insensitive (httpx's are)."""
    try:
        body = json.loads(content) if content else {}
    except ValueError:
        body = {"message": content.decode(errors="replace")}
    if not isinstance(body, dict):
        body = {"message": str(body)}
    if 200 <= status < 300:
        return body
    code = str(body.get("error", ""))
    message = str(body.get("message", "")) or f"HTTP {status}"
    if status == 429:
        generation = body.get("policyGeneration")
        raise errors.Rejected(
            message,
            body=body,
            retry_after=_retry_after(headers, body),
            dimension=str(body.get("dimension", "")),
            generation=generation if isinstance(generation, int) else None,
            reservation=_text(body.get("reservation")),
            leg=_integer(body.get("leg")),
            subject=_text(body.get("subject")),
            route=_text(body.get("route")),
            rate_limit=headers.get("ratelimit"),
            rate_limit_policy=headers.get("ratelimit-policy"),
        )
    if status == 503:
        kind: type[errors.Retryable] = (
            errors.OutcomeUnknown if code in errors.UNKNOWN_CODES else errors.Unavailable
        )
        raise kind(message, status=status, code=code, body=body, retry_after=_retry_after(headers, body))
    if status >= 500:
        # A 5xx the contract does not name: the call may have happened.
        raise errors.OutcomeUnknown(
            message,
            status=status,
            code=code or "server_error",
            body=body,
            retry_after=_retry_after(headers, body),
        )
    if status == 409:
        raise errors.CONFLICTS.get(code, errors.Conflict)(message, status=status, code=code, body=body)
    kind = errors.BY_CODE.get(code)
    if kind is None or not issubclass(kind, errors.BY_STATUS.get(status, errors.ReservoirError)):
        kind = errors.BY_STATUS.get(status, errors.ReservoirError)
    raise kind(message, status=status, code=code, body=body)


def reservation(status: int, headers: Mapping[str, str], content: bytes) -> Reservation:
    """A reservation record answer (reserve, get, start, settle, release,
    cancel) as a :class:`Reservation`; errors raise."""
    record = interpret(status, headers, content)
    return Reservation.from_record(record, created=status == 201, accepted=status == 202)
