"""Sizes a job's remote and local preprocessing workers with the scaling policies
(manager/policy: Cachew's autoscaling, Pecan's AutoPlacement), run by the job
itself or by the cache manager (managed.py): every `every` batches the feeder's measurements (mean batch time, mean
ready queue) go to the policy, and its Change is carried out at once: remote
workers are started or drained (pool.resize), local ones set through
`set_local`, and the feeder leaves the local workers their share of each batch.
When the remote pool breaks (the cluster is gone), or is left with no worker and may
start none (deaths used up its replacements, or Ray could not schedule one), the policy
is dropped and the local workers are set to `fallback_local`, once. A paused controller (nothing the
workers could make would be read: pause()) stops the remote workers at once, their queued
tasks with them, and leaves
every item to the local ones until resume()."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from statistics import fmean
from typing import Any

from manager.policy.autoscale import Autoscaler
from manager.policy.placement import Placement
from manager.policy.scaling import Change, Measurement


@dataclass
class Decision:
    at: float           # seconds since the controller started
    batch: int          # batches handed on by then
    change: Change


@dataclass
class Controller:
    pool: Any
    policy: Autoscaler | Placement | Any  # or ManagedPolicy: the cache manager runs one of them
    set_local: Callable[[int], None] | None = None
    every: int = 20
    fallback_local: int = 1
    hold_limit: int = 3   # windows a measurement waits at most for started workers
    decisions: list[Decision] = field(default_factory=list)
    fell_back: bool = False
    paused: bool = False

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"every must be >= 1 batch, got {self.every}")
        self._t0 = time.monotonic()
        self._seen = 0
        self._held = 0
        self.pool.resize(self.remote)
        if self.set_local is not None:
            self.set_local(self.local)

    @property
    def remote(self) -> int:
        p = self.policy
        return p.workers if isinstance(p, Autoscaler) else p.remote

    @property
    def local(self) -> int:
        p = self.policy
        return 0 if isinstance(p, Autoscaler) else p.local

    def local_share(self) -> float:
        r, l = (0, max(1, self.local)) if self.fell_back or self.paused else (self.pool.size, self.local)
        return l / (r + l) if r + l else 1.0

    def __call__(self, feeder: Any) -> None:
        """After each batch the feeder hands on."""
        st = feeder.stats
        if self.pool.broken or self._spent():
            self._fall_back()
        elif self.paused:  # batches made without remote workers say nothing about their count
            self._seen = len(st.batch_times)
        else:
            times, queues = st.batch_times[self._seen:], st.queues[self._seen:]
            if len(times) >= self.every:
                self._seen = len(st.batch_times)
                if self._in_effect():
                    self.observe(Measurement(batch_time=fmean(times), queue=fmean(queues)), st.batches)
        feeder.local_share = self.local_share()

    def _in_effect(self) -> bool:
        """Whether the last change has taken effect: a window in which started workers
        had not answered a task yet (Ray starts actors one after the other, and a ramp
        starts several at once) is not measured, for at most `hold_limit` windows per
        change that starts workers: a worker that never starts (no CPU for it) holds up
        one judgement, not every later window."""
        if not getattr(self.pool, "starting", 0):
            self._held = 0  # all answered: a replacement started later may be waited for again
            return True
        if self._held < self.hold_limit:
            self._held += 1
            return False
        return True

    def observe(self, m: Measurement, batch: int = 0) -> Change | None:
        change = self.policy.observe(m)
        if change is None:
            return None
        self.decisions.append(Decision(time.monotonic() - self._t0, batch, change))
        if change.remote_delta > 0:
            self._held = 0  # the workers it starts may be waited for
        self.pool.resize(change.remote)
        if self.set_local is not None and change.local_delta:
            self.set_local(change.local)
        return change

    def _spent(self) -> bool:
        """No remote worker left (draining ones included: a resume takes those back) and
        none may start: as final as a broken pool."""
        return bool(getattr(self.pool, "exhausted", False)) and not self.pool.workers

    def _fall_back(self) -> None:
        if self.fell_back:
            return
        self.fell_back = True
        if self.set_local is not None:
            self.set_local(max(self.local, self.fallback_local))

    def pause(self) -> None:
        """Stop the remote workers (their outputs would be keyed where the trainer does not
        look) and leave every item to the local ones; the policy keeps its state."""
        if self.paused:
            return
        self.paused = True
        self.pool.resize(0)
        self.pool.stop_draining()  # now: their queued tasks' outputs would not be read either
        if self.set_local is not None:
            self.set_local(max(self.local, self.fallback_local))

    def resume(self) -> None:
        """Back to the policy's counts; the windows measured while paused are not judged."""
        if not self.paused:
            return
        self.paused = False
        if self.fell_back:  # the cluster is gone: the local workers keep their fall-back count
            return
        self._held = 0
        self.pool.resize(self.remote)
        if self.set_local is not None:
            self.set_local(self.local)
