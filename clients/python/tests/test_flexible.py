"""Flexible reservations (issue 16) through the sync and async clients
against a real agent and central service: a reserve with ``min_units`` is
granted the largest amount from ``min_units`` to ``units`` the account
covers, and refused only when not even ``min_units`` is there. Each test
asks for the ``flexible`` fixture (conftest.py)."""

from __future__ import annotations

from typing import Any

import pytest
from cluster import Cluster
from conftest import Pair, publish
from test_client import client

from reservoir_client import AsyncClient, IdempotencyConflict, InvalidRequest, Rejected

#: 100 units an hour: no refill lands while a test runs, so every grant
#: below is exact.
SLOW_REFILL = {"units": 100, "intervalMs": 3_600_000}


def flexible_pair(cluster: Cluster) -> Pair:
    """The §4.7-shaped policy (1000 units, at most 800 a reservation)
    refilling 100 an hour."""
    return publish(cluster, refill=SLOW_REFILL)


def reserved(pair: Pair) -> int:
    """Units held on every account of the pair (0 before any was opened)."""
    accounts: list[dict[str, Any]] = pair.cluster.accounts(pair.subject, pair.route)["accounts"]
    return sum(account["reserved"] for account in accounts)


def test_a_flexible_reserve_is_granted_what_is_left(
    cluster: Cluster, socket_path: str
) -> None:
    pair = flexible_pair(cluster)
    with client(socket_path) as agent:
        fixed = agent.reserve(f"{pair.subject}-req-1", pair.subject, pair.route, 600)
        record = agent.reserve(f"{pair.subject}-req-2", pair.subject, pair.route, 700, min_units=300)

    # A fixed reserve holds what it asked.
    assert (fixed.units, fixed.reserved_units, fixed.min_units) == (600, 600, None)
    # 400 are left of 1000: the flexible one holds all of them.
    assert record.created and record.state == "RESERVED"
    assert (record.units, record.min_units, record.reserved_units) == (700, 300, 400)
    assert record.granted_units == 400
    receipt = record.raw["receipt"]
    assert (receipt["reservedUnits"], receipt["requestedUnits"], receipt["minUnits"]) == (400, 700, 300)
    account = pair.account()
    assert account["reserved"] == 1000 and account["available"] == 0


def test_the_grant_is_capped_by_reservation_units_max(
    cluster: Cluster, socket_path: str
) -> None:
    """900 asked, 1000 available, at most 800 a reservation: a fixed reserve
    is refused, a flexible one whose floor is within the max gets 800."""
    pair = flexible_pair(cluster)
    with client(socket_path) as agent:
        with pytest.raises(Rejected) as refused:
            agent.reserve(f"{pair.subject}-req-1", pair.subject, pair.route, 900)
        record = agent.reserve(f"{pair.subject}-req-2", pair.subject, pair.route, 900, min_units=800)
        with pytest.raises(Rejected) as over_max:
            agent.reserve(f"{pair.subject}-req-3", pair.subject, pair.route, 900, min_units=801)

    assert refused.value.dimension == "reservationUnitsMax"
    assert record.reserved_units == 800
    assert over_max.value.dimension == "reservationUnitsMax"
    assert pair.account()["reserved"] == 800


@pytest.mark.parametrize(
    ("min_units", "granted"),
    [(400, 400), (401, None)],
    ids=["floor exactly what is left: admitted", "floor one more: refused"],
)
def test_the_floor_is_admitted_exactly_at_what_is_left(
    cluster: Cluster, socket_path: str, min_units: int, granted: int | None
) -> None:
    pair = flexible_pair(cluster)
    with client(socket_path) as agent:
        agent.reserve(f"{pair.subject}-req-1", pair.subject, pair.route, 600)  # 400 left
        if granted is not None:
            record = agent.reserve(
                f"{pair.subject}-req-2", pair.subject, pair.route, 700, min_units=min_units
            )
            assert record.reserved_units == granted
        else:
            with pytest.raises(Rejected) as refused:
                agent.reserve(f"{pair.subject}-req-2", pair.subject, pair.route, 700, min_units=min_units)
            # One unit missing, refilled at 100 an hour.
            assert refused.value.dimension == "capacity" and refused.value.retry_after == 3600

    account = pair.account()
    # Refused, the flexible reserve holds nothing.
    assert account["reserved"] == 600 + (granted or 0)
    assert account["available"] == 400 - (granted or 0)


