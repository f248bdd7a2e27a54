"""A LiteLLM hook that admits every completion through a Reservoir agent.

Before the call it **reserves** the request's estimated tokens — the prompt
counted by ``litellm.token_counter`` plus ``max_tokens`` (or
``max_completion_tokens``, else ``default_max_tokens``) — and **starts** the
reservation right before the request goes to the deployment. On success it
**settles** with the response's ``usage.total_tokens`` (for a stream, the
usage of the assembled response LiteLLM logs once the stream ends); on
failure it **releases** a reservation that never started, and settles a
started one at 0 when the provider refused the request outright (a 4xx:
nothing ran) or at the full reservation otherwise (a timeout or 5xx may
have run; no refund on a guess, docs/design.md §3.6). Each reservation ends
exactly once. A 429 from the agent becomes LiteLLM's ``RateLimitError``
carrying ``Retry-After`` (the proxy passes it on to its client); no request
reaches the provider unless its tokens were reserved first.

Use in the LiteLLM proxy (``examples/litellm_proxy_config.yaml``, with
``examples/reservoir_callbacks.py`` next to it: the proxy loads callbacks
from files beside its configuration)::

    litellm_settings:
      callbacks: reservoir_callbacks.proxy_handler

or with the SDK::

    import litellm
    from reservoir_client.litellm_hook import ReservoirHook
    litellm.callbacks = [ReservoirHook("/run/reservoir-agent/agent.sock", subject="team-a")]
    await litellm.acompletion(model="gpt-4o-mini", messages=..., max_tokens=200)

Where it hooks in (LiteLLM's ``CustomLogger``):

- ``async_pre_call_hook`` (proxy only, before routing): reserves, so a
  rejected request costs no routing; the subject is the API key's team
  (else the key's alias or hash).
- ``async_pre_call_deployment_hook`` (every async call, after the
  deployment is picked, right before it is sent): starts the reservation,
  reserving first when no proxy hook did (SDK use).
- ``async_log_success_event`` / ``async_log_failure_event``: settle or
  release.

The idempotency key is ``litellm-`` and the call's ``litellm_call_id``: a
lost reply from the agent is retried under it and can never reserve twice.
Only the async paths (the proxy, ``acompletion``, the Router's async
calls) are hooked; LiteLLM's synchronous ``completion`` has no pre-call
hook that can refuse.

Flexible reservations (``min_completion_tokens``): by default a request
whose estimate is not there whole is refused. With ``min_completion_tokens``
the hook reserves a range instead — at most the estimate (prompt plus
``max_tokens``), at least the prompt plus ``min_completion_tokens`` (capped
at the estimate) — and when the agent grants less than the estimate it
lowers the call's ``max_tokens`` (or ``max_completion_tokens``, whichever
the call used; ``max_tokens`` when it used neither) to the grant minus the
prompt before the request goes out. So a request that does not fit whole
still runs, with a shorter answer; one that does not fit even at its floor
is refused as before. The hook never raises a call's limit.

More limits per call (``requests_route``, ``concurrency_route``): a
provider's limits are usually requests a minute and calls in flight as well
as tokens. With either route set, each call reserves a **multi-leg**
reservation (docs/design.md §3.13) of the same subject: the tokens as above
(the first leg), 1 on the requests route and 1 on the concurrency route,
all admitted or none (a refusal names the limiting route). On success it
settles per leg: the tokens leg with the response's usage, the requests
leg with 1 and the concurrency leg with 0 (its slot comes back). A call the
provider refused outright settles every leg at 0; one that may have run
settles the tokens at the grant, the request at 1, the slot at 0. Either
route may contain ``{route}``, replaced with the call's tokens route
(``"{route}.requests"`` gives ``gpt-4o.requests`` for ``gpt-4o``).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import httpx
import litellm
from litellm.exceptions import RateLimitError, ServiceUnavailableError
from litellm.integrations.custom_logger import CustomLogger

from . import errors
from ._lease import operation_id_for
from ._protocol import Leg, Pair, RetryPolicy
from .aio import AsyncClient
from .client import DEFAULT_SOCKET

log = logging.getLogger("reservoir_client.litellm")

#: The metadata member that carries a request's reservation from the
#: pre-call hooks to the logging events.
METADATA_KEY = "reservoir"

#: Provider statuses that prove the request did not run (nothing to pay).
REFUSED_STATUSES = frozenset({400, 401, 403, 404, 413, 422, 429})

SubjectOf = Callable[[Mapping[str, Any], Any], Optional[str]]


@dataclass
class _Open:
    """One reservation the hook holds, until it ends (exactly once)."""

    reservation: str
    key: str
    units: int
    #: The pairs of the tokens, requests and concurrency legs of a
    #: multi-leg reservation (``None`` for a leg not configured); the tokens
    #: pair is ``None`` for a one-pair reservation.
    tokens: Pair | None = None
    requests: Pair | None = None
    concurrency: Pair | None = None
    started: bool = False
    ended: bool = False

    def leg_actuals(self, tokens: int, ran: bool) -> dict[Pair, int]:
        """What each leg settles at: the tokens used, the request 1 if it
        may have run (else 0), the slot 0."""
        actuals: dict[Pair, int] = {}
        if self.tokens is not None:
            actuals[self.tokens] = tokens
        if self.requests is not None:
            actuals[self.requests] = 1 if ran else 0
        if self.concurrency is not None:
            actuals[self.concurrency] = 0
        return actuals


def _metadata_member(data: Mapping[str, Any]) -> str:
    """Which member holds the request's metadata: ``metadata`` (chat
    completions), else ``litellm_metadata`` (calls whose ``metadata`` goes to
    the provider), else ``metadata``."""
    if isinstance(data.get("metadata"), dict) or not isinstance(data.get("litellm_metadata"), dict):
        return "metadata"
    return "litellm_metadata"


def _metadata(data: Mapping[str, Any]) -> dict[str, Any]:
    """The request's metadata dict (empty when it has none)."""
    value = data.get(_metadata_member(data))
    return value if isinstance(value, dict) else {}


