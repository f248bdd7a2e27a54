"""Fixtures: one real central service and agent for the session (from the
``reservoir`` binary, see cluster.py), and a fresh subject per test so the
tests share the processes but never an account."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from cluster import Cluster, policy

# LiteLLM fetches its model cost map over the network at import unless told
# not to; the tests run offline.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

_subjects = itertools.count(1)


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    started = Cluster.start(agents=1)
    try:
        yield started
    finally:
        started.close()


@pytest.fixture
def socket_path(cluster: Cluster) -> str:
    return str(cluster.agents[0].socket)


@dataclass
class Pair:
    """A subject and route with a published policy."""

    cluster: Cluster
    subject: str
    route: str
    policy: dict[str, Any]

    def account(self) -> dict[str, Any]:
        """The current account's terms (the newest account of the pair)."""
        accounts = self.cluster.accounts(self.subject, self.route)
        current: dict[str, Any] = accounts["accounts"][-1]
        return current

    def debt(self) -> int:
        debt: int = self.cluster.accounts(self.subject, self.route)["debt"]
        return debt


def publish(cluster: Cluster, route: str = "chat.generate", **changes: Any) -> Pair:
    subject = f"tenant-{os.getpid()}-{next(_subjects)}"
    document = policy(subject, route, **changes)
    cluster.publish(document)
    return Pair(cluster, subject, route, document)


@pytest.fixture
def pair(cluster: Cluster) -> Pair:
    """A fresh pair under the §4.7-shaped policy: 1000 units, refill 100/s,
    at most 800 per reservation, overdraft up to 200."""
    return publish(cluster)
