"""The async client and lease against a real agent and central service."""

from __future__ import annotations

import asyncio

import pytest
from conftest import Pair

from reservoir_client import AsyncClient, Rejected


async def no_wait(_: float) -> None:
    return None


async def test_concurrent_leases_admit_exactly_what_fits(pair: Pair, socket_path: str) -> None:
    """Three callers reserve 600 of 1000 at once: exactly one is admitted."""
    async with AsyncClient(socket_path, sleep=no_wait) as agent:

        async def one(index: int) -> int | None:
            try:
                async with agent.lease(f"{pair.subject}-req-{index}", pair.subject, pair.route, 600) as lease:
                    await lease.start()
                    lease.actual_units = 200
                    return index
            except Rejected as rejected:
                assert rejected.dimension == "capacity" and rejected.retry_after >= 1
                return None

        admitted = [i for i in await asyncio.gather(*(one(i) for i in range(3))) if i is not None]

    assert len(admitted) == 1
    account = pair.account()
    assert account["spent"] == 200 and account["reserved"] == 0


async def test_async_lease_releases_when_the_body_raises_before_start(pair: Pair, socket_path: str) -> None:
    async with AsyncClient(socket_path, sleep=no_wait) as agent:
        with pytest.raises(RuntimeError):
            async with agent.lease(f"{pair.subject}-req-1", pair.subject, pair.route, 600):
                raise RuntimeError("cancelled before it began")
        record = await agent.reserve(f"{pair.subject}-req-1", pair.subject, pair.route, 600)
    assert record.state == "RELEASED"
    assert pair.account()["reserved"] == 0
