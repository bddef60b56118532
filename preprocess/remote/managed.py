"""A job's worker-scaling policy run by the cache manager (ScaleWorkers; manager/workers.py).

To the controller it looks like the policies it runs itself (observe, remote,
local): each window's measurement goes to the manager, whose answer is the counts
to run. While the manager cannot be reached or refuses, the counts stay as they
are (one warning), as the loader keeps its last chunk plan; the next window asks
again."""
from __future__ import annotations

import warnings
from typing import Any

from manager.manager_client import ManagerError, WorkerCounts
from manager.policy.scaling import Change, Measurement


class ManagedPolicy:
    def __init__(self, client: Any, job: str, policy: str, first: WorkerCounts) -> None:
        self.client, self.job, self.policy = client, job, policy
        self.remote, self.local, self.phase = first.remote, first.local, first.phase
        self.warned = False

    def observe(self, m: Measurement) -> Change | None:
        """The manager's counts for this window; None (counts as they are) where they did
        not change, the manager does not answer, or the dataset closed its client."""
        if self.client.closed:  # the dataset closed: its pools are closing with it
            return None
        try:
            r = self.client.scale_workers(self.job, self.policy, m, self.remote, self.local)
        except ValueError:  # gRPC's "Cannot invoke RPC on closed channel!": closed under the call
            if not self.client.closed:
                raise
            return None
        except ManagerError as e:
            if not self.warned:
                self.warned = True
                warnings.warn(f"{e}; remote workers keep their counts ({self.remote} remote, {self.local} local) "
                              f"until the manager answers", RuntimeWarning, stacklevel=2)
            return None
        self.phase = r.phase
        if (r.remote, r.local) == (self.remote, self.local):
            return None
        change = Change(r.remote - self.remote, r.local - self.local, r.remote, r.local,
                        r.reason or "the manager's counts")
        self.remote, self.local = r.remote, r.local
        return change


def ask(ds: Any, policy: str) -> tuple[Any, WorkerCounts] | None:
    """(the manager's client, its first answer) where the dataset has a cache manager
    that answers; None without one. One warning where it does not answer: the job
    then decides alone."""
    coordinator = getattr(ds, "coordinator", None)
    if coordinator is None:
        return None
    try:
        return coordinator.client, coordinator.client.scale_workers(ds.job, policy)
    except ManagerError as e:
        warnings.warn(f"{e}; the job sizes its remote workers itself", RuntimeWarning, stacklevel=3)
        return None