@pytest.mark.parametrize(
    ("min_units", "granted"),
    [(0, None), (1, 700), (700, 700), (701, None)],
    ids=["zero: invalid", "one: valid", "units: valid", "one past units: invalid"],
)
def test_min_units_must_be_between_one_and_units(
    cluster: Cluster, socket_path: str, min_units: int, granted: int | None
) -> None:
    pair = flexible_pair(cluster)
    with client(socket_path) as agent:
        if granted is not None:
            record = agent.reserve(
                f"{pair.subject}-req-1", pair.subject, pair.route, 700, min_units=min_units
            )
            assert record.reserved_units == granted and record.min_units == min_units
        else:
            with pytest.raises(InvalidRequest) as invalid:
                agent.reserve(f"{pair.subject}-req-1", pair.subject, pair.route, 700, min_units=min_units)
            assert (invalid.value.status, invalid.value.code) == (400, "invalid_units")
            assert invalid.value.field == "minUnits"
    assert reserved(pair) == (granted or 0)


def test_a_retry_must_repeat_the_same_min_units(cluster: Cluster, socket_path: str) -> None:
    pair = flexible_pair(cluster)
    key = f"{pair.subject}-req-1"
    with client(socket_path) as agent:
        agent.reserve(f"{pair.subject}-req-0", pair.subject, pair.route, 600)
        first = agent.reserve(key, pair.subject, pair.route, 700, min_units=300)
        again = agent.reserve(key, pair.subject, pair.route, 700, min_units=300)
        with pytest.raises(IdempotencyConflict):
            agent.reserve(key, pair.subject, pair.route, 700, min_units=301)
        with pytest.raises(IdempotencyConflict):
            agent.reserve(key, pair.subject, pair.route, 700)

    assert again.reservation == first.reservation and not again.created
    assert again.reserved_units == first.reserved_units == 400
    assert pair.account()["reserved"] == 1000


def test_a_lease_that_never_reports_usage_settles_at_the_grant(
    cluster: Cluster, socket_path: str
) -> None:
    """The full reservation of a flexible lease is its grant: settling at
    the ask would charge overage it never held."""
    pair = flexible_pair(cluster)
    with client(socket_path) as agent:
        agent.reserve(f"{pair.subject}-req-0", pair.subject, pair.route, 600)
        with pytest.raises(TimeoutError):
            with agent.lease(f"{pair.subject}-req-1", pair.subject, pair.route, 700, min_units=300) as lease:
                assert lease.granted_units == 400
                lease.start()
                raise TimeoutError("the executor did not answer")

    assert lease.reservation is not None and lease.reservation.state == "SETTLED"
    account = pair.account()
    assert account["spent"] == 400 and account["reserved"] == 600 and account["overdraftIssued"] == 0


async def test_the_async_lease_is_granted_what_is_left(
    cluster: Cluster, socket_path: str
) -> None:
    pair = flexible_pair(cluster)

    async def no_wait(_: float) -> None:
        return None

    async with AsyncClient(socket_path, sleep=no_wait) as agent:
        await agent.reserve(f"{pair.subject}-req-0", pair.subject, pair.route, 800)
        async with agent.lease(
            f"{pair.subject}-req-1", pair.subject, pair.route, 500, min_units=100
        ) as lease:
            assert lease.granted_units == 200
            await lease.start()
            lease.actual_units = 150

    account = pair.account()
    assert account["spent"] == 150 and account["reserved"] == 800 and account["available"] == 50
