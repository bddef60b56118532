"""Where the scheduler's items come from, and what happens at the caching point.

A feed hands the workers (and the in-process path) each item with the execution
position to start it at: 0 for an item read from its source, the caching point for
an item whose output there was kept (autocache, clients/autofeed.py). An item that
starts before the caching point and is to be kept goes back to the feed when it
reaches that point (`passed`); the feed stores it without holding up the item.
Duck-typed: preprocess never imports the client package. Without autocache the feed
is PlainFeed: the dataset's read(), every step from the first."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

from .pipeline import ItemContext, Pipeline, StepRecord


@dataclass
class Fed:
    item: Any                # what ds.read gives (a (sample, target) pair with target=), or the kept output
    start: int = 0           # execution position to start at
    keep: int | None = None  # execution position at which to hand the sample to feed.passed
    token: Any = None        # what the feed needs to store it


class Feed(Protocol):
    def read(self, indices: list[int]) -> list[Any]: ...

    def fetch(self, indices: list[int], epoch: int) -> list[Fed]: ...

    def passed(self, token: Any, x: Any) -> None: ...

    # optional: resolve(indices, epoch) -> {index: finished item} for items that need no
    # step at all (taken in the loader's process, never sent to a worker)

    def idle(self) -> None: ...

    def close(self) -> None: ...


class PlainFeed:
    """Every item from the dataset's read path, every step run, nothing kept."""

    def __init__(self, ds: Any) -> None:
        self.ds = ds

    def read(self, indices: list[int]) -> list[Any]:
        return self.ds.read(indices)

    def fetch(self, indices: list[int], epoch: int) -> list[Fed]:
        return [Fed(x) for x in self.ds.read(indices)]

    def passed(self, token: Any, x: Any) -> None:
        pass

    def idle(self) -> None:
        pass

    def close(self) -> None:
        pass


def run_item(pipeline: Pipeline, feed: Any, keep: int | None, token: Any, x: Any, ctx: ItemContext,
             pos: int, deadline: float | None, records: list[StepRecord]) -> tuple[Any, int]:
    """pipeline.run from `pos`, handing the sample to the feed as it passes `keep`
    (before the steps after it run: they may change it in place). Returns (x, next
    position), stopping early once `deadline` has passed, as Pipeline.run."""
    if keep is not None and pos < keep:
        x, pos = pipeline.run(x, ctx, pos, deadline, records, stop=keep)
        if pos < keep:
            return x, pos
        feed.passed(token, x)
        if deadline is not None and time.perf_counter() > deadline and pos < len(pipeline.order):
            return x, pos
    return pipeline.run(x, ctx, pos, deadline, records)
