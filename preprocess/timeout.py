"""The slow-item timeout (MinatoLoader §4.2): the 75th percentile of recent items'
preprocessing time, so the slowest quarter moves to the background; none until
enough items were measured (or remembered from earlier epochs and jobs).

`known_slow`: the cost above which a remembered item is started first, in the
background: over the timeout and at least twice the median (the timeout alone
would call a quarter of uniform items slow, by its definition)."""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable

PERCENTILE = 0.75
MIN_SAMPLES = 8
WINDOW = 1024
FLOOR = 0.002  # moving an item to the background costs a hand-over: not worth it below this


class SlowTimeout:
    def __init__(self, known: Iterable[float] = ()) -> None:
        self.recent: deque[float] = deque(known, maxlen=WINDOW)
        self.seconds: float | None = None
        self.known_slow: float | None = None
        self._since = 0
        self._update()

    def add(self, seconds: float) -> None:
        self.recent.append(seconds)
        self._since += 1
        if self.seconds is None or self._since >= 32:  # a sort per 32 items
            self._update()

    def _update(self) -> None:
        self._since = 0
        if len(self.recent) >= MIN_SAMPLES:
            xs = sorted(self.recent)
            self.seconds = max(FLOOR, xs[int(PERCENTILE * (len(xs) - 1))])
            self.known_slow = max(self.seconds, 2 * xs[len(xs) // 2])
