"""Multi-leg reservations (docs/design.md §3.13) through the sync and async
clients against a real agent and central service: one reserve holds a
request, tokens and a slot in flight of one tenant at once, every leg or
none; a settle charges each leg on its own account."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from cluster import Cluster, policy
from conftest import Pair, publish
from test_client import client

from reservoir_client import (
    AsyncClient,
    InvalidRequest,
    Leg,
    Rejected,
    Reservation,
    ReservationLeg,
)

#: Nothing refills while a test runs: every number below is exact.
NO_REFILL = {"units": 0, "intervalMs": 1000}


@dataclass
class Dimensions:
    """One tenant's three pairs: 10 requests, 1000 tokens (at most 800 a
    reservation), 2 in flight."""

    requests: Pair
    tokens: Pair
    concurrency: Pair

    @property
    def subject(self) -> str:
        return self.tokens.subject

    def pairs(self) -> list[Pair]:
        return [self.requests, self.tokens, self.concurrency]

    def legs(self, tokens: int, min_tokens: int | None = None) -> list[Leg]:
        """One LLM request: 1 request, ``tokens`` tokens, 1 in flight."""
        return [
            Leg(self.subject, self.requests.route, 1),
            Leg(self.subject, self.tokens.route, tokens, min_units=min_tokens),
            Leg(self.subject, self.concurrency.route, 1),
        ]

    def terms(self) -> list[tuple[int, int, int]]:
        """(available, reserved, spent) of each pair's current account."""
        return [(a["available"], a["reserved"], a["spent"]) for a in (p.account() for p in self.pairs())]


def dimension(cluster: Cluster, subject: str, route: str, opening: int, units_max: int) -> Pair:
    document = policy(
        subject,
        route,
        opening=opening,
        burst=opening,
        reservationUnitsMax=units_max,
        refill=NO_REFILL,
    )
    cluster.publish(document)
    return Pair(cluster, subject, route, document)


@pytest.fixture
def dims(cluster: Cluster) -> Dimensions:
    tokens = publish(cluster, route="llm.tokens", refill=NO_REFILL)
    return Dimensions(
        requests=dimension(cluster, tokens.subject, "llm.requests", 10, 10),
        tokens=tokens,
        concurrency=dimension(cluster, tokens.subject, "llm.concurrency", 2, 1),
    )


def leg_view(record: Reservation) -> list[tuple[str, int, int | None, int | None, int | None]]:
    """(route, units, min_units, reserved_units, actual_units) of each leg."""
    return [
        (leg.route, leg.units, leg.min_units, leg.reserved_units, leg.actual_units) for leg in record.legs
    ]


def test_every_leg_is_admitted_with_its_grant(dims: Dimensions, socket_path: str) -> None:
    with client(socket_path) as agent:
        # 700 of the 1000 tokens held by another request: the flexible tokens
        # leg (600 down to 100) is granted the 300 left.
        agent.reserve(f"{dims.subject}-other", dims.subject, dims.tokens.route, 700)
        record = agent.reserve(f"{dims.subject}-req-1", legs=dims.legs(600, min_tokens=100))

    assert record.created and record.state == "RESERVED" and record.multi_leg
    assert leg_view(record) == [
        ("llm.requests", 1, None, 1, None),
        ("llm.tokens", 600, 100, 300, None),
        ("llm.concurrency", 1, None, 1, None),
    ]
    assert all(leg.subject == dims.subject for leg in record.legs)
    assert record.leg(dims.subject, "llm.tokens").reserved_units == 300
    # The top-level fields are the first leg's.
    assert (record.route, record.units, record.reserved_units) == ("llm.requests", 1, 1)
    assert dims.terms() == [(9, 1, 0), (0, 1000, 0), (1, 1, 0)]


def test_a_one_pair_reservation_has_one_leg(pair: Pair, socket_path: str) -> None:
    with client(socket_path) as agent:
        record = agent.reserve(f"{pair.subject}-req-1", pair.subject, pair.route, 600, min_units=300)
    assert not record.multi_leg
    assert record.legs == (ReservationLeg(pair.subject, pair.route, 600, 300, 600, None),)


@pytest.mark.parametrize(
    ("tokens", "limiting", "dimension_refused"),
    [(100, 2, "capacity"), (801, 1, "reservationUnitsMax")],
    ids=["the slot leg: no slot left", "the tokens leg: one past reservationUnitsMax"],
)
def test_one_refused_leg_holds_nothing_on_any_leg(
    dims: Dimensions, socket_path: str, tokens: int, limiting: int, dimension_refused: str
) -> None:
    with client(socket_path) as agent:
        agent.reserve(f"{dims.subject}-req-1", legs=dims.legs(100))
        if limiting == 2:
            # The second of the two slots: none is left for the next request.
            agent.reserve(f"{dims.subject}-req-2", legs=dims.legs(100))
        before = dims.terms()
        with pytest.raises(Rejected) as refused:
            agent.reserve(f"{dims.subject}-req-3", legs=dims.legs(tokens))

    rejected = refused.value
    assert (rejected.leg, rejected.subject, rejected.route) == (
        limiting,
        dims.subject,
        dims.pairs()[limiting].route,
    )
    assert rejected.dimension == dimension_refused and rejected.retry_after >= 1
    assert f"on leg {limiting}" in str(rejected)
    assert dims.terms() == before
    held = 2 if limiting == 2 else 1
    assert before == [(10 - held, held, 0), (1000 - 100 * held, 100 * held, 0), (2 - held, held, 0)]


