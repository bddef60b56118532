"""Stop signals (SIGTERM, SIGINT, ...) as a flag that a signal handler may safely set.

A Python signal handler runs in the main thread between two of its bytecodes, possibly while
that thread holds a lock; a handler that takes a lock the thread holds waits for ever. Setting
a threading.Event takes its condition's lock, which `Event.wait` holds as it enters and leaves
each wait: a daemon whose main thread waited on an Event for the signal that sets it could hang
at SIGTERM, never beginning to drain (seen under load). The handler here takes no lock: it only
appends to a list, which the main thread polls in short sleeps."""
from __future__ import annotations

import signal
import time
from collections.abc import Iterable

POLL_S = 0.1  # how soon a waiter sees a signal (a sleep the signal does not cut short)


class SignalFlag:
    """Set by any of `signals` once installed (main thread only, as signal.signal requires).
    `received` lists the signals in the order they came."""

    def __init__(self, signals: Iterable[signal.Signals]) -> None:
        self.received: list[int] = []
        self._previous = {s: signal.signal(s, self._on_signal) for s in signals}

    def _on_signal(self, signum: int, frame: object) -> None:
        self.received.append(signum)  # no lock: see the module's docstring

    def is_set(self) -> bool:
        return bool(self.received)

    def wait(self, timeout: float, poll_s: float = POLL_S) -> bool:
        """Whether a signal came, within about `timeout` seconds (a `poll_s` slice more at most)."""
        deadline = time.monotonic() + max(0.0, timeout)
        while not self.received:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(poll_s, left))
        return True

    def restore(self) -> None:
        """Put back the handlers that were installed before."""
        for s, h in self._previous.items():
            signal.signal(s, h)
