"""Remote preprocessing workers on Ray (docs/preprocess.md, "Remote workers").

The cache is the transport: remote workers read source items (the ring, else the
store), run the pipeline's cacheable prefix and put the results into the ring
under their transformed keys (clients/transformed.py); the trainer reads them as
hits. Only metadata crosses Ray: the job's spec, item indices, small reports.

    spec.py     what a worker needs (dataset copy, prefix, fingerprint)
    runner.py   a worker's work, without Ray
    cluster.py  joining the cluster as a Ray Client
    pool.py     the job's workers as Ray actors (start, drain, replace, break)
    feeder.py   keeps them a bounded window ahead of the trainer
    control.py  sizes remote and local workers with manager/policy
    workers.py  all of it together: start()
"""
from .cluster import ClusterUnavailable
from .workers import RemoteWorkers, start

__all__ = ["ClusterUnavailable", "RemoteWorkers", "start"]
