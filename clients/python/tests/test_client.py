"""The sync client and its lease against a real agent and central service."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from cluster import ROUTE_OFF, Cluster
from conftest import Pair

from reservoir_client import (
    Client,
    IdempotencyConflict,
    IllegalState,
    NoPolicy,
    NotFound,
    OutcomeUnknown,
    Rejected,
    RetryPolicy,
)


def client(socket_path: str, **options: Any) -> Client:
    return Client(socket_path, sleep=lambda _: None, **options)


def test_reserve_start_settle_refunds_the_rest(pair: Pair, socket_path: str) -> None:
    with client(socket_path) as agent:
        reserved = agent.reserve(f"{pair.subject}-req-1", pair.subject, pair.route, 600)
        assert reserved.created and reserved.state == "RESERVED" and reserved.units == 600
        assert reserved.reservation is not None and reserved.reservation.startswith("rl-")
        assert pair.account()["reserved"] == 600

        started = agent.start(reserved.reservation, "op-1")
        assert started.state == "STARTED" and started.operation_id == "op-1"
        settled = agent.settle(reserved.reservation, "op-1", 200)

    assert settled.state == "SETTLED" and settled.actual_units == 200
    assert settled.settlement is not None and settled.settlement["refundedUnits"] == 400
    account = pair.account()
    assert account["reserved"] == 0 and account["spent"] == 200


def test_release_gives_every_unit_back(pair: Pair, socket_path: str) -> None:
    with client(socket_path) as agent:
        reserved = agent.reserve(f"{pair.subject}-req-1", pair.subject, pair.route, 600)
        assert reserved.reservation is not None
        released = agent.release(reserved.reservation)
        assert released.state == "RELEASED"
        # A release after the start is refused: the work may be running.
        other = agent.reserve(f"{pair.subject}-req-2", pair.subject, pair.route, 10)
        assert other.reservation is not None
        agent.start(other.reservation, "op-2")
        with pytest.raises(IllegalState):
            agent.release(other.reservation)
    account = pair.account()
    assert account["reserved"] == 10 and account["spent"] == 0


def test_a_rejection_says_when_and_why(pair: Pair, socket_path: str) -> None:
    with client(socket_path) as agent:
        agent.reserve(f"{pair.subject}-req-1", pair.subject, pair.route, 800)  # exactly reservationUnitsMax
        with pytest.raises(Rejected) as capacity:
            agent.reserve(f"{pair.subject}-req-2", pair.subject, pair.route, 800)
        with pytest.raises(Rejected) as too_large:
            agent.reserve(f"{pair.subject}-req-3", pair.subject, pair.route, 801)  # one past it
        # What is left is admitted; one unit more is not.
        agent.reserve(f"{pair.subject}-req-4", pair.subject, pair.route, 200)
        with pytest.raises(Rejected):
            agent.reserve(f"{pair.subject}-req-5", pair.subject, pair.route, 1)

    assert capacity.value.dimension == "capacity" and capacity.value.generation == 1
    # 600 missing at 100 per second.
    assert capacity.value.retry_after == 6
    assert capacity.value.rate_limit_policy == '"budget";q=1000;w=10'
    assert capacity.value.reservation is not None
    assert too_large.value.dimension == "reservationUnitsMax" and too_large.value.retry_after == 60
    assert pair.account()["reserved"] == 1000


def test_a_repeated_key_answers_the_same_reservation(pair: Pair, socket_path: str) -> None:
    """An idempotency key names one logical request at its agent (across
    every subject and route): a repeat answers the same reservation, the
    same key for another request is a conflict."""
    with client(socket_path) as agent:
        first = agent.reserve(f"{pair.subject}-req-1", pair.subject, pair.route, 600)
        again = agent.reserve(f"{pair.subject}-req-1", pair.subject, pair.route, 600)
        with pytest.raises(IdempotencyConflict):
            agent.reserve(f"{pair.subject}-req-1", pair.subject, pair.route, 601)

    assert again.reservation == first.reservation
    assert first.created and not again.created
    assert pair.account()["reserved"] == 600


def test_lease_settles_with_the_actual_units(pair: Pair, socket_path: str) -> None:
    with client(socket_path) as agent:
        with agent.lease(f"{pair.subject}-req-1", pair.subject, pair.route, 600) as lease:
            assert lease.granted_units == 600
            lease.start()
            lease.actual_units = 250

    assert lease.reservation is not None and lease.reservation.state == "SETTLED"
    account = pair.account()
    assert account["spent"] == 250 and account["reserved"] == 0


def test_lease_releases_when_the_body_raises_before_start(pair: Pair, socket_path: str) -> None:
    with client(socket_path) as agent:
        with pytest.raises(ValueError):
            with agent.lease(f"{pair.subject}-req-1", pair.subject, pair.route, 600):
                raise ValueError("the request was invalid")
    account = pair.account()
    assert account["reserved"] == 0 and account["spent"] == 0


def test_lease_settles_the_whole_reservation_when_usage_is_unknown(pair: Pair, socket_path: str) -> None:
    with client(socket_path) as agent:
        with pytest.raises(TimeoutError):
            with agent.lease(f"{pair.subject}-req-1", pair.subject, pair.route, 600) as lease:
                lease.start()
                raise TimeoutError("the executor did not answer")
    assert lease.reservation is not None and lease.reservation.settlement is not None
    account = pair.account()
    assert account["spent"] == 600 and account["reserved"] == 0


def test_lease_ends_once_when_the_body_settled_itself(pair: Pair, socket_path: str) -> None:
    with client(socket_path) as agent:
        with agent.lease(f"{pair.subject}-req-1", pair.subject, pair.route, 600) as lease:
            lease.start()
            lease.settle(100)
            # A second settle with other units would be a conflict; the
            # exit must not send one.
    account = pair.account()
    assert account["spent"] == 100 and account["reserved"] == 0


def test_lease_raises_a_rejection_and_holds_nothing(pair: Pair, socket_path: str) -> None:
    with client(socket_path) as agent:
        with pytest.raises(Rejected) as refused:
            with agent.lease(f"{pair.subject}-req-1", pair.subject, pair.route, 801):
                pytest.fail("the body must not run")
    assert refused.value.dimension == "reservationUnitsMax"
    assert pair.account()["reserved"] == 0


class LoseTheFirstReply(httpx.HTTPTransport):
    """Delivers every request, but drops the agent's answer to the first
    one matching ``path`` and reports a read timeout instead: the call
    happened and its caller cannot know."""

    def __init__(self, path_suffix: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.path_suffix = path_suffix
        self.lost = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        if self.lost == 0 and request.url.path.endswith(self.path_suffix):
            response.read()
            response.close()
            self.lost += 1
            raise httpx.ReadTimeout("the reply was lost", request=request)
        return response


@pytest.mark.parametrize("lost", ["/v1/reservations", "/start", "/settle"])
def test_lease_retries_a_lost_reply_under_the_same_key(pair: Pair, socket_path: str, lost: str) -> None:
    agent = client(socket_path)
    transport = LoseTheFirstReply(lost, uds=socket_path)
    agent._http = httpx.Client(transport=transport, base_url="http://reservoir-agent", timeout=10)
    with agent:
        with agent.lease(f"{pair.subject}-req-1", pair.subject, pair.route, 600) as lease:
            lease.start()
            lease.actual_units = 300

    assert transport.lost == 1
    account = pair.account()
    assert account["spent"] == 300 and account["reserved"] == 0


def test_without_retries_a_lost_reply_is_an_unknown_outcome(pair: Pair, socket_path: str) -> None:
    agent = client(socket_path, retry=RetryPolicy(attempts_max=1))
    agent._http = httpx.Client(
        transport=LoseTheFirstReply("/v1/reservations", uds=socket_path), base_url="http://reservoir-agent"
    )
    with agent, pytest.raises(OutcomeUnknown) as unknown:
        with agent.lease(f"{pair.subject}-req-1", pair.subject, pair.route, 600):
            pytest.fail("the body must not run")
    assert unknown.value.retry_after == 1
    # It did reserve: the same key later finds it, and nothing twice.
    with client(socket_path) as again:
        record = again.reserve(f"{pair.subject}-req-1", pair.subject, pair.route, 600)
        assert not record.created
    assert pair.account()["reserved"] == 600


def test_no_policy_and_no_reservation(cluster: Cluster, socket_path: str) -> None:
    with client(socket_path) as agent:
        # The center's refusal, passed on with its status and code.
        with pytest.raises(NoPolicy) as refused:
            agent.reserve("no-policy-req-1", "nobody-has-a-policy", "chat.generate", 1)
        with pytest.raises(NotFound) as missing:
            agent.get("rl-00000000000000000000000000000000")
    assert (refused.value.status, refused.value.code) == (404, "no_policy")
    assert (missing.value.status, missing.value.code) == (404, "reservation_not_found")


def test_a_route_in_mode_off_admits_without_a_record(cluster: Cluster, socket_path: str) -> None:
    """The agent's own mode ``off`` for a route (its configuration) admits
    without asking the center; the lease's start and settle do nothing."""
    with client(socket_path) as agent:
        with agent.lease("mode-off-req-1", "any-subject", ROUTE_OFF, 600) as lease:
            lease.start()
            lease.actual_units = 5
    assert lease.reservation is not None and not lease.reservation.enforced
    assert lease.reservation.state == "NOT_ENFORCED"


def test_status(socket_path: str) -> None:
    with client(socket_path) as agent:
        status = agent.status()
    assert status["mode"] == "healthy" and status["bootEpoch"] >= 1
