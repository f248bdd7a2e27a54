"""The LiteLLM hook end to end: the real ``litellm`` package (pinned in
constraints.txt) with ``mock_response`` (no network) against a real agent
and central service.

The replay of LiteLLM issue 18730: a team with a limit of 100 tokens per
minute sends 5 requests at once whose usage is 58, 80, 175, 175 and 175
tokens (663 in all). LiteLLM's own limiter (the proxy's
``parallel_request_limiter_v3``, driven here as the proxy drives it: its
``async_pre_call_hook`` before the call, its success event after) checks
the tokens counted so far — none, while all 5 are in flight — and admits
all 5. Through Reservoir each request reserves its estimate first (the
prompt by ``litellm.token_counter`` plus ``max_tokens``), so only what fits
in the 100 tokens is admitted and the rest are refused at once with
``RateLimitError`` and ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import litellm
import pytest
from cluster import Cluster, policy
from conftest import Pair, publish
from litellm import ModelResponse
from litellm.caching.dual_cache import DualCache
from litellm.integrations.custom_logger import CustomLogger
from litellm.proxy._types import UserAPIKeyAuth
from waiting import wait_until

from reservoir_client import Client
from reservoir_client.litellm_hook import ReservoirHook, from_environment

MODEL = "gpt-4o-mini"
TEAM = "team-18730"
#: The issue's five requests, in tokens (prompt and completion).
ISSUE_USAGE = [58, 80, 175, 175, 175]
#: The issue's limit: 100 tokens per minute.
TPM = 100
#: How long each mocked call of the replay stays in flight.
IN_FLIGHT_S = 0.5


@dataclass(frozen=True)
class Call:
    """One request of the replay: its messages, the completion it asks
    for at most (``max_tokens``) and the usage the mocked provider reports
    (prompt + completion, never above ``max_tokens`` of completion)."""

    messages: list[dict[str, str]]
    max_tokens: int
    prompt_tokens: int

    @property
    def total(self) -> int:
        return self.prompt_tokens + self.max_tokens

    def mock(self) -> ModelResponse:
        return ModelResponse(
            model=MODEL,
            choices=[{"message": {"role": "assistant", "content": "hello " * self.max_tokens}}],
            usage={
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.max_tokens,
                "total_tokens": self.total,
            },
        )


def issue_calls() -> list[Call]:
    calls = []
    for index, usage in enumerate(ISSUE_USAGE):
        messages = [{"role": "user", "content": f"Request {index + 1}: write a short greeting."}]
        prompt = litellm.token_counter(model=MODEL, messages=messages)
        calls.append(Call(messages, usage - prompt, prompt))
    assert [call.total for call in calls] == ISSUE_USAGE
    return calls


def request_data(call: Call) -> dict[str, Any]:
    """What the proxy hands its hooks for one request of the team's key."""
    return {
        "model": MODEL,
        "messages": call.messages,
        "max_tokens": call.max_tokens,
        "litellm_call_id": str(uuid.uuid4()),
        "metadata": {
            "user_api_key_hash": "hashed-key-18730",
            "user_api_key_team_id": TEAM,
            "model_group": MODEL,
        },
    }


def team_key() -> UserAPIKeyAuth:
    return UserAPIKeyAuth(api_key="hashed-key-18730", team_id=TEAM, team_tpm_limit=TPM, team_rpm_limit=100)


async def proxy_call(hooks: list[Any], call: Call) -> int | None:
    """One request as the proxy runs it: every hook's ``async_pre_call_hook``
    (a refusal raises), then the completion. Returns the tokens the
    provider reported, or ``None`` when a hook refused the request."""
    data = request_data(call)
    try:
        for hook in hooks:
            data = (
                await hook.async_pre_call_hook(
                    user_api_key_dict=team_key(), cache=DualCache(), data=data, call_type="completion"
                )
                or data
            )
    except litellm.RateLimitError:
        return None
    except Exception as error:  # the proxy's limiter raises fastapi's HTTPException
        if getattr(error, "status_code", None) == 429:
            return None
        raise
    # Half a second in flight, as a (fast) real model call: the five are
    # all under way before any answers.
    response = await litellm.acompletion(**data, mock_response=call.mock(), mock_delay=IN_FLIGHT_S)
    total: int = response.usage.total_tokens
    return total