def test_a_one_pair_rejection_names_no_leg(pair: Pair, socket_path: str) -> None:
    with client(socket_path) as agent, pytest.raises(Rejected) as refused:
        agent.reserve(f"{pair.subject}-req-1", pair.subject, pair.route, 801)
    assert (refused.value.leg, refused.value.subject, refused.value.route) == (None, None, None)


def test_settle_per_leg_charges_each_leg_on_its_own_account(dims: Dimensions, socket_path: str) -> None:
    with client(socket_path) as agent:
        record = agent.reserve(f"{dims.subject}-req-1", legs=dims.legs(400))
        assert record.reservation is not None
        agent.start(record.reservation, "op-1")
        # 250 tokens used, the slot given back with 0; the request leg,
        # left out, settles at its grant of 1.
        settled = agent.settle(
            record.reservation,
            "op-1",
            legs={(dims.subject, "llm.tokens"): 250, (dims.subject, "llm.concurrency"): 0},
        )

    assert settled.state == "SETTLED"
    assert leg_view(settled) == [
        ("llm.requests", 1, None, 1, 1),
        ("llm.tokens", 400, None, 400, 250),
        ("llm.concurrency", 1, None, 1, 0),
    ]
    assert dims.terms() == [(9, 0, 1), (750, 0, 250), (2, 0, 0)]


def test_settling_above_a_legs_grant_is_overage_on_that_leg(dims: Dimensions, socket_path: str) -> None:
    """The tokens leg overran by 100: the debt lands on the tokens pair only."""
    with client(socket_path) as agent:
        agent.reserve(f"{dims.subject}-other", dims.subject, dims.tokens.route, 600)
        record = agent.reserve(f"{dims.subject}-req-1", legs=dims.legs(400))
        assert record.reservation is not None
        agent.start(record.reservation, "op-1")
        settled = agent.settle(record.reservation, "op-1", legs={(dims.subject, "llm.tokens"): 500})

    assert settled.state == "SETTLED_WITH_DEBT"
    assert dims.terms() == [(9, 0, 1), (0, 600, 500), (1, 0, 1)]
    assert [pair.debt() for pair in dims.pairs()] == [0, 100, 0]


@pytest.mark.parametrize(
    ("actuals", "field"),
    [
        (7, "actualUnits"),
        ({("someone-else", "llm.tokens"): 7}, "legs[0].route"),
    ],
    ids=["one number for three legs", "a pair that is not a leg"],
)
def test_a_settle_that_does_not_fit_the_legs_is_invalid(
    dims: Dimensions, socket_path: str, actuals: Any, field: str
) -> None:
    with client(socket_path) as agent:
        record = agent.reserve(f"{dims.subject}-req-1", legs=dims.legs(400))
        assert record.reservation is not None
        agent.start(record.reservation, "op-1")
        with pytest.raises(InvalidRequest) as invalid:
            if isinstance(actuals, int):
                agent.settle(record.reservation, "op-1", actuals)
            else:
                agent.settle(record.reservation, "op-1", legs=actuals)
        still = agent.get(record.reservation)

    assert (invalid.value.status, invalid.value.code, invalid.value.field) == (400, "invalid_legs", field)
    assert still.state == "STARTED"
    assert dims.terms() == [(9, 1, 0), (600, 400, 0), (1, 1, 0)]


@pytest.mark.parametrize(
    ("index", "route", "units", "min_units", "code", "field"),
    [
        (2, "llm.tokens", 1, None, "invalid_legs", "legs[2].route"),
        (1, "llm.tokens", 10, 11, "invalid_units", "legs[1].minUnits"),
        (1, "llm.tokens", 0, None, "invalid_units", "legs[1].units"),
        (2, "llm.unpublished", 1, None, "no_policy", "legs[2].route"),
    ],
    ids=["a pair twice", "a floor above the units", "no units", "a pair without a policy"],
)
def test_a_bad_leg_is_an_invalid_request_naming_it(
    dims: Dimensions,
    socket_path: str,
    index: int,
    route: str,
    units: int,
    min_units: int | None,
    code: str,
    field: str,
) -> None:
    legs = dims.legs(10)
    legs[index] = Leg(dims.subject, route, units, min_units)
    with client(socket_path) as agent, pytest.raises(InvalidRequest) as invalid:
        agent.reserve(f"{dims.subject}-req-1", legs=legs)

    assert (invalid.value.status, invalid.value.code, invalid.value.field) == (400, code, field)
    assert dims.terms() == [(10, 0, 0), (1000, 0, 0), (2, 0, 0)]


