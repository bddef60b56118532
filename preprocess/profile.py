"""Run a pipeline on a sample of items step by step, keeping every intermediate:
AutoOrder reads each step's inflation and whether it changes type or rank, the
determinism check reruns steps on their real inputs."""
from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .measure import kind, nbytes
from .pipeline import ItemContext, Pipeline, StepError


@dataclass
class Trace:
    """inputs[pos][k]: item k's input to the step at execution position pos
    (inputs[len] holds the outputs); ctxs[k]: item k's seeding context."""
    order: tuple[int, ...]
    inputs: list[list[Any]]
    ctxs: list[ItemContext]
    seconds: dict[int, float] = field(default_factory=dict)  # per step, summed over the items
    item_seconds: list[float] = field(default_factory=list)   # per item, all steps

    def factors(self) -> dict[int, float]:
        """Inflation factor of each step (written position): bytes out / bytes in,
        summed over the sample."""
        out = {}
        for pos, j in enumerate(self.order):
            b_in = sum(nbytes(x) for x in self.inputs[pos])
            b_out = sum(nbytes(x) for x in self.inputs[pos + 1])
            out[j] = b_out / b_in if b_in else 1.0
        return out

    def changes_kind(self) -> set[int]:
        """Steps whose output differs from their input in type or rank on any item."""
        return {j for pos, j in enumerate(self.order)
                if any(kind(a) != kind(b) for a, b in zip(self.inputs[pos], self.inputs[pos + 1]))}


    def makes_half(self) -> set[int]:
        """Steps that cast to a half-precision float (Pecan's footnote: CPUs compute
        slowly on these, so such casts go last although they deflate)."""
        return {j for pos, j in enumerate(self.order)
                if any(_half(b) and not _half(a) for a, b in zip(self.inputs[pos], self.inputs[pos + 1]))}


def _half(x: Any) -> bool:
    dt = getattr(x, "dtype", None)
    return dt is not None and str(dt).rsplit(".", 1)[-1] in ("float16", "bfloat16")


def private(x: Any) -> Any:
    """A copy of x for a step to run on: a step may change its input in place (`x *= 2`),
    and a trace keeps every intermediate (the kept items of autocache's probe, the inputs
    AutoOrder and the determinism check run steps on again). What cannot be copied is
    passed as it is."""
    try:
        return copy.deepcopy(x)
    except Exception:
        return x


def trace(pipeline: Pipeline, items: Sequence[Any], ctxs: Sequence[ItemContext]) -> Trace:
    """Trace items through the current order; an item a step fails on is left out
    (the loader's on_error deals with it in the epoch). Raises the first StepError
    if no item gets through."""
    rows, kept, item_seconds, seconds = [], [], [], dict.fromkeys(pipeline.order, 0.0)
    first_error: StepError | None = None
    for x, c in zip(items, ctxs):
        row = [x]
        t_item, copying = time.perf_counter(), 0.0
        try:
            for j in pipeline.order:
                t0 = time.perf_counter()
                x_in = private(row[-1])  # not timed: the loader's steps run on their own items
                t1 = time.perf_counter()
                copying += t1 - t0
                row.append(pipeline.call_step(j, x_in, c))
                seconds[j] += time.perf_counter() - t1
        except StepError as e:
            first_error = first_error or e
            continue
        rows.append(row)
        kept.append(c)
        item_seconds.append(time.perf_counter() - t_item - copying)
    if not rows and first_error is not None:
        raise first_error
    inputs = [[row[pos] for row in rows] for pos in range(len(pipeline.order) + 1)]
    return Trace(pipeline.order, inputs, kept, seconds, item_seconds)