#: LiteLLM's global callback lists. A call copies each of ``litellm.callbacks``
#: into the lists below it, where it stays after ``litellm.callbacks`` is put
#: back; and a logger is not added there again while one of the same class
#: with the same public str/int/bool attributes is in (LiteLLM's
#: ``LoggingCallbackManager._add_custom_logger_to_list``). Without putting
#: them all back, a test's logger keeps receiving the next tests' events and
#: the next test's logger of the same kind is never called.
CALLBACK_LISTS = (
    "callbacks",
    "input_callback",
    "success_callback",
    "failure_callback",
    "service_callback",
    "_async_input_callback",
    "_async_success_callback",
    "_async_failure_callback",
)


@pytest.fixture
def callbacks() -> Iterator[None]:
    """LiteLLM's callbacks are global: each test sets its own and all of
    LiteLLM's callback lists are put back afterwards."""
    saved = {name: list(getattr(litellm, name)) for name in CALLBACK_LISTS}
    yield
    for name, value in saved.items():
        setattr(litellm, name, value)


def rate_limiter() -> Any:
    from litellm.proxy.hooks.parallel_request_limiter_v3 import _PROXY_MaxParallelRequestsHandler_v3
    from litellm.proxy.utils import InternalUsageCache

    return _PROXY_MaxParallelRequestsHandler_v3(
        internal_usage_cache=InternalUsageCache(dual_cache=DualCache())
    )


def policy_18730() -> dict[str, Any]:
    """100 tokens per minute, as the issue's team had."""
    return {
        "opening": TPM,
        "burst": TPM,
        "refill": {"units": TPM, "intervalMs": 60_000},
        "reservationUnitsMax": TPM,
        "overdraftUnitsMax": 50,
    }


async def test_issue_18730_litellm_alone_admits_all_five(callbacks: None) -> None:
    limiter = rate_limiter()
    litellm.callbacks = [limiter]
    calls = issue_calls()

    admitted = await asyncio.gather(*(proxy_call([limiter], call) for call in calls))

    assert admitted == ISSUE_USAGE, "LiteLLM's limiter refused nothing while all five were in flight"
    assert sum(t for t in admitted if t is not None) == 663

    async def refuses_now() -> bool | None:
        try:
            await limiter.async_pre_call_hook(
                user_api_key_dict=team_key(),
                cache=DualCache(),
                data=request_data(calls[0]),
                call_type="completion",
            )
        except Exception as error:
            if getattr(error, "status_code", None) == 429:
                return True
            raise
        return None

    # The limit is live: once the success events have counted the tokens,
    # the next request is refused. Too late for the five.
    assert await wait_until("LiteLLM's limiter refuses once it has counted the tokens", refuses_now)
    print(
        f"\n18730 replay: LiteLLM alone admitted 5 of 5 requests, {sum(ISSUE_USAGE)} tokens against a {TPM}-token limit"
    )


async def test_issue_18730_through_reservoir_admits_within_the_budget(
    cluster: Cluster, socket_path: str, callbacks: None
) -> None:
    pair = publish(cluster, route=MODEL, **policy_18730())
    hook = ReservoirHook(socket_path, subject=pair.subject)
    litellm.callbacks = [hook]
    calls = issue_calls()

    admitted = await asyncio.gather(*(proxy_call([hook], call) for call in calls))

    tokens = [t for t in admitted if t is not None]
    # Each request reserved exactly its usage (prompt + max_tokens): the
    # 175-token ones exceed the whole budget (reservationUnitsMax), and of
    # 58 and 80 only one fits in 100.
    assert len(tokens) == 1 and tokens[0] in (58, 80), admitted
    account = await wait_until("the admitted request settled", lambda: _settled(pair))
    assert account["spent"] == tokens[0] <= TPM
    assert account["reserved"] == 0 and account["overdraftIssued"] == 0
    print(
        f"\n18730 replay: through Reservoir admitted 1 of 5 requests, {tokens[0]} tokens against a {TPM}-token budget"
    )


