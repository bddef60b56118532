"""Synthetic and recorded-style traces for the worker-scaling policies: models
that give a Measurement for a (remote, local) worker count, and a driver that
feeds a policy until it has converged and stays put."""
from __future__ import annotations

import json
import random
from typing import Callable

from manager.policy.scaling import Measurement

Model = Callable[[int, int], Measurement]


def pipeline_model(item_s: float = 0.020, batch: int = 32, step_s: float = 0.050,
                   queue_cap: float = 64.0, noise: float = 0.0, seed: int = 0) -> Model:
    """The autoscale benchmark's shape: each item costs ``item_s`` in a worker,
    batches of ``batch``, a trainer step of ``step_s``. Batch time is whichever
    side is slower; the queue fills in proportion to the workers' surplus."""
    rng = random.Random(seed)

    def measure(remote: int, local: int = 0) -> Measurement:
        n = remote + local
        supply = n * step_s / (item_s * batch) if n else 0.0   # >1: workers outpace the model
        bpt = step_s if supply >= 1 else item_s * batch / max(n, 1e-9)
        jitter = 1 + rng.uniform(-noise, noise)
        return Measurement(bpt * jitter, min(queue_cap, queue_cap * max(0.0, supply - 1)),
                           cpu=min(1.0, 1 / supply) if n else 1.0)
    return measure


def placement_model(step_s: float = 0.025, batch: int = 32, remote_item_s: float = 0.008,
                    local_item_s: float = 0.004, free_cores: int = 3,
                    contention: float = 0.15) -> Model:
    """A trainer host with ``free_cores`` spare cores: local workers are cheap
    and fast until they contend with the trainer (each one past the spare
    cores slows its step by ``contention``); remote workers cost money."""
    def measure(remote: int, local: int) -> Measurement:
        step = step_s * (1 + contention * max(0, local - free_cores))
        rate = remote / remote_item_s + local / local_item_s
        return Measurement(max(step, batch / rate) if rate else 1e3)
    return measure


def table_model(bpt: dict[int, float]) -> Model:
    """A recorded sweep: batch time per remote worker count (the last entry
    holds beyond the table)."""
    top = max(bpt)
    return lambda remote, local=0: Measurement(bpt[min(max(remote, min(bpt)), top)])


def drive(policy, model: Model, steps: int, journal: bool = False):
    """Feed ``steps`` measurements at the policy's current counts; return the
    policy and the (remote, local) counts after each step. With ``journal`` the policy is
    round-tripped through JSON before every step, as the daemon would after a
    crash."""
    counts = []
    for _ in range(steps):
        if journal:
            policy = type(policy).from_dict(json.loads(json.dumps(policy.to_dict())))
        remote = getattr(policy, "remote", getattr(policy, "workers", 0))
        policy.observe(model(remote, getattr(policy, "local", 0)))
        counts.append((getattr(policy, "remote", getattr(policy, "workers", 0)),
                       getattr(policy, "local", 0)))
    return policy, counts