def _usage_tokens(response: Any) -> int | None:
    usage = getattr(response, "usage", None)
    if usage is None and isinstance(response, Mapping):
        usage = response.get("usage")
    if usage is None:
        return None
    total = getattr(usage, "total_tokens", None)
    if total is None and isinstance(usage, Mapping):
        total = usage.get("total_tokens")
    if isinstance(total, int):
        return total
    prompt = getattr(usage, "prompt_tokens", 0) or 0
    completion = getattr(usage, "completion_tokens", 0) or 0
    return int(prompt) + int(completion)


class ReservoirHook(CustomLogger):
    """Reserve before, settle after, for every async LiteLLM completion.

    ``subject`` and ``route`` are fixed strings or functions of (request
    data, proxy key) returning one; by default the subject is the proxy
    key's team (else its alias or hash, else ``metadata["reservoir_subject"]``,
    else ``"default"``) and the route is the requested model group.

    ``default_max_tokens`` is the completion estimate of a call that sets
    neither ``max_tokens`` nor ``max_completion_tokens``.

    ``min_completion_tokens`` (at least 1; ``None``, the default, reserves
    the whole estimate or refuses) makes every reservation flexible: the
    least completion a call may be cut down to when the budget is short.
    The hook then lowers the call's completion limit to what was granted
    (see the module's documentation).

    ``requests_route`` and ``concurrency_route`` (fixed strings, which may
    contain ``{route}`` for the tokens route, or functions like ``route``;
    ``None``, the default, leaves the dimension out) add a leg of 1 unit on
    that route, of the same subject, to every call's reservation: one
    reservation admits the tokens, the request and the slot in flight all
    at once or none. The requests leg settles at 1, the concurrency leg at 0.
    """

    def __init__(
        self,
        socket_path: str = DEFAULT_SOCKET,
        *,
        subject: Union[str, SubjectOf, None] = None,
        route: Union[str, SubjectOf, None] = None,
        default_max_tokens: int = 4096,
        min_completion_tokens: int | None = None,
        requests_route: Union[str, SubjectOf, None] = None,
        concurrency_route: Union[str, SubjectOf, None] = None,
        timeout: float = 10.0,
        retry: RetryPolicy = RetryPolicy(),
    ) -> None:
        if min_completion_tokens is not None and min_completion_tokens < 1:
            raise ValueError(f"min_completion_tokens must be at least 1, not {min_completion_tokens}")
        super().__init__()
        self.socket_path = socket_path
        self.subject = subject
        self.route = route
        self.default_max_tokens = default_max_tokens
        self.min_completion_tokens = min_completion_tokens
        self.requests_route = requests_route
        self.concurrency_route = concurrency_route
        self._timeout = timeout
        self._retry = retry
        self._clients: dict[int, AsyncClient] = {}
        self._open: dict[str, _Open] = {}

    # -- plumbing ---------------------------------------------------------

    def _client(self) -> AsyncClient:
        """One client per event loop (httpx's async pool belongs to one)."""
        loop = id(asyncio.get_running_loop())
        client = self._clients.get(loop)
        if client is None:
            client = AsyncClient(self.socket_path, timeout=self._timeout, retry=self._retry)
            self._clients[loop] = client
        return client

    def _resolve(
        self, chosen: Union[str, SubjectOf, None], data: Mapping[str, Any], key: Any, fallback: str
    ) -> str:
        if isinstance(chosen, str):
            return chosen
        if chosen is not None:
            value = chosen(data, key)
            if value:
                return value
        return fallback

    def _subject(self, data: Mapping[str, Any], key: Any) -> str:
        fallback = (
            getattr(key, "team_id", None)
            or getattr(key, "key_alias", None)
            or getattr(key, "api_key", None)
            or _metadata(data).get("reservoir_subject")
            or _metadata(data).get("user_api_key_team_id")
            or "default"
        )
        return self._resolve(self.subject, data, key, str(fallback))

    def _route(self, data: Mapping[str, Any], key: Any) -> str:
        fallback = _metadata(data).get("model_group") or data.get("model") or "default"
        return self._resolve(self.route, data, key, str(fallback))

    def _extra_route(
        self, chosen: Union[str, SubjectOf, None], data: Mapping[str, Any], key: Any, route: str
    ) -> str | None:
        """A requests or concurrency route for the call, ``None`` when not
        configured; ``{route}`` in a fixed one is the tokens route."""
        if chosen is None:
            return None
        if isinstance(chosen, str):
            return chosen.replace("{route}", route)
        return chosen(data, key) or None

    @staticmethod
    def prompt_tokens(data: Mapping[str, Any]) -> int:
        """The prompt's tokens by LiteLLM's own counter (0 without one)."""
        model = str(data.get("model") or "")
        messages = data.get("messages")
        if messages:
            return int(litellm.token_counter(model=model, messages=messages, tools=data.get("tools")))
        if data.get("prompt"):
            return int(litellm.token_counter(model=model, text=data.get("prompt")))
        return 0

    def completion_tokens(self, data: Mapping[str, Any]) -> int:
        """The most the completion may use: the call's ``max_tokens``, else
        its ``max_completion_tokens``, else ``default_max_tokens``."""
        return int(data.get("max_tokens") or data.get("max_completion_tokens") or self.default_max_tokens)

    def estimate(self, data: Mapping[str, Any]) -> int:
        """Prompt tokens by LiteLLM's own counter plus the most the
        completion may use."""
        return max(self.prompt_tokens(data) + self.completion_tokens(data), 1)

    def _min_units(self, prompt: int, units: int) -> int | None:
        """The floor of a flexible reservation (``None``: a fixed one)."""
        if self.min_completion_tokens is None:
            return None
        return min(prompt + self.min_completion_tokens, units)

    @staticmethod
    def _lower_completion_limit(data: dict[str, Any], limit: int, call_id: str) -> None:
        """Lowers the call's completion limit to ``limit``, never raising it:
        ``max_tokens`` and ``max_completion_tokens``, each the call set, or
        ``max_tokens`` when it set neither."""
        used = [name for name in ("max_tokens", "max_completion_tokens") if data.get(name)]
        for member in used or ["max_tokens"]:
            asked = data.get(member)
            if asked and int(asked) <= limit:
                continue
            log.debug("call %s: %s lowered from %s to %d to fit the grant", call_id, member, asked, limit)
            data[member] = limit

    def _rate_limit_error(self, rejected: errors.Rejected, model: str) -> RateLimitError:
        headers = {"retry-after": str(rejected.retry_after)}
        if rejected.rate_limit is not None:
            headers["ratelimit"] = rejected.rate_limit
        if rejected.rate_limit_policy is not None:
            headers["ratelimit-policy"] = rejected.rate_limit_policy
        on = f" on {rejected.route}" if rejected.route is not None else ""
        error = RateLimitError(
            message=f"Reservoir: not admitted now ({rejected.dimension}{on}, policy generation "
            f"{rejected.generation}); retry after {rejected.retry_after} s",
            llm_provider="reservoir",
            model=model,
            response=httpx.Response(429, headers=headers),
        )
        # The proxy answers an exception's own ``headers`` as they are (the
        # response's would reach its client renamed ``llm_provider-…``).
        error.headers = headers  # type: ignore[attr-defined]
        return error

    async def _reserve(self, data: dict[str, Any], key: Any, attempt: int = 1) -> dict[str, Any]:
        """Reserves for ``data`` and returns the record to carry in its
        metadata. Raises ``RateLimitError`` on a 429, and
        ``ServiceUnavailableError`` with ``Retry-After`` when the agent
        cannot decide (retries under the same key ran out).

        ``attempt`` counts the reservations of one call: a call LiteLLM
        retries after its first reservation ended needs another key (the
        first key answers the ended reservation)."""
        call_id = data.get("litellm_call_id") or str(uuid.uuid4())
        idempotency_key = f"litellm-{call_id}" + (f".{attempt}" if attempt > 1 else "")
        prompt = self.prompt_tokens(data)
        units = max(prompt + self.completion_tokens(data), 1)
        min_units = self._min_units(prompt, units)
        client = self._client()
        subject, route = self._subject(data, key), self._route(data, key)
        requests = self._extra_route(self.requests_route, data, key, route)
        concurrency = self._extra_route(self.concurrency_route, data, key, route)
        # The tokens leg first: the reservation's ID, grant and partition
        # are its, as for a call of one pair.
        legs = [Leg(subject, route, units, min_units)]
        legs += [Leg(subject, extra, 1) for extra in (requests, concurrency) if extra is not None]
        model = str(data.get("model") or "")
        try:
            if len(legs) > 1:
                record = await client.with_retry(lambda: client.reserve(idempotency_key, legs=legs))
            else:
                record = await client.with_retry(
                    lambda: client.reserve(idempotency_key, subject, route, units, min_units=min_units)
                )
        except errors.Rejected as rejected:
            raise self._rate_limit_error(rejected, model) from rejected
        except errors.Retryable as unavailable:
            error = ServiceUnavailableError(
                message=f"Reservoir: the agent could not decide: {unavailable}",
                llm_provider="reservoir",
                model=model,
                response=httpx.Response(503, headers={"retry-after": str(unavailable.retry_after)}),
            )
            error.headers = {"retry-after": str(unavailable.retry_after)}  # type: ignore[attr-defined]
            raise error from unavailable
        # A flexible grant below the estimate: the completion gets what the
        # grant leaves after the prompt (at least min_completion_tokens, as
        # the grant is at least the floor).
        if record.enforced and record.reserved_units < units:
            self._lower_completion_limit(data, record.reserved_units - prompt, str(call_id))
        carried = {
            "key": idempotency_key,
            "attempt": attempt,
            "units": record.reserved_units,
            "reservation": record.reservation,
        }
        if record.reservation is not None:
            multi = len(legs) > 1
            self._open[record.reservation] = _Open(
                record.reservation,
                idempotency_key,
                record.reserved_units,
                tokens=(subject, route) if multi else None,
                requests=(subject, requests) if requests is not None else None,
                concurrency=(subject, concurrency) if concurrency is not None else None,
            )
        return carried

    async def _start(self, carried: Mapping[str, Any]) -> None:
        reservation = carried.get("reservation")
        lease = self._open.get(reservation) if isinstance(reservation, str) else None
        if lease is None or lease.started or lease.ended:
            return
        client = self._client()
        await client.with_retry(lambda: client.start(lease.reservation, operation_id_for(lease.key)))
        lease.started = True

    async def _end(self, carried: Any, *, actual_units: int | None, failure: BaseException | None) -> None:
        if not isinstance(carried, Mapping):
            return
        reservation = carried.get("reservation")
        lease = self._open.pop(reservation, None) if isinstance(reservation, str) else None
        if lease is None or lease.ended:
            return
        lease.ended = True
        client = self._client()
        try:
            if not lease.started:
                await client.with_retry(lambda: client.release(lease.reservation))
                return
            ran = True
            if actual_units is None:
                ran = getattr(failure, "status_code", None) not in REFUSED_STATUSES
                actual_units = lease.units if ran else 0
            units = actual_units
            operation = operation_id_for(lease.key)
            if lease.tokens is not None:
                legs = lease.leg_actuals(units, ran)
                await client.with_retry(lambda: client.settle(lease.reservation, operation, legs=legs))
            else:
                await client.with_retry(lambda: client.settle(lease.reservation, operation, units))
        except errors.ReservoirError as error:
            # The agent's deadline and the center's hard limit resolve a
            # reservation nobody settles (docs/design.md §3.5, §3.6).
            log.warning("reservation %s could not be ended: %s", lease.reservation, error)

    # -- LiteLLM's hooks --------------------------------------------------

    async def async_pre_call_hook(
        self, user_api_key_dict: Any, cache: Any, data: dict[str, Any], call_type: Any
    ) -> dict[str, Any]:
        """Proxy: reserve before routing."""
        metadata = data.setdefault(_metadata_member(data), {})
        if METADATA_KEY not in metadata:
            metadata[METADATA_KEY] = await self._reserve(data, user_api_key_dict)
        return data

    async def async_pre_call_deployment_hook(self, kwargs: dict[str, Any], call_type: Any) -> dict[str, Any]:
        """Every async call, right before it is sent: start (reserve first
        when the proxy hook did not)."""
        metadata = _metadata(kwargs)
        carried = metadata.get(METADATA_KEY)
        if not isinstance(carried, Mapping) or self._ended(carried):
            attempt = int(carried.get("attempt", 1)) + 1 if isinstance(carried, Mapping) else 1
            # A fresh dict: the caller's metadata may be shared with retries.
            member = _metadata_member(kwargs)
            carried = await self._reserve(kwargs, None, attempt)
            kwargs[member] = {**metadata, METADATA_KEY: carried}
        await self._start(carried)
        return kwargs

    def _ended(self, carried: Mapping[str, Any]) -> bool:
        """A reservation that ended already (an earlier attempt of a retried
        call): the next attempt needs its own."""
        reservation = carried.get("reservation")
        return isinstance(reservation, str) and reservation not in self._open

    @staticmethod
    def _carried(kwargs: Mapping[str, Any]) -> Any:
        params = kwargs.get("litellm_params") or {}
        return _metadata(params).get(METADATA_KEY) or _metadata(kwargs).get(METADATA_KEY)

    async def async_log_success_event(
        self, kwargs: Any, response_obj: Any, start_time: Any, end_time: Any
    ) -> None:
        response = kwargs.get("complete_streaming_response") or response_obj
        actual = _usage_tokens(response)
        if actual is None:
            standard = kwargs.get("standard_logging_object") or {}
            actual = standard.get("total_tokens") if isinstance(standard, Mapping) else None
        await self._end(self._carried(kwargs), actual_units=actual, failure=None)

    async def async_log_failure_event(
        self, kwargs: Any, response_obj: Any, start_time: Any, end_time: Any
    ) -> None:
        await self._end(self._carried(kwargs), actual_units=None, failure=kwargs.get("exception"))

    async def async_post_call_failure_hook(
        self,
        request_data: dict[str, Any],
        original_exception: Exception,
        user_api_key_dict: Any,
        traceback_str: Any = None,
    ) -> None:
        """Proxy: a request that failed before any deployment call (its
        reservation never started) releases here."""
        await self._end(
            _metadata(request_data).get(METADATA_KEY), actual_units=None, failure=original_exception
        )