async def _settled(pair: Pair) -> dict[str, Any] | None:
    account = pair.account()
    return account if account["reserved"] == 0 and account["spent"] > 0 else None


@pytest.mark.parametrize(
    ("extra_prompt_tokens", "frozen"),
    [(0, False), (1, True)],
    ids=["overdraft at the policy's maximum: debt", "one past it: breach, frozen"],
)
async def test_usage_above_the_estimate_becomes_debt_that_blocks_the_next_request(
    cluster: Cluster, socket_path: str, callbacks: None, extra_prompt_tokens: int, frozen: bool
) -> None:
    """The provider reports more than the estimate (its prompt grew on its
    side: a system prompt, tool schemas). The settle charges it all; what
    ``available`` cannot cover is debt (up to ``overdraftUnitsMax`` = 50),
    and debt refuses the next request until refills repay it. One token
    more than the policy's overdraft is a breach and freezes the pair."""
    pair = publish(cluster, route=MODEL, **policy_18730())
    hook = ReservoirHook(socket_path, subject=pair.subject)
    litellm.callbacks = [hook]
    messages = [{"role": "user", "content": "Say hello."}]
    prompt = litellm.token_counter(model=MODEL, messages=messages)
    max_tokens = 30
    estimate = prompt + max_tokens
    # 100 available: the estimate is held, the rest covers part of the
    # overage, and exactly 50 (or 51) are overdraft.
    reported_prompt = TPM + 50 + extra_prompt_tokens - max_tokens
    mock = ModelResponse(
        model=MODEL,
        choices=[{"message": {"role": "assistant", "content": "hello"}}],
        usage={
            "prompt_tokens": reported_prompt,
            "completion_tokens": max_tokens,
            "total_tokens": reported_prompt + max_tokens,
        },
    )

    response = await litellm.acompletion(
        model=MODEL, messages=messages, max_tokens=max_tokens, mock_response=mock
    )

    used = response.usage.total_tokens
    assert used == TPM + 50 + extra_prompt_tokens > estimate
    account = await wait_until("the request settled", lambda: _settled(pair))
    assert account["spent"] == used
    assert account["overdraftIssued"] == 50 + extra_prompt_tokens == pair.debt()
    assert cluster.accounts(pair.subject, MODEL)["frozen"] is frozen
    with pytest.raises(litellm.RateLimitError) as refused:
        await litellm.acompletion(model=MODEL, messages=messages, max_tokens=1, mock_response="hi")
    assert int(refused.value.response.headers["retry-after"]) >= 1
    assert ("frozen" if frozen else "debt") in str(refused.value)


async def test_sdk_call_reserves_starts_and_settles_with_the_usage(
    cluster: Cluster, socket_path: str, callbacks: None
) -> None:
    pair = publish(cluster, route=MODEL)
    hook = ReservoirHook(socket_path, subject=pair.subject)
    litellm.callbacks = [hook]
    messages = [{"role": "user", "content": "hello"}]
    mock = ModelResponse(
        model=MODEL,
        choices=[{"message": {"role": "assistant", "content": "hi"}}],
        usage={"prompt_tokens": 9, "completion_tokens": 21, "total_tokens": 30},
    )

    await litellm.acompletion(model=MODEL, messages=messages, max_tokens=200, mock_response=mock)

    account = await wait_until("settled", lambda: _settled(pair))
    assert account["spent"] == 30
    assert not hook._open


async def test_streaming_settles_with_the_assembled_usage(
    cluster: Cluster, socket_path: str, callbacks: None
) -> None:
    pair = publish(cluster, route=MODEL)
    hook = ReservoirHook(socket_path, subject=pair.subject)
    litellm.callbacks = [hook]
    messages = [{"role": "user", "content": "hello"}]

    stream = await litellm.acompletion(
        model=MODEL, messages=messages, max_tokens=200, mock_response="one two three four", stream=True
    )
    chunks = [chunk async for chunk in stream]

    assert chunks
    account = await wait_until("the stream settled", lambda: _settled(pair))
    # LiteLLM counts a mocked stream's usage itself: the prompt plus the
    # streamed text, far below the 200 + prompt that was reserved.
    assert 0 < account["spent"] < 200
    assert account["reserved"] == 0


