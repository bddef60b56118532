"""Per-epoch preprocessing statistics: per step time and bytes in and out, items
moved to the background, skipped, the worker count and the order run."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepStats:
    name: str
    items: int = 0
    seconds: float = 0.0
    bytes_in: int = 0
    bytes_out: int = 0

    @property
    def inflation(self) -> float:
        return self.bytes_out / self.bytes_in if self.bytes_in else 1.0


@dataclass
class PreprocessStats:
    steps: dict[int, StepStats]          # by written position
    order: str = ""                      # execution order and how it was chosen
    items: int = 0                       # items finished
    skipped: int = 0                     # items whose step raised, with on_error="skip"
    dropped: int = 0                     # left out: slow items (exactly_once=False), a last short batch (drop_last)
    rerun: int = 0                       # items sent again because their worker died
    moved: int = 0                       # items finished in the background (over the timeout, or known slow)
    known_slow_first: int = 0            # items started early because the cost memory knew them slow
    timeout: float | None = None         # the slow-item timeout at epoch end (seconds)
    stalled: int = 0                     # steps warned about as stuck on an item (step_warning)
    timed_out: int = 0                   # items failed for a step over step_timeout (their worker stopped)
    workers: list[int] = field(default_factory=list)  # worker counts the epoch ran with, in order
    errors: list[str] = field(default_factory=list)   # what was skipped (first few)

    def add(self, records: list[tuple[int, float, int, int]]) -> None:
        for j, secs, b_in, b_out in records:
            s = self.steps[j]
            s.items += 1
            s.seconds += secs
            s.bytes_in += b_in
            s.bytes_out += b_out

    def line(self) -> str:
        per = ", ".join(f"{s.name} {1e3 * s.seconds / max(1, s.items):.2f} ms x{s.inflation:.2f}"
                        for s in self.steps.values())
        dropped = f"{self.dropped} dropped, " if self.dropped else ""
        stuck = f"{self.stalled} stuck steps, {self.timed_out} timed out, " if self.stalled or self.timed_out else ""
        return (f"preprocess: {self.items} items, {self.moved} in background ({self.known_slow_first} known slow), "
                f"{self.skipped} skipped, {dropped}{stuck}workers {self.workers[-1] if self.workers else 0}; {per}")
