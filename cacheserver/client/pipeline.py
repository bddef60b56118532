"""Keep several batch requests in flight, results in order.

A single synchronous stream leaves both ends idle half the time: the server
reads RocksDB while the client waits, then the client copies while the server
waits. With two requests in flight (separate pooled connections) the server
reads batch N+1 while batch N is on the wire.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def pipelined(fn: Callable[[T], R], batches: Iterable[T], depth: int, executor: Executor) -> Iterator[R]:
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    pending: deque = deque()
    try:
        for batch in batches:
            pending.append(executor.submit(fn, batch))
            if len(pending) >= depth:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for f in pending:  # consumer stopped early: don't leave work running
            f.cancel()