async def test_a_provider_refusal_settles_at_zero(
    cluster: Cluster, socket_path: str, callbacks: None
) -> None:
    """The provider answered 4xx: nothing ran, nothing is charged."""
    pair = publish(cluster, route=MODEL)
    hook = ReservoirHook(socket_path, subject=pair.subject)
    litellm.callbacks = [hook]
    refusal = litellm.BadRequestError(message="bad request", model=MODEL, llm_provider="openai")

    with pytest.raises(litellm.BadRequestError):
        await litellm.acompletion(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=50, mock_response=refusal
        )

    async def ended() -> dict[str, Any] | None:
        account = pair.account()
        return account if account["reserved"] == 0 and not hook._open else None

    account = await wait_until("the refused call ended", ended)
    assert account["spent"] == 0 and account["available"] == 1000


async def test_a_request_refused_before_routing_releases(
    cluster: Cluster, socket_path: str, callbacks: None
) -> None:
    """Proxy: the pre-call hook reserved, then the request failed before
    any deployment call (no start): the proxy's failure hook releases."""
    pair = publish(cluster, route=MODEL)
    hook = ReservoirHook(socket_path, subject=pair.subject)
    data = request_data(Call([{"role": "user", "content": "x"}], 100, 5))
    data = await hook.async_pre_call_hook(team_key(), DualCache(), data, "completion")
    held = pair.account()
    assert held["reserved"] > 0

    await hook.async_post_call_failure_hook(data, RuntimeError("no deployment"), team_key())

    account = pair.account()
    assert account["reserved"] == 0 and account["spent"] == 0 and account["available"] == 1000


async def test_a_rejection_is_a_rate_limit_error_with_retry_after(
    cluster: Cluster, socket_path: str, callbacks: None
) -> None:
    pair = publish(cluster, route=MODEL)
    hook = ReservoirHook(socket_path, subject=pair.subject)
    litellm.callbacks = [hook]

    with pytest.raises(litellm.RateLimitError) as refused:
        # 801 of completion alone is over reservationUnitsMax (800).
        await litellm.acompletion(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=801, mock_response="x"
        )

    assert refused.value.status_code == 429
    assert refused.value.response.headers["retry-after"] == "60"
    assert "reservationUnitsMax" in str(refused.value)
    assert pair.account()["reserved"] == 0


async def test_a_retried_call_reserves_again_under_another_key(
    cluster: Cluster, socket_path: str, callbacks: None
) -> None:
    """LiteLLM retried a call whose first attempt failed and was settled:
    the retry's own reservation is new (the first key would answer the
    ended one), and each attempt ends once."""
    pair = publish(cluster, route=MODEL)
    hook = ReservoirHook(socket_path, subject=pair.subject)
    kwargs = request_data(Call([{"role": "user", "content": "x"}], 100, 5))

    first = await hook.async_pre_call_deployment_hook(dict(kwargs), None)
    carried = first["metadata"]["reservoir"]
    refusal = litellm.RateLimitError(message="provider busy", llm_provider="openai", model=MODEL)
    await hook.async_log_failure_event({"litellm_params": first, "exception": refusal}, None, None, None)
    second = await hook.async_pre_call_deployment_hook(first, None)
    again = second["metadata"]["reservoir"]

    assert again["reservation"] != carried["reservation"]
    assert again["key"] == carried["key"] + ".2"
    account = pair.account()
    # The first settled at 0 (the provider refused it), the second is held.
    assert account["spent"] == 0 and account["reserved"] == again["units"]
    assert list(hook._open) == [again["reservation"]]


# -- flexible reservations (min_completion_tokens) ---------------------------

#: The budget of the flexible tests: 400 units, at most 400 a reservation,
#: refilled 100 an hour (nothing lands while a test runs: the grants are exact).
FLEX_BUDGET = 400
#: The least completion the flexible hook may cut a call down to.
MIN_COMPLETION = 50
#: The completion each flexible call asks for at most.
ASKED_COMPLETION = 200
FLEX_MESSAGES = [{"role": "user", "content": "Write a haiku about a reservoir."}]


