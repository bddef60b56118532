"""Vocabulary shared by the worker-scaling policies (autoscale.py, placement.py,
hpa.py): what a policy is fed (a Measurement per window of batches) and what it
answers (a Change in worker counts). Pure data, no I/O, no clocks.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping


@dataclass(frozen=True)
class Measurement:
    """One measurement window, as the job's client reports it.

    batch_time: mean seconds per training batch over the window (the caller
        averages over its window, e.g. 100 batches as in Cachew, so one
        Measurement is one policy step).
    queue: mean number of ready batches/items waiting ahead of the trainer
        (Cachew's result_queue_size); it grows when workers outpace the model.
    cpu: mean CPU utilisation of the workers, 0..1 (only the HPA peer uses it).
    """
    batch_time: float
    queue: float = 0.0
    cpu: float = 0.0

    def __post_init__(self) -> None:
        if not self.batch_time > 0:
            raise ValueError(f"batch_time must be > 0 seconds, got {self.batch_time!r}")
        if self.queue < 0 or self.cpu < 0:
            raise ValueError(f"queue and cpu must be >= 0, got queue={self.queue}, cpu={self.cpu}")


@dataclass(frozen=True)
class Change:
    """Start (+) or drain and stop (-) workers. ``remote`` and ``local`` are the
    counts after the change; the deltas are what the daemon must do. A removed
    worker drains first: it finishes what it holds before it stops."""
    remote_delta: int
    local_delta: int
    remote: int
    local: int
    reason: str


def change_to_dict(c: Change) -> dict[str, Any]:
    return asdict(c)


def change_from_dict(d: Mapping[str, Any]) -> Change:
    return Change(**d)


def relative(new: float, ref: float) -> float:
    """``new / ref - 1``: > 0 when ``new`` is larger (slower, dearer)."""
    return new / ref - 1.0
