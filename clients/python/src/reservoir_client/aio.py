"""The asynchronous client: the same API as :mod:`reservoir_client.client`,
with ``await`` and ``async with`` (httpx's async UDS transport)."""

from __future__ import annotations

import asyncio
import logging
import warnings
from collections.abc import Awaitable, Iterable, Mapping
from types import TracebackType
from typing import Any, Callable, TypeVar

import httpx

from . import _protocol as protocol
from . import errors
from ._lease import UnknownUsage, exit_plan, operation_id_for
from ._protocol import Leg, Pair, Reservation, RetryPolicy

log = logging.getLogger("reservoir_client")

T = TypeVar("T")

#: Default socket path (systemd/agent.toml.example).
DEFAULT_SOCKET = "/run/reservoir-agent/agent.sock"


class AsyncClient:
    """A client of one agent's socket API (docs/design.md §6.5).

    Each method is one call; every non-2xx answer raises its
    :mod:`reservoir_client.errors` class and no method retries on its own.
    :meth:`lease` is the safe way to run work: it reserves, starts, and
    settles or releases exactly once, retrying unknown outcomes under the
    same key.

    ::

        async with AsyncClient("/run/reservoir-agent/agent.sock") as agent:
            async with agent.lease("req-42", "tenant-7", "chat.generate", units=600) as lease:
                await lease.start()
                used = await run_the_work(max_units=lease.granted_units)
                lease.actual_units = used
    """

    def __init__(
        self,
        socket_path: str = DEFAULT_SOCKET,
        *,
        timeout: float = 10.0,
        retry: RetryPolicy = RetryPolicy(),
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.socket_path = socket_path
        self.retry = retry
        self._sleep = sleep
        self._http = httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(uds=socket_path),
            base_url=protocol.BASE_URL,
            timeout=timeout,
        )

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _send(self, request: protocol.Request) -> httpx.Response:
        try:
            return await self._http.request(request.method, request.path, json=request.body)
        except httpx.TransportError as cause:
            raise protocol.no_answer(request, cause) from cause

    async def _reservation(self, request: protocol.Request) -> Reservation:
        response = await self._send(request)
        return protocol.reservation(response.status_code, response.headers, response.content)

    async def reserve(
        self,
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
    ) -> Reservation:
        """Reserve ``units`` for the request named ``idempotency_key``. A
        repeat of the key answers the same reservation. Raises
        :class:`errors.Rejected` (429) when not admitted now, nothing held.

        With ``min_units`` (1 to ``units``) the reserve is flexible: the
        agent holds the largest amount from ``min_units`` to ``units`` it can
        cover now (:attr:`Reservation.reserved_units`) and refuses only when
        not even ``min_units`` is there. A ``min_units`` of 0 or above
        ``units`` raises :class:`errors.InvalidRequest` (``field`` is
        ``minUnits``); a retry of the key must repeat the same value.

        With ``legs`` instead of ``subject``, ``route`` and ``units`` it
        reserves several pairs at once (docs/design.md §3.13): every leg is
        admitted, each granted its own units (:attr:`Reservation.legs`), or
        none is and :class:`errors.Rejected` names the limiting leg
        (``leg``, ``subject``, ``route``). Bad legs raise
        :class:`errors.InvalidRequest` with ``field`` naming the leg's member
        (``legs[1].minUnits``), nothing held. Settle it per leg
        (:meth:`settle` with ``legs``)."""
        return await self._reservation(
            protocol.reserve(
                idempotency_key,
                subject,
                route,
                units,
                legs=legs,
                min_units=min_units,
                deadline_ms=deadline_ms,
                priority=priority,
                request=request,
            )
        )

    async def get(self, reservation: str) -> Reservation:
        return await self._reservation(protocol.get(reservation))

    async def start(self, reservation: str, operation_id: str) -> Reservation:
        """Bind ``operation_id``: the work may begin. The same operation again
        answers the same record."""
        return await self._reservation(protocol.start(reservation, operation_id))

    async def settle(
        self,
        reservation: str,
        operation_id: str,
        actual_units: int | None = None,
        *,
        legs: Mapping[Pair, int] | None = None,
    ) -> Reservation:
        """Charge the actual usage and refund the rest, once. A 202
        (``accepted``) means journaled, delivered to the center later.

        A multi-leg reservation settles per leg: ``legs`` maps each leg's
        ``(subject, route)`` to its actual units, and a leg left out settles
        at its grant (``legs={}`` settles every leg at its grant). Give
        ``actual_units`` or ``legs``, not both (``ValueError``); the one
        number on several legs, or a pair that is not a leg, raises
        :class:`errors.InvalidRequest`."""
        return await self._reservation(protocol.settle(reservation, operation_id, actual_units, legs=legs))

    async def release(self, reservation: str) -> Reservation:
        """Give every unit back (only before start)."""
        return await self._reservation(protocol.release(reservation))

    async def cancel(self, reservation: str) -> Reservation:
        """Record that the caller cancelled; ends nothing (§3.5)."""
        return await self._reservation(protocol.cancel(reservation))

    async def status(self) -> Mapping[str, Any]:
        response = await self._send(protocol.status())
        return protocol.interpret(response.status_code, response.headers, response.content)

    async def with_retry(self, call: Callable[[], Awaitable[T]]) -> T:
        """Runs ``call`` again while it raises :class:`errors.Retryable`,
        within :attr:`retry`; ``call`` must repeat the same request (same
        key, operation ID, actual units)."""
        attempt = 1
        while True:
            try:
                return await call()
            except errors.ReservoirError as error:
                delay = self.retry.delay(error, attempt)
                if delay is None:
                    raise
                log.info("retrying after %s (attempt %d)", error, attempt)
                await self._sleep(delay)
                attempt += 1

    def lease(
        self,
        idempotency_key: str,
        subject: str | None = None,
        route: str | None = None,
        units: int | None = None,
        *,
        legs: Iterable[Leg] | None = None,
        operation_id: str | None = None,
        min_units: int | None = None,
        deadline_ms: int | None = None,
        priority: int | None = None,
        request: Any = None,
        on_unknown_usage: UnknownUsage = "reserved",
    ) -> AsyncLease:
        """A context manager that reserves on entry and settles or releases
        exactly once on exit (see :mod:`reservoir_client._lease` for the rules).
        With ``legs`` it reserves them all at once and settles per leg
        (:attr:`Lease.leg_actuals`)."""
        # Checked now rather than on entry.
        asked = protocol.reserve_form(subject, route, units, legs=legs, min_units=min_units)
        return AsyncLease(
            self,
            idempotency_key,
            subject,
            route,
            units,
            legs=asked,
            operation_id=operation_id or operation_id_for(idempotency_key),
            reserve_options={
                "min_units": min_units,
                "deadline_ms": deadline_ms,
                "priority": priority,
                "request": request,
            },
            on_unknown_usage=on_unknown_usage,
        )


