"""tf_dataset(transform=..., autocache=...) against the PyTorch loader's autocache, with
real cache servers (and a real cachemanager): the manager's plan of the transformed set,
and what the epoch's statistics count."""
import os
import time

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
tf = pytest.importorskip("tensorflow", reason="TensorFlow is not installed (the 'tf' extra)")

from cacheserver.vocab import transformed_tag  # noqa: E402
from clients import tf_dataset  # noqa: E402
from clients.procstate import DatasetClosed  # noqa: E402
from clients.tf_autocache import chain_key  # noqa: E402
from manager.manager_client import ManagerClient  # noqa: E402
from procs import manager_with_server  # noqa: E402
from test_policy_autocache import costs  # noqa: E402
from tfexamples import digested_shards, parse  # noqa: E402

pytestmark = pytest.mark.timeout(300)
N = 160


def chain(ds):
    return ds.map(parse)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    digest, _, records = digested_shards(str(tmp_path_factory.mktemp("tfreview")), N)
    return digest, records


def test_transformed_follows_the_managers_plan_of_its_set(shards, tmp_path):
    """The manager allocated the transformed set no room of its own (a "none" plan with
    spare entries): its items go in as spare entries, which the manager's reconcile
    leaves alone. tf_dataset never fetched the set's plan (only an "auto" decision did,
    once; the PyTorch loader does before every epoch), so it put them as chunk 0 of a set
    with no chunks, the reconcile evicted them, and no epoch ever hit."""
    digest, records = shards
    with manager_with_server(str(tmp_path)) as (m, _):
        ds = tf_dataset(digest, manager=m.address, job="job-a", seed=1, read_batch=16, transform=chain,
                        autocache="transformed")
        try:
            src = ds.mlcache
            dataset, (key, _) = src.cached.dataset_tag, chain_key(chain)
            # another job of the same pipeline reported it: the manager decided and planned the set
            with ManagerClient(m.address, timeout=2) as mc:
                mc.register_job("job-b", dataset, sum(len(r) for r in records), N)
                assert mc.report_pipeline("job-b", dataset, key, costs(items=N, prefix_s=0.05)).mode == "transformed"
            plan = src.cached.coordinator.client.get_plan(transformed_tag(dataset, key), "job-a")
            assert (plan.option, plan.spare) == ("none", True)
            assert len(list(ds.as_numpy_iterator())) == N
            assert src.epoch_stats[-1].transformed["puts"] == N
            time.sleep(1.5)  # several of the manager's reconcile rounds (0.2 s)
            assert len(list(ds.as_numpy_iterator())) == N
            st = src.epoch_stats[-1]
            assert (st.transformed["hits"], st.transformed["misses"]) == (N, 0), st.line()
        finally:
            ds.mlcache.close()


def test_auto_decision_reads_count_in_no_epoch(shards, server):
    """"auto" decides mid-epoch in tf_dataset: the sample items it times were read once
    by the epoch, and with insert=False (or a plan that keeps them out of the cache) they
    are not cached: the decision's reads fetched them from the store again, counted in the
    epoch as misses and store bytes (176 misses in an epoch of 160 items)."""
    digest, records = shards
    ds = tf_dataset(digest, cache=server.address, insert=False, seed=1, read_batch=16, transform=chain,
                    autocache="auto", epochs=3)
    try:
        assert len(list(ds.as_numpy_iterator())) == N
        st = ds.mlcache.epoch_stats[-1]
        assert ds.mlcache.autocache.state == "decided"
        assert (st.items, st.misses, st.hits, st.inserted) == (N, N, 0, 0), st.line()
        assert st.store_bytes == sum(len(r) for r in records)
    finally:
        ds.mlcache.close()


def test_an_epoch_resumed_after_close_says_the_dataset_closed(shards, tmp_path, caplog):
    """Fixed at transformed under a manager, the pipeline is reported after the first batch:
    an epoch paused there (tf.data's generator) and resumed after close() went on to time
    the chain for the report (a warning that the timing failed) before DatasetClosed."""
    digest, _ = shards
    with manager_with_server(str(tmp_path)) as (m, _):
        ds = tf_dataset(digest, manager=m.address, job="job-closed", seed=1, read_batch=16, transform=chain,
                        autocache="transformed")
        src = ds.mlcache
        try:
            epoch = src.starter.start()
            assert len([next(epoch) for _ in range(16)]) == 16   # the first batch, paused before its report
        finally:
            src.close()
        with pytest.raises(DatasetClosed, match="closed"):
            next(epoch)
        assert "timing the chain" not in caplog.text