def flexible_policy() -> dict[str, Any]:
    return {
        "opening": FLEX_BUDGET,
        "burst": FLEX_BUDGET,
        "reservationUnitsMax": FLEX_BUDGET,
        "refill": {"units": 100, "intervalMs": 3_600_000},
    }


def hold_all_but(pair: Pair, socket_path: str, left: int) -> int:
    """Reserves (for another request) all of the budget but ``left``;
    returns the units held."""
    held = FLEX_BUDGET - left
    with Client(socket_path) as agent:
        agent.reserve(f"{pair.subject}-other", pair.subject, pair.route, held)
    return held


class SentLimits(CustomLogger):
    """Records the completion limits each call went out with (LiteLLM's
    ``optional_params``, what it sent the provider)."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[dict[str, Any]] = []

    async def async_log_success_event(
        self, kwargs: Any, response_obj: Any, start_time: Any, end_time: Any
    ) -> None:
        params = kwargs.get("optional_params") or {}
        self.sent.append(
            {name: params[name] for name in ("max_tokens", "max_completion_tokens") if name in params}
        )


@pytest.mark.parametrize("member", ["max_tokens", "max_completion_tokens"])
@pytest.mark.parametrize(
    ("left_for_completion", "sent"),
    [
        (ASKED_COMPLETION, ASKED_COMPLETION),
        (120, 120),
        (MIN_COMPLETION, MIN_COMPLETION),
        (MIN_COMPLETION - 1, None),
    ],
    ids=[
        "the whole ask: left alone",
        "less: lowered to it",
        "exactly the floor",
        "one below the floor: refused",
    ],
)
async def test_a_flexible_hook_lowers_the_completion_limit_to_the_grant(
    cluster: Cluster,
    socket_path: str,
    callbacks: None,
    member: str,
    left_for_completion: int,
    sent: int | None,
) -> None:
    """What is left after the prompt is ``left_for_completion``: the hook
    reserves prompt + 200 at most, prompt + 50 at least, and the call goes
    out with its limit lowered to the grant minus the prompt."""
    pair = publish(cluster, route=MODEL, **flexible_policy())
    prompt = litellm.token_counter(model=MODEL, messages=FLEX_MESSAGES)
    held = hold_all_but(pair, socket_path, prompt + left_for_completion)
    hook = ReservoirHook(socket_path, subject=pair.subject, min_completion_tokens=MIN_COMPLETION)
    spy = SentLimits()
    litellm.callbacks = [hook, spy]
    mock = ModelResponse(
        model=MODEL,
        choices=[{"message": {"role": "assistant", "content": "water waits"}}],
        usage={"prompt_tokens": prompt, "completion_tokens": 10, "total_tokens": prompt + 10},
    )
    limit: dict[str, Any] = {member: ASKED_COMPLETION}

    if sent is None:
        with pytest.raises(litellm.RateLimitError) as refused:
            await litellm.acompletion(model=MODEL, messages=FLEX_MESSAGES, mock_response=mock, **limit)
        assert "capacity" in str(refused.value)
        account = pair.account()
        assert account["reserved"] == held and account["spent"] == 0 and not hook._open
        return

    await litellm.acompletion(model=MODEL, messages=FLEX_MESSAGES, mock_response=mock, **limit)

    async def settled() -> dict[str, Any] | None:
        account = pair.account()
        return account if account["spent"] > 0 and spy.sent else None

    account = await wait_until("the call settled", settled)
    assert spy.sent == [{member: sent}]
    assert account["spent"] == prompt + 10 and account["reserved"] == held
    assert account["overdraftIssued"] == 0


async def test_the_proxy_hook_lowers_max_tokens_before_routing(
    cluster: Cluster, socket_path: str
) -> None:
    pair = publish(cluster, route=MODEL, **flexible_policy())
    call = Call(FLEX_MESSAGES, ASKED_COMPLETION, litellm.token_counter(model=MODEL, messages=FLEX_MESSAGES))
    held = hold_all_but(pair, socket_path, call.prompt_tokens + 120)
    hook = ReservoirHook(socket_path, subject=pair.subject, min_completion_tokens=MIN_COMPLETION)

    data = await hook.async_pre_call_hook(team_key(), DualCache(), request_data(call), "completion")

    assert data["max_tokens"] == 120
    assert data["metadata"]["reservoir"]["units"] == call.prompt_tokens + 120
    assert pair.account()["reserved"] == FLEX_BUDGET
    await hook.async_post_call_failure_hook(data, RuntimeError("no deployment"), team_key())
    assert pair.account()["reserved"] == held


@pytest.mark.parametrize(
    ("data", "lowered"),
    [
        ({"max_tokens": 200}, {"max_tokens": 120}),
        ({"max_completion_tokens": 200}, {"max_completion_tokens": 120}),
        (
            {"max_tokens": 200, "max_completion_tokens": 300},
            {"max_tokens": 120, "max_completion_tokens": 120},
        ),
        (
            {"max_tokens": 100, "max_completion_tokens": 300},
            {"max_tokens": 100, "max_completion_tokens": 120},
        ),
        ({}, {"max_tokens": 120}),
        ({"max_tokens": 120}, {"max_tokens": 120}),
    ],
    ids=[
        "max_tokens",
        "max_completion_tokens",
        "both",
        "never raised",
        "neither: max_tokens",
        "at the limit",
    ],
)
def test_lowering_the_completion_limit_lowers_what_the_call_set(
    data: dict[str, Any], lowered: dict[str, Any]
) -> None:
    ReservoirHook._lower_completion_limit(data, 120, "call-1")
    assert data == lowered


def test_min_completion_tokens_is_at_least_one(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError):
        ReservoirHook(min_completion_tokens=0)
    assert ReservoirHook(min_completion_tokens=1).min_completion_tokens == 1
    monkeypatch.delenv("RESERVOIR_MIN_COMPLETION_TOKENS", raising=False)
    assert from_environment().min_completion_tokens is None
    monkeypatch.setenv("RESERVOIR_MIN_COMPLETION_TOKENS", "64")
    assert from_environment().min_completion_tokens == 64


# -- more limits per call: requests and concurrency legs ---------------------

#: Nothing refills while a test runs: every term below is exact.
NO_REFILL = {"units": 0, "intervalMs": 1000}
REQUESTS_ROUTE = f"{MODEL}.requests"
CONCURRENCY_ROUTE = f"{MODEL}.concurrency"


@dataclass
class Limits:
    """One team's tokens (1000), requests (10) and calls in flight."""

    tokens: Pair
    requests: Pair
    concurrency: Pair

    def terms(self) -> list[tuple[int, int, int]]:
        """(available, reserved, spent) of the tokens, requests and
        concurrency accounts."""
        return [
            (a["available"], a["reserved"], a["spent"])
            for a in (pair.account() for pair in (self.tokens, self.requests, self.concurrency))
        ]

    def hook(self, socket_path: str) -> ReservoirHook:
        return ReservoirHook(
            socket_path,
            subject=self.tokens.subject,
            requests_route="{route}.requests",
            concurrency_route=CONCURRENCY_ROUTE,
        )