def from_environment() -> ReservoirHook:
    """A hook configured from the environment, for the proxy's
    ``callbacks:`` setting (see ``examples/reservoir_callbacks.py``):
    ``RESERVOIR_AGENT_SOCKET`` (default ``/run/reservoir-agent/agent.sock``),
    ``RESERVOIR_SUBJECT`` and ``RESERVOIR_ROUTE`` (fixed names instead of
    the key's team and the model group), ``RESERVOIR_DEFAULT_MAX_TOKENS``
    (the completion estimate of a request without ``max_tokens``, 4096),
    ``RESERVOIR_MIN_COMPLETION_TOKENS`` (unset: fixed reservations; a number:
    flexible ones that may cut a completion down to it),
    ``RESERVOIR_REQUESTS_ROUTE`` and ``RESERVOIR_CONCURRENCY_ROUTE`` (unset:
    tokens only; a route, ``{route}`` standing for the tokens route: a leg
    of 1 request, or of 1 call in flight, in every call's reservation)."""
    import os

    min_completion = os.environ.get("RESERVOIR_MIN_COMPLETION_TOKENS") or None
    return ReservoirHook(
        os.environ.get("RESERVOIR_AGENT_SOCKET", DEFAULT_SOCKET),
        subject=os.environ.get("RESERVOIR_SUBJECT") or None,
        route=os.environ.get("RESERVOIR_ROUTE") or None,
        default_max_tokens=int(os.environ.get("RESERVOIR_DEFAULT_MAX_TOKENS", "4096")),
        min_completion_tokens=int(min_completion) if min_completion is not None else None,
        requests_route=os.environ.get("RESERVOIR_REQUESTS_ROUTE") or None,
        concurrency_route=os.environ.get("RESERVOIR_CONCURRENCY_ROUTE") or None,
    )
