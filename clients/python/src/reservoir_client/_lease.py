"""What a lease does when its ``with`` block ends, without I/O: the sync
and async leases both ask :func:`exit_plan` and carry out its answer, so
the rules of docs/design.md §3.4 are written once.

- Never started: **release** every unit (whether the body raised or not:
  the work did not begin).
- Started, actual usage known: **settle** with it (a multi-leg lease per
  leg: each leg given an actual settles at it, a leg left out at its grant).
- Started, usage unknown (the body raised before reporting it, or never
  reported it): settle **conservatively** at the full reservation (no
  refund on a guess, as the center does at the execution hard limit,
  §3.6; a multi-leg lease: every leg at its grant), or with
  ``on_unknown_usage="leave"`` do nothing and let the
  agent's deadline and the center's hard limit resolve it (§3.5).
- Ended already (the body settled or released itself), or a route in mode
  ``off``: nothing.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from ._protocol import Pair

#: What to do with a started reservation whose usage the body never reported.
UnknownUsage = Literal["reserved", "leave"]


@dataclass(frozen=True)
class Plan:
    """``action`` is ``"release"``, ``"settle"`` or ``"none"``. A settle
    gives ``legs`` (per leg; a leg left out settles at its grant) or else
    ``units``. ``forgot`` is true when a body that did not raise never
    reported usage."""

    action: Literal["release", "settle", "none"]
    units: int = 0
    legs: Mapping[Pair, int] | None = None
    forgot: bool = False


def exit_plan(
    *,
    enforced: bool,
    started: bool,
    ended: bool,
    raised: bool,
    actual_units: int | None,
    reserved_units: int,
    on_unknown_usage: UnknownUsage,
    per_leg: bool = False,
    leg_actuals: Mapping[Pair, int] | None = None,
) -> Plan:
    """``per_leg`` for a lease of several legs, whose usage is
    ``leg_actuals`` (by pair; empty when none was reported)."""
    if ended or not enforced:
        return Plan("none")
    if not started:
        return Plan("release")
    if leg_actuals:
        return Plan("settle", legs=dict(leg_actuals))
    if actual_units is not None:
        return Plan("settle", actual_units)
    if on_unknown_usage == "leave":
        return Plan("none", forgot=not raised)
    if per_leg:
        return Plan("settle", legs={}, forgot=not raised)
    return Plan("settle", reserved_units, forgot=not raised)


def operation_id_for(idempotency_key: str) -> str:
    """The operation ID a lease binds by default: derived from the key, so
    a retry of the whole request (even from another process) binds the
    same operation and a start cannot be taken twice."""
    return "op-" + hashlib.sha256(idempotency_key.encode()).hexdigest()[:32]
