"""A bounded wait for a state another task reaches (LiteLLM logs success
and failure events in background tasks, after the call returned)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Callable, TypeVar

T = TypeVar("T")

WAIT_TIMEOUT_S = 10.0
POLL_INTERVAL_S = 0.02


async def wait_until(
    what: str, probe: Callable[[], Awaitable[T | None]], timeout: float = WAIT_TIMEOUT_S
) -> T:
    """Asks ``probe`` every 20 ms until it returns something other than
    ``None``, for at most ``timeout`` seconds; then fails naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = await probe()
        if value is not None:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        await asyncio.sleep(POLL_INTERVAL_S)