def publish_limits(cluster: Cluster, slots: int) -> Limits:
    tokens = publish(cluster, route=MODEL, refill=NO_REFILL)
    extra = []
    for route, opening in ((REQUESTS_ROUTE, 10), (CONCURRENCY_ROUTE, slots)):
        document = policy(
            tokens.subject,
            route,
            opening=opening,
            burst=opening,
            reservationUnitsMax=1,
            refill=NO_REFILL,
            overdraftUnitsMax=0,
        )
        cluster.publish(document)
        extra.append(Pair(cluster, tokens.subject, route, document))
    return Limits(tokens, extra[0], extra[1])


LEGS_CALL = Call([{"role": "user", "content": "hello"}], 200, 0)


async def test_one_call_reserves_tokens_a_request_and_a_slot_and_settles_each(
    cluster: Cluster, socket_path: str, callbacks: None
) -> None:
    limits = publish_limits(cluster, slots=2)
    hook = limits.hook(socket_path)
    litellm.callbacks = [hook]
    data = request_data(LEGS_CALL)
    prompt = ReservoirHook.prompt_tokens(data)
    mock = ModelResponse(
        model=MODEL,
        choices=[{"message": {"role": "assistant", "content": "hi"}}],
        usage={"prompt_tokens": prompt, "completion_tokens": 21, "total_tokens": prompt + 21},
    )

    data = await hook.async_pre_call_hook(team_key(), DualCache(), data, "completion")

    estimate = prompt + 200
    assert data["metadata"]["reservoir"]["units"] == estimate
    assert limits.terms() == [(1000 - estimate, estimate, 0), (9, 1, 0), (1, 1, 0)]

    await litellm.acompletion(**data, mock_response=mock)

    async def settled() -> list[tuple[int, int, int]] | None:
        terms = limits.terms()
        return terms if terms[0][1] == 0 and not hook._open else None

    terms = await wait_until("every leg settled", settled)
    # The tokens leg at the usage, the request at 1, the slot given back.
    assert terms == [(1000 - prompt - 21, 0, prompt + 21), (9, 0, 1), (2, 0, 0)]