def test_nine_legs_are_too_many(dims: Dimensions, socket_path: str) -> None:
    legs = [Leg(dims.subject, f"llm.d{index}", 1) for index in range(9)]
    with client(socket_path) as agent, pytest.raises(InvalidRequest) as invalid:
        agent.reserve(f"{dims.subject}-req-1", legs=legs)
    assert (invalid.value.code, invalid.value.field) == ("invalid_legs", "legs")


@pytest.mark.parametrize(
    "call",
    [
        {"subject": "s", "route": "r", "units": 1, "legs": [Leg("s", "r", 1)]},
        {"legs": [Leg("s", "r", 1)], "min_units": 1},
        {"legs": []},
        {"subject": "s", "route": "r"},
    ],
    ids=["both forms", "min_units beside legs", "no leg", "neither"],
)
def test_a_reserve_gives_one_pair_or_legs(socket_path: str, call: dict[str, Any]) -> None:
    with client(socket_path) as agent:
        with pytest.raises(ValueError):
            agent.reserve("key", **call)
        with pytest.raises(ValueError):
            agent.lease("key", **call)


def test_a_settle_gives_one_number_or_legs(socket_path: str) -> None:
    with client(socket_path) as agent:
        with pytest.raises(ValueError):
            agent.settle("rl-x", "op-1", 5, legs={("s", "r"): 5})
        with pytest.raises(ValueError):
            agent.settle("rl-x", "op-1")


# -- leases ---------------------------------------------------------------


def test_a_lease_of_legs_settles_per_leg(dims: Dimensions, socket_path: str) -> None:
    with client(socket_path) as agent:
        with agent.lease(f"{dims.subject}-req-1", legs=dims.legs(500, min_tokens=50)) as lease:
            assert lease.granted_units == 1  # the first leg's
            assert lease.reservation is not None
            assert [leg.reserved_units for leg in lease.reservation.legs] == [1, 500, 1]
            assert dims.terms() == [(9, 1, 0), (500, 500, 0), (1, 1, 0)]
            lease.start()
            lease.leg_actuals[(dims.subject, "llm.tokens")] = 120
            lease.leg_actuals[(dims.subject, "llm.concurrency")] = 0

    assert lease.ended and lease.reservation.state == "SETTLED"
    assert [leg.actual_units for leg in lease.reservation.legs] == [1, 120, 0]
    assert dims.terms() == [(9, 0, 1), (880, 0, 120), (2, 0, 0)]


def test_a_lease_of_legs_that_never_reported_settles_every_leg_at_its_grant(
    dims: Dimensions, socket_path: str
) -> None:
    with client(socket_path) as agent, pytest.warns(UserWarning, match="settled every leg at its grant"):
        with agent.lease(f"{dims.subject}-req-1", legs=dims.legs(300)) as lease:
            lease.start()

    assert lease.reservation is not None and lease.reservation.state == "SETTLED"
    assert [leg.actual_units for leg in lease.reservation.legs] == [1, 300, 1]
    assert dims.terms() == [(9, 0, 1), (700, 0, 300), (1, 0, 1)]


def test_a_lease_of_legs_refused_holds_nothing(dims: Dimensions, socket_path: str) -> None:
    with client(socket_path) as agent, pytest.raises(Rejected) as refused:
        with agent.lease(f"{dims.subject}-req-1", legs=dims.legs(801)):
            raise AssertionError("the body never runs")
    assert (refused.value.leg, refused.value.route) == (1, "llm.tokens")
    assert dims.terms() == [(10, 0, 0), (1000, 0, 0), (2, 0, 0)]


async def test_an_async_lease_of_legs_settles_per_leg_or_releases(dims: Dimensions, socket_path: str) -> None:
    async def no_wait(_: float) -> None:
        return None

    async with AsyncClient(socket_path, sleep=no_wait) as agent:
        with pytest.raises(RuntimeError):
            async with agent.lease(f"{dims.subject}-req-1", legs=dims.legs(300)):
                assert dims.terms() == [(9, 1, 0), (700, 300, 0), (1, 1, 0)]
                raise RuntimeError("cancelled before it began")
        assert dims.terms() == [(10, 0, 0), (1000, 0, 0), (2, 0, 0)]

        async with agent.lease(f"{dims.subject}-req-2", legs=dims.legs(300)) as lease:
            await lease.start()
            await lease.settle(legs={(dims.subject, "llm.tokens"): 42, (dims.subject, "llm.concurrency"): 0})

    assert lease.reservation is not None
    assert [leg.actual_units for leg in lease.reservation.legs] == [1, 42, 0]
    assert dims.terms() == [(9, 0, 1), (958, 0, 42), (2, 0, 0)]