class AsyncLease:
    """One reservation's life in an ``async with`` block.

    Entering reserves (retrying unknown outcomes under the same key; a 429
    raises :class:`errors.Rejected` and nothing is held). In the block, call
    :meth:`start` right before the work begins, then report what it used with
    :meth:`settle` or by setting :attr:`actual_units` — per leg for a lease of
    several legs: :attr:`leg_actuals` maps a leg's ``(subject, route)`` to
    its actual units, and a leg left out settles at its grant (a concurrency
    leg is given 0, which frees its slot). On exit the lease
    releases an unstarted reservation and settles a started one, exactly
    once; see :func:`reservoir_client._lease.exit_plan`.
    """

    def __init__(
        self,
        client: AsyncClient,
        idempotency_key: str,
        subject: str | None,
        route: str | None,
        units: int | None,
        *,
        legs: tuple[Leg, ...] | None = None,
        operation_id: str,
        reserve_options: Mapping[str, Any],
        on_unknown_usage: UnknownUsage,
    ) -> None:
        self._client = client
        self.idempotency_key = idempotency_key
        self.subject = subject
        self.route = route
        self.units = units
        self.legs = legs
        self.operation_id = operation_id
        self._reserve_options = reserve_options
        self.on_unknown_usage: UnknownUsage = on_unknown_usage
        self.actual_units: int | None = None
        self.leg_actuals: dict[Pair, int] = {}
        self.reservation: Reservation | None = None
        self.started = False
        self.ended = False

    @property
    def granted_units(self) -> int:
        """What the caller may use: the grant (:attr:`Reservation.reserved_units`),
        which a flexible lease (``min_units``) may have lowered below
        :attr:`units`; all of :attr:`units` before entry and on a route in
        mode ``off``. For a lease of several legs, the first leg's (each
        leg's is in ``reservation.legs``)."""
        if self.reservation is None or not self.reservation.enforced:
            return self.legs[0].units if self.legs else self.units or 0
        return self.reservation.granted_units

    def _id(self) -> str | None:
        return self.reservation.reservation if self.reservation is not None else None

    async def __aenter__(self) -> AsyncLease:
        self.reservation = await self._client.with_retry(
            lambda: self._client.reserve(
                self.idempotency_key,
                self.subject,
                self.route,
                self.units,
                legs=self.legs,
                **self._reserve_options,
            )
        )
        return self

    async def start(self) -> Reservation | None:
        """Bind the operation: call it right before the work begins. A lost
        reply is retried with the same operation ID."""
        reservation = self._id()
        if reservation is None:
            self.started = True
            return self.reservation
        record = await self._client.with_retry(lambda: self._client.start(reservation, self.operation_id))
        self.reservation, self.started = record, True
        return record

    async def settle(
        self, actual_units: int | None = None, *, legs: Mapping[Pair, int] | None = None
    ) -> Reservation | None:
        """Settle now with the actual usage, one number or per leg (see
        :meth:`Client.settle`); the exit then does nothing."""
        if legs is not None:
            self.leg_actuals = dict(legs)
        else:
            self.actual_units = actual_units
        reservation = self._id()
        if reservation is None or self.ended:
            self.ended = True
            return self.reservation
        record = await self._client.with_retry(
            lambda: self._client.settle(reservation, self.operation_id, actual_units, legs=legs)
        )
        self.reservation, self.ended = record, True
        return record

    async def release(self) -> Reservation | None:
        """Release now, before start (the exit then does nothing)."""
        reservation = self._id()
        if reservation is None or self.ended:
            self.ended = True
            return self.reservation
        record = await self._client.with_retry(lambda: self._client.release(reservation))
        self.reservation, self.ended = record, True
        return record

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        reservation = self.reservation
        plan = exit_plan(
            enforced=reservation is not None and reservation.enforced,
            started=self.started,
            ended=self.ended,
            raised=error is not None,
            actual_units=self.actual_units,
            reserved_units=reservation.reserved_units if reservation is not None else 0,
            on_unknown_usage=self.on_unknown_usage,
            per_leg=self.legs is not None,
            leg_actuals=self.leg_actuals,
        )
        if plan.forgot:
            warnings.warn(
                f"lease {self.idempotency_key!r} started but never reported its usage; "
                + (
                    "settled every leg at its grant"
                    if plan.legs is not None
                    else f"settled at the full reservation ({plan.units} units)"
                )
                if plan.action == "settle"
                else f"lease {self.idempotency_key!r} started but never reported its usage; left to the deadline",
                stacklevel=2,
            )
        try:
            if plan.action == "release":
                await self.release()
            elif plan.action == "settle":
                if plan.legs is not None:
                    await self.settle(legs=plan.legs)
                else:
                    await self.settle(plan.units)
        except errors.ReservoirError as cleanup:
            if error is None:
                raise
            log.warning(
                "lease %s: %s failed after the body raised: %s", self.idempotency_key, plan.action, cleanup
            )