async def test_a_provider_refusal_settles_every_leg_at_zero(
    cluster: Cluster, socket_path: str, callbacks: None
) -> None:
    limits = publish_limits(cluster, slots=2)
    hook = limits.hook(socket_path)
    litellm.callbacks = [hook]
    refusal = litellm.BadRequestError(message="bad request", model=MODEL, llm_provider="openai")

    with pytest.raises(litellm.BadRequestError):
        await litellm.acompletion(
            model=MODEL, messages=LEGS_CALL.messages, max_tokens=50, mock_response=refusal
        )

    async def ended() -> list[tuple[int, int, int]] | None:
        terms = limits.terms()
        return terms if terms[0][1] == 0 and not hook._open else None

    assert await wait_until("the refused call ended", ended) == [(1000, 0, 0), (10, 0, 0), (2, 0, 0)]


async def test_a_call_is_refused_when_no_slot_is_left_and_holds_no_tokens(
    cluster: Cluster, socket_path: str, callbacks: None
) -> None:
    limits = publish_limits(cluster, slots=1)
    hook = limits.hook(socket_path)
    first = await hook.async_pre_call_hook(team_key(), DualCache(), request_data(LEGS_CALL), "completion")
    estimate = first["metadata"]["reservoir"]["units"]
    held = [(1000 - estimate, estimate, 0), (9, 1, 0), (0, 1, 0)]
    assert limits.terms() == held

    with pytest.raises(litellm.RateLimitError) as refused:
        await hook.async_pre_call_hook(team_key(), DualCache(), request_data(LEGS_CALL), "completion")

    assert refused.value.status_code == 429
    assert int(refused.value.response.headers["retry-after"]) >= 1
    assert f"capacity on {CONCURRENCY_ROUTE}" in str(refused.value)
    # Nothing held on any leg by the refused call: only the first's.
    assert limits.terms() == held
    assert len(hook._open) == 1

    await hook.async_post_call_failure_hook(first, RuntimeError("no deployment"), team_key())
    assert limits.terms() == [(1000, 0, 0), (10, 0, 0), (1, 0, 0)]


def test_the_extra_legs_are_configured_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RESERVOIR_REQUESTS_ROUTE", "RESERVOIR_CONCURRENCY_ROUTE"):
        monkeypatch.delenv(name, raising=False)
    hook = from_environment()
    assert (hook.requests_route, hook.concurrency_route) == (None, None)
    monkeypatch.setenv("RESERVOIR_REQUESTS_ROUTE", "{route}.requests")
    monkeypatch.setenv("RESERVOIR_CONCURRENCY_ROUTE", "gpt-4o.concurrency")
    hook = from_environment()
    assert hook._extra_route(hook.requests_route, {}, None, "gpt-4o") == "gpt-4o.requests"
    assert hook._extra_route(hook.concurrency_route, {}, None, "gpt-4o") == "gpt-4o.concurrency"
