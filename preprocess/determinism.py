"""Catch steps declared non-random that are: run each on its real inputs (from a
trace of sample items) under two different seeds of the global generators; a
step whose outputs differ, or that draws from one of those generators at all (a
coin flip with p=0.1 lands alike under both seeds, for every item: each run
starts from the same seeded state), is reported and from then on treated as
random (the cacheable prefix ends before it, and it is seeded per item)."""
from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from .measure import same
from .pipeline import Pipeline
from .profile import Trace, private
from .seeding import SEEDING, generator_states, seed_globals

SEEDS = (0x5EED_0001, 0x5EED_0002)
ITEMS = 3


def check_declared(pipeline: Pipeline, tr: Trace) -> dict[int, str]:
    """Returns {step: reason} for the steps caught, recorded in pipeline.caught_random."""
    caught: dict[int, str] = {}
    for pos, j in enumerate(tr.order):
        # a per_epoch=False step must draw the same under the same seed (else it is treated as
        # drawing anew each epoch); any other step must not draw at all
        fixed = pipeline.is_random(j) and not pipeline.per_epoch(j)
        if pipeline.is_random(j) and not fixed:
            continue
        name = pipeline.steps[j].name
        for k, x in enumerate(tr.inputs[pos][:ITEMS]):
            outs, drew = _run_twice(pipeline.steps[j].fn, x, (SEEDS[0], SEEDS[0]) if fixed else SEEDS)
            if len(outs) == 2 and not same(outs[0], outs[1]):
                caught[j] = (f"step {j} ({name}) is declared per_epoch=False but gave different "
                             f"outputs under the same seed on sample item {k}; treated as drawing anew each epoch "
                             f"(it must draw only from random, numpy's or torch's global generator)" if fixed else
                             f"step {j} ({name}) is not declared random but gave different "
                             f"outputs under two seeds on sample item {k}; treated as random (mark it "
                             f"random=True, or make it deterministic)")
                break
            if drew and not fixed:
                caught[j] = (f"step {j} ({name}) is not declared random but draws from {' and '.join(drew)}'s "
                             f"global generator on sample item {k}; treated as random (mark it random=True, "
                             f"or make it deterministic)")
                break
    for j, why in caught.items():
        pipeline.caught_random[j] = why
        warnings.warn(why, stacklevel=2)
    return caught


def _run_twice(fn: Callable[[Any], Any], x: Any, seeds: tuple[int, int]) -> tuple[list[Any], list[str]]:
    """fn's outputs on x under each seed ([] if it raised), and the global generators it drew
    from under them: a draw whose outcome left these outputs alike (p=0.1 under both seeds)
    is still a draw. A generator the step seeds itself (random.seed(0)) ends alike: not counted."""
    outs, runs = [], []
    for seed in seeds:
        # under the process's seeding lock, as a random step runs: another thread's step (a loader
        # iterated meanwhile) must neither draw between these states nor be re-seeded mid-step here
        with SEEDING.held():
            seed_globals(seed)
            before = generator_states()
            try:
                outs.append(fn(private(x)))  # each run on its own copy: a step may change it
            except Exception:
                return [], []
            runs.append((before, generator_states()))
    (b0, a0), (_, a1) = runs
    return outs, [g for g in b0 if a0[g] != b0[g] and a0[g] != a1[g]]
