"""How each answer of the agent maps to a result or an error (no I/O)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from reservoir_client import _protocol as protocol
from reservoir_client import errors
from reservoir_client._lease import exit_plan


def answer(status: int, body: dict[str, Any], **headers: str) -> tuple[int, httpx.Headers, bytes]:
    return status, httpx.Headers(headers), json.dumps(body).encode()


@pytest.mark.parametrize(
    ("status", "code", "kind"),
    [
        (400, "invalid_body", errors.InvalidRequest),
        (400, "invalid_path", errors.InvalidRequest),
        (400, "unreadable_body", errors.InvalidRequest),
        (403, "peer_not_allowed", errors.PeerNotAllowed),
        (403, "reservation_id_foreign", errors.Forbidden),
        (404, "reservation_not_found", errors.NotFound),
        (404, "no_such_endpoint", errors.NotFound),
        (404, "no_policy", errors.NoPolicy),
        (405, "method_not_allowed", errors.MethodNotAllowed),
        (409, "idempotency_conflict", errors.IdempotencyConflict),
        (409, "operation_conflict", errors.OperationConflict),
        (409, "settlement_conflict", errors.SettlementConflict),
        (409, "illegal_state", errors.IllegalState),
        (409, "reservation_expired", errors.ReservationExpired),
        (409, "reservation_abandoned", errors.ReservationAbandoned),
        (409, "a_code_added_later", errors.Conflict),
        # A code's class only where its status agrees; else the status's.
        (409, "no_policy", errors.Conflict),
        (401, "unknown_identity", errors.ReservoirError),
        (413, "body_too_large", errors.BodyTooLarge),
        (503, "reservation_unknown", errors.OutcomeUnknown),
        (503, "start_unknown", errors.OutcomeUnknown),
        (503, "central_unreachable", errors.Unavailable),
        (503, "emergency_debt", errors.Unavailable),
        (503, "too_many_open_reservations", errors.Unavailable),
        (503, "overloaded", errors.Unavailable),
        (503, "stopping", errors.Unavailable),
        (500, "internal", errors.OutcomeUnknown),
    ],
)
def test_every_error_code_has_its_class(status: int, code: str, kind: type[errors.ReservoirError]) -> None:
    with pytest.raises(kind) as raised:
        protocol.interpret(*answer(status, {"error": code, "message": "m", "field": "units"}))
    assert type(raised.value) is kind
    assert raised.value.status == status and raised.value.code == code


def test_a_503_carries_its_retry_after() -> None:
    with pytest.raises(errors.Unavailable) as raised:
        protocol.interpret(
            *answer(
                503, {"error": "overloaded", "message": "m", "retryAfterSeconds": 1}, **{"Retry-After": "3"}
            )
        )
    assert raised.value.retry_after == 3


def test_a_429_is_a_rejection_with_its_fields() -> None:
    body = {
        "error": "rate_limited",
        "message": "m",
        "reservation": "rl-1",
        "policyGeneration": 31,
        "dimension": "debt",
        "retryAfterSeconds": 7,
    }
    with pytest.raises(errors.Rejected) as raised:
        protocol.interpret(*answer(429, body, **{"Retry-After": "7", "RateLimit": '"budget";r=0;t=7'}))
    rejected = raised.value
    assert (rejected.retry_after, rejected.dimension, rejected.generation) == (7, "debt", 31)
    assert rejected.reservation == "rl-1" and rejected.rate_limit == '"budget";r=0;t=7'
    assert (rejected.status, rejected.code) == (429, "rate_limited")


def test_mode_off_is_an_admission_without_a_record() -> None:
    record = protocol.reservation(*answer(200, {"admitted": True, "mode": "off"}))
    assert record.reservation is None and record.state == "NOT_ENFORCED" and not record.enforced


def test_a_202_is_accepted_for_later_delivery() -> None:
    record = protocol.reservation(*answer(202, {"reservation": "rl-1", "state": "SETTLING", "units": 5}))
    assert record.accepted and record.state == "SETTLING"


@pytest.mark.parametrize(
    ("started", "ended", "raised", "actual", "unknown", "plan"),
    [
        (False, False, False, None, "reserved", ("release", 0, False)),
        (False, False, True, None, "reserved", ("release", 0, False)),
        (True, False, False, 40, "reserved", ("settle", 40, False)),
        (True, False, True, 40, "reserved", ("settle", 40, False)),
        (True, False, True, None, "reserved", ("settle", 600, False)),
        (True, False, False, None, "reserved", ("settle", 600, True)),
        (True, False, True, None, "leave", ("none", 0, False)),
        (True, True, False, None, "reserved", ("none", 0, False)),
    ],
)
def test_exit_plan(
    started: bool, ended: bool, raised: bool, actual: int | None, unknown: Any, plan: tuple[str, int, bool]
) -> None:
    got = exit_plan(
        enforced=True,
        started=started,
        ended=ended,
        raised=raised,
        actual_units=actual,
        reserved_units=600,
        on_unknown_usage=unknown,
    )
    assert (got.action, got.units, got.forgot) == plan


def test_retry_policy_waits_retry_after_capped_and_gives_up() -> None:
    policy = protocol.RetryPolicy(attempts_max=3, wait_max_s=2.0)
    unknown = errors.OutcomeUnknown("m", retry_after=5)
    assert policy.delay(unknown, 1) == 2.0
    assert policy.delay(unknown, 3) is None
    assert policy.delay(errors.Rejected("m", retry_after=1, dimension="capacity", generation=1), 1) is None


def test_a_flexible_reserve_sends_min_units_and_a_fixed_one_does_not() -> None:
    flexible = protocol.reserve("k", "s", "r", 700, min_units=300)
    fixed = protocol.reserve("k", "s", "r", 700)
    assert flexible.body is not None and flexible.body["minUnits"] == 300
    assert fixed.body is not None and "minUnits" not in fixed.body


def test_reserved_units_is_the_grant_and_falls_back_to_units() -> None:
    record = {"reservation": "rl-1", "state": "RESERVED", "units": 700, "minUnits": 300, "reservedUnits": 400}
    granted = protocol.reservation(*answer(201, record))
    older = protocol.reservation(*answer(201, {"reservation": "rl-2", "state": "RESERVED", "units": 700}))
    assert (granted.units, granted.reserved_units, granted.min_units) == (700, 400, 300)
    assert granted.granted_units == 400
    assert (older.reserved_units, older.granted_units, older.min_units) == (700, 700, None)
