"""Review: the manager-run worker-scaling policy after its dataset closed. The remote
workers' controller may measure one more window while close() runs in another thread;
the closed manager client then answers with gRPC's bare ValueError, which reached the
controller's caller. Real cachemanager and cacheserver processes on loopback."""
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(__file__))

from clients.dataset import CachedDataset  # noqa: E402
from manager.policy.scaling import Measurement  # noqa: E402
from preprocess.remote.managed import ManagedPolicy, ask  # noqa: E402
from procs import manager_with_server  # noqa: E402
from test_preprocess_loader import indexed_items  # noqa: E402


def test_observe_after_the_dataset_closed_keeps_the_counts_quietly(tmp_path):
    with manager_with_server(str(tmp_path)) as (m, _):
        ds = CachedDataset(indexed_items(tmp_path / "ds", 8), manager=m.address, job="managed-closed")
        try:
            client, first = ask(ds, "autoscale")
            policy = ManagedPolicy(client, ds.job, "autoscale", first)
            policy.observe(Measurement(batch_time=0.1, queue=0.0))   # the manager answers while open
            counts = (policy.remote, policy.local)
        finally:
            ds.close()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert policy.observe(Measurement(batch_time=0.1, queue=0.0)) is None
        assert (policy.remote, policy.local) == counts
