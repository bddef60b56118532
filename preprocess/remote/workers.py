"""A job's remote preprocessing, put together: the Ray workers (pool.py), the
feeder that keeps them ahead of the trainer (feeder.py) and the controller that
sizes them (control.py). `start()` answers None, with one warning, where there
is nothing to run remotely (no cacheable prefix) or no cluster to run it on:
the job then runs local workers only."""
from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from manager.policy.autoscale import AutoscaleConfig, Autoscaler
from manager.policy.placement import Placement, PlacementConfig

from .cluster import ClusterUnavailable, connect, resolve
from .control import Controller
from .feeder import Feeder
from .managed import ManagedPolicy, ask
from .pool import RemotePool
from .spec import make_spec


class RemoteWorkers:
    def __init__(self, pool: RemotePool, feeder: Feeder, controller: Controller) -> None:
        self.pool, self.feeder, self.controller = pool, feeder, controller

    def batches(self, source: Iterable[list[int]], epoch: int) -> Iterator[list[int]]:
        return self.feeder.batches(source, epoch)

    def refresh(self, ds: Any, pipeline: Any, job_seed: int, *, key: str | None = None,
                prefix: int | None = None, key_seed: int | None = None) -> None:
        """The pipeline changed (AutoOrder after the first epoch): a new spec version."""
        spec = make_spec(ds, pipeline, job_seed, self.pool.spec.version + 1, key=key, prefix=prefix,
                         key_seed=key_seed)
        old = self.pool.spec
        if spec is not None and (spec.fingerprint, spec.prefix, spec.key_seed) != (old.fingerprint, old.prefix,
                                                                                   old.key_seed):
            self.pool.set_spec(spec)

    def summary(self) -> dict[str, Any]:
        c, st = self.pool.counts, self.feeder.stats
        return {"remote": self.pool.size, "local": self.controller.local, "broken": self.pool.broken,
                "made": c.made, "present": c.present, "failed": c.failed, "lost": c.lost, "deaths": c.deaths,
                "remote_items": st.remote_items, "local_items": st.local_items, "timed_out": st.timed_out,
                "decisions": [d.change.reason for d in self.controller.decisions]}

    def close(self) -> None:
        self.pool.close()


def start(ds: Any, pipeline: Any, job_seed: int, remote: str, *, placement: PlacementConfig | None = None,
          autoscale: AutoscaleConfig | None = None, set_local: Callable[[int], None] | None = None,
          window: int = 4, task_items: int = 8, wait_limit: float = 10.0, every: int = 20,
          cpus: float = 1.0, fallback_local: int = 1, key: str | None = None,
          prefix: int | None = None, key_seed: int | None = None) -> RemoteWorkers | None:
    """Remote workers for a prepared pipeline. With a `placement` config (prices) or
    `set_local` (the local worker count), AutoPlacement sizes both kinds (the local
    count sets the share of each batch left to local workers); else Cachew's
    autoscaling sizes the remote ones. Where the dataset has a cache manager, the
    manager runs that policy (with its own configuration) and gives the Ray address
    for remote='auto'; else the job does. `key`/`prefix`: see spec.make_spec."""
    kind = "placement" if placement is not None or set_local is not None else "autoscale"
    if getattr(ds, "embedded", None) is not None or getattr(ds, "cache_spec", None) is None:
        raise ValueError("remote workers put their outputs into the cache ring: pass cache='host:port,...' "
                         "(servers they can reach) or a manager, not the embedded cache or cache=False")
    spec = make_spec(ds, pipeline, job_seed, 1, key=key, prefix=prefix, key_seed=key_seed)
    if spec is None:
        warnings.warn(f"remote={remote!r}: the pipeline {pipeline!r} has no cacheable prefix (its first step is "
                      f"random, or it cannot be fingerprinted): nothing to run remotely; local workers only",
                      RuntimeWarning, stacklevel=3)
        return None
    managed = ask(ds, kind)
    address = resolve(remote, managed[1].ray_address if managed else None)
    if address is None:
        where = f"the cache manager {ds.manager} knows none (cachemanager --ray)" if managed else "no cache manager"
        warnings.warn(f"remote='auto': no Ray cluster to run remote workers on ({where}, and RAY_ADDRESS names no "
                      f"ray:// address); the job runs local workers only", RuntimeWarning, stacklevel=3)
        return None
    try:
        ray, owned = connect(address)
    except ClusterUnavailable as e:
        warnings.warn(f"{e}; the job runs local workers only", RuntimeWarning, stacklevel=3)
        return None
    pool = RemotePool(ray, spec, cpus=cpus, owns_connection=owned)
    policy: Autoscaler | Placement | ManagedPolicy = (
        ManagedPolicy(managed[0], ds.job, kind, managed[1]) if managed else
        Placement.start_with(placement) if kind == "placement" else Autoscaler.start(autoscale))
    controller = Controller(pool, policy, set_local, every, fallback_local)
    feeder = Feeder(pool, window=window, task_items=task_items, wait_limit=wait_limit, on_batch=controller)
    feeder.local_share = controller.local_share()
    return RemoteWorkers(pool, feeder, controller)
