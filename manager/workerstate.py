"""A job's worker-scaling policy as the manager journals it (the ``workers``
event, model.py): ``{"kind": "autoscale" | "placement", "state": policy.to_dict()}``
in JSON form (lists, not tuples), so what the model holds in memory is what a
replay of the journal gives, byte for byte.

What is journaled, and when (manager/workers.py): a job's policy after every call
that changed it in anything but its window counters (``WINDOW_COUNTERS``): a
fresh start over a journaled policy (over none it is what a restart rebuilds
from the job's counts: not journaled), a change of counts, of phase, of the plateau or the references a
climb compares against. A measurement that only counts a window (one dropped
after a change, one more toward a re-check) is not journaled: a policy that has
converged changes nothing for minutes, and an fsync a window (0.5-1 s, per job)
would make the manager's disk commit every job's windows. After a restart the
policy resumes from its last journaled form, which loses nothing but those
counters: at most ``settle`` windows dropped again, a re-check interval counted
again from its start.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from .policy.autoscale import Autoscaler
from .policy.placement import Placement

KINDS = ("autoscale", "placement")
Policy = Autoscaler | Placement
# Fields a policy moves at every window without deciding anything (see the docstring).
WINDOW_COUNTERS = frozenset({"settle_left", "since_check", "check_sum"})


def kind_of(p: Policy) -> str:
    return "autoscale" if isinstance(p, Autoscaler) else "placement"


def saved_form(p: Policy) -> dict[str, Any]:
    """The journaled form of a policy (JSON types only)."""
    return {"kind": kind_of(p), "state": json.loads(json.dumps(p.to_dict()))}


def restore(saved: Mapping[str, Any]) -> Policy:
    """The policy a journaled form describes; ValueError naming what is wrong."""
    kind, state = saved.get("kind"), saved.get("state")
    if kind not in KINDS:
        raise ValueError(f"worker policy kind must be one of {KINDS}, got {kind!r}")
    if not isinstance(state, Mapping):
        raise ValueError(f"worker policy state must be a dict, got {type(state).__name__}")
    try:
        return Autoscaler.from_dict(state) if kind == "autoscale" else Placement.from_dict(state)
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"bad {kind} policy state: {e!r}") from None


def checked(saved: Mapping[str, Any]) -> dict[str, Any]:
    """A journaled form validated (it restores) and normalised to JSON types."""
    return saved_form(restore(saved))


def decisive(saved: Mapping[str, Any] | None) -> Any:
    """A journaled form without its window counters (also its placement's
    autoscaler's): two forms equal here differ in nothing worth an fsync."""
    if saved is None:
        return None
    state = {k: v for k, v in saved["state"].items() if k not in WINDOW_COUNTERS}
    if isinstance(state.get("scaler"), Mapping):
        state["scaler"] = {k: v for k, v in state["scaler"].items() if k not in WINDOW_COUNTERS}
    return saved["kind"], state


def decisive_key(p: Policy) -> tuple[Any, ...]:
    """What ``decisive`` keeps, read off the live policy without copying it (a few
    microseconds, against tens for ``saved_form``): equal keys, equal decisive forms."""
    return tuple((k, decisive_key(v) if isinstance(v, Autoscaler) else v)
                 for k, v in vars(p).items() if k not in WINDOW_COUNTERS)
