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
from preprocess.fingerprint import Uncacheable
from preprocess.stall import STEP_WARNING_S

from .cluster import ClusterUnavailable, connect, leave, resolve
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

    @property
    def key(self) -> str:
        """What the workers key the transformed items they put by (the trainer reads them
        with clients.transformed.TransformedItems(ring, job, dataset_tag, key, key_seed))."""
        return self.pool.spec.fingerprint

    @property
    def key_seed(self) -> int | None:
        return self.pool.spec.key_seed

    def refresh(self, ds: Any, pipeline: Any, job_seed: int, *, key: str | None = None,
                prefix: int | None = None, key_seed: int | None = None) -> None:
        """The pipeline changed (AutoOrder after the first epoch): a new spec version. Where
        the new order cannot be keyed, nothing the workers make would be read: they are
        stopped (one warning) and the local workers make every item until an order that
        can be keyed comes back."""
        old = self.pool.spec
        try:
            spec = make_spec(ds, pipeline, job_seed, old.version + 1, key=key, prefix=prefix, key_seed=key_seed,
                             step_warning=old.step_warning, step_timeout=old.step_timeout)
        except Uncacheable as e:
            if not self.controller.paused:
                warnings.warn(f"remote workers stopped: the reordered pipeline {pipeline!r} cannot be made "
                              f"remotely ({e}); local workers make every item", RuntimeWarning, stacklevel=3)
                self.controller.pause()
        else:
            if (spec.fingerprint, spec.prefix, spec.key_seed) != (old.fingerprint, old.prefix, old.key_seed):
                self.pool.set_spec(spec)
            self.controller.resume()
        self.feeder.local_share = self.controller.local_share()

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
          prefix: int | None = None, key_seed: int | None = None, step_warning: float | None = STEP_WARNING_S,
          step_timeout: float | None = None) -> RemoteWorkers | None:
    """Remote workers for a prepared pipeline. With a `placement` config (prices) or
    `set_local` (the local worker count), AutoPlacement sizes both kinds (the local
    count sets the share of each batch left to local workers); else Cachew's
    autoscaling sizes the remote ones. Where the dataset has a cache manager, the
    manager runs that policy (with its own configuration) and gives the Ray address
    for remote='auto'; else the job does.

    `key`, `prefix`, `key_seed`: what the transformed items the workers put are keyed by
    (spec.make_spec; the loader passes its autocache's). Without `key` it is derived from
    what makes the outputs differ (spec.default_key, the loader's autocache key): the
    prefix's steps, the dataset's `decode`, and the job's seed where those steps draw
    random numbers. So two jobs over the same files decoded otherwise, or seeded otherwise,
    do not share items; jobs whose items would be equal do. A dataset whose outputs are
    not a function of the item's content (WebDataset samples, a decode of the entry) gets
    no remote workers (one warning). `rw.key`, `rw.key_seed`: what the trainer reads by.
    `step_warning`, `step_timeout`: a step stuck on an item is logged by its worker, which
    ends itself past step_timeout (docs/preprocess.md, "Stuck steps")."""
    kind = "placement" if placement is not None or set_local is not None else "autoscale"
    if getattr(ds, "embedded", None) is not None or getattr(ds, "cache_spec", None) is None:
        raise ValueError("remote workers put their outputs into the cache ring: pass cache='host:port,...' "
                         "(servers they can reach) or a manager, not the embedded cache or cache=False")
    try:
        spec = make_spec(ds, pipeline, job_seed, 1, key=key, prefix=prefix, key_seed=key_seed,
                         step_warning=step_warning, step_timeout=step_timeout)
    except Uncacheable as e:
        warnings.warn(f"remote={remote!r}: nothing of the pipeline {pipeline!r} can run remotely: {e}; "
                      f"local workers only", RuntimeWarning, stacklevel=3)
        return None
    managed = ask(ds, kind)
    joined = _join(ds, remote, managed)
    if joined is None:
        return None
    ray, share = joined
    pool = None
    try:
        pool = RemotePool(ray, spec, cpus=cpus, share=share)
        policy: Autoscaler | Placement | ManagedPolicy = (
            ManagedPolicy(managed[0], ds.job, kind, managed[1]) if managed else
            Placement.start_with(placement) if kind == "placement" else Autoscaler.start(autoscale))
        feeder = Feeder(pool, window=window, task_items=task_items, wait_limit=wait_limit)  # checks before
        controller = Controller(pool, policy, set_local, every, fallback_local)          # workers start
        feeder.on_batch = controller
    except BaseException:  # a refused option (window=0, cpus=-1): no worker or connection stays behind
        if pool is not None:
            pool.close()
        else:
            leave(ray, share)
        raise
    feeder.local_share = controller.local_share()
    return RemoteWorkers(pool, feeder, controller)


def _join(ds: Any, remote: str, managed: Any) -> tuple[Any, int | None] | None:
    """(ray, this pool's share of the connection) of the cluster `remote` names (or the
    manager's, for 'auto'); None, with one warning, where there is none to reach."""
    address = resolve(remote, managed[1].ray_address if managed else None)
    if address is None:
        where = f"the cache manager {ds.manager} knows none (cachemanager --ray)" if managed else "no cache manager"
        warnings.warn(f"remote='auto': no Ray cluster to run remote workers on ({where}, and RAY_ADDRESS names no "
                      f"ray:// address); the job runs local workers only", RuntimeWarning, stacklevel=4)
        return None
    try:
        return connect(address)
    except ClusterUnavailable as e:
        warnings.warn(f"{e}; the job runs local workers only", RuntimeWarning, stacklevel=4)
        return None
