"""tf_dataset autocache defects found in review, the PyTorch loader's fixed alike: real
cache servers and a real cachemanager on loopback, real TFRecords, real tf.data."""
import logging
import math
import os

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
tf = pytest.importorskip("tensorflow", reason="TensorFlow is not installed (the 'tf' extra)")

from clients import tf_dataset  # noqa: E402
from manager.manager_client import ManagerClient  # noqa: E402
from procs import manager_with_server  # noqa: E402
from test_review_tf_autocache import N, chain  # noqa: E402
from tfexamples import digested_shards, parse  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    digest, _, records = digested_shards(str(tmp_path_factory.mktemp("tfautodefects")), N)
    return digest, records


def test_a_fixed_transformed_chain_reports_its_pipeline_to_the_manager(shards, tmp_path, caplog):
    """Before: tf_dataset(transform=chain, autocache="transformed") never reported its
    pipeline (only "auto"'s decision did), so the manager knew no transformed set for the
    job: no pipeline in its status, GetPlan refused (a warning every epoch), no allocation,
    the job's gain uncounted. Now it reports after its first batch (the chain has run)."""
    digest, _ = shards
    caplog.set_level(logging.WARNING, logger="mlcache.autocache")
    with manager_with_server(str(tmp_path)) as (m, _):
        ds = tf_dataset(digest, manager=m.address, job="job-t", seed=1, read_batch=16, transform=chain,
                        autocache="transformed")
        try:
            ac = ds.mlcache.autocache
            assert len(list(ds.as_numpy_iterator())) == N
            with ManagerClient(m.address, timeout=2) as mc:
                st = mc.status_dict()
            assert [x["decision"]["fingerprint"] for x in st.get("pipelines", [])] == [ac.key]
            d = st["pipelines"][0]["decision"]
            assert d["jobs"] == ["job-t"] and d["tag"] == ac.transformed().tag
            assert d.get("fixed") == ["job-t"]  # counted on the set whatever the manager decides
            sets = {x["dataset"]: x for x in st["datasets"]}
            assert int(sets[d["tag"]]["allocated_bytes"]) > 0  # the set counts in allocation
            assert ac.costs is not None and ac.costs.cacheable and ac.costs.prefix_s > 0
            assert len(list(ds.as_numpy_iterator())) == N
            s2 = ds.mlcache.epoch_stats[-1]
            assert (s2.transformed["hits"], s2.transformed["misses"], s2.store_bytes) == (N, 0, 0), s2.line()
            assert ac.state == "fixed" and "fixed by the loader's autocache='transformed'" in ac.reason
            assert not [r for r in caplog.records if "could not be had" in r.getMessage()]
        finally:
            ds.mlcache.close()
        # a second job finds every item: the chain never ran in its epoch, it still reports (the
        # chain timed on sources read aside, counted in no epoch)
        ds = tf_dataset(digest, manager=m.address, job="job-u", seed=2, read_batch=16, transform=chain,
                        autocache="transformed")
        try:
            assert len(list(ds.as_numpy_iterator())) == N
            s1 = ds.mlcache.epoch_stats[-1]
            assert (s1.transformed["hits"], s1.store_bytes, s1.cache_bytes, s1.misses) == (N, 0, 0, 0), s1.line()
            assert ds.mlcache.autocache.costs.prefix_s > 0
            with ManagerClient(m.address, timeout=2) as mc:
                st = mc.status_dict()
            d = st["pipelines"][0]["decision"]
            assert sorted(d["jobs"]) == ["job-t", "job-u"] and sorted(d.get("fixed", [])) == ["job-t", "job-u"]
        finally:
            ds.mlcache.close()


def resume_state(digest, server, delivered: int, read_batch: int) -> dict:
    """A sampler state taken `delivered` items into epoch 0 of a seed-1 tf_dataset."""
    src = tf_dataset(digest, cache=server.address, seed=1, read_batch=read_batch, read_ahead=0)
    try:
        it = src.as_numpy_iterator()
        for _ in range(delivered):
            next(it)
        state = src.mlcache.sampler.state_dict()
        assert (state["epoch"], state["items_delivered"]) == (0, delivered)
        return state
    finally:
        src.mlcache.close()


def test_auto_chain_decides_at_the_end_of_a_resumed_epoch(shards, server):
    """Before: "auto" decided only once `threshold` items were measured (64 here, a batch);
    a resumed epoch holding only its rest (32 items) ended still measuring, and the next
    epochs went on measuring (every output put speculatively). Now its end decides."""
    digest, _ = shards
    state = resume_state(digest, server, N - 32, 64)
    ds = tf_dataset(digest, cache=server.address, seed=1, read_batch=64, transform=chain, autocache="auto",
                    epochs=3, state={"sampler": state})
    try:
        assert len(list(ds.as_numpy_iterator())) == 32
        ac = ds.mlcache.autocache
        assert ac.state == "decided" and ac.mode in ("compute", "source", "transformed"), ac.line()
        assert "the epoch ended with 32 items measured, fewer than the 64 wanted" in ac.reason
        assert ac.costs.items == N and ac.costs.prefix_s > 0
        assert f"autocache {ac.mode} (decided)" in ds.mlcache.epoch_stats[-1].line()
        assert len(list(ds.as_numpy_iterator())) == N and ac.state == "decided"
    finally:
        ds.mlcache.close()


def test_auto_map_fn_decides_at_the_end_of_a_resumed_epoch(shards, server, monkeypatch):
    """The same with map_fn= (the scheduler's path): tf_transform.batches never called
    Autocache.epoch_ended, so a resumed epoch shorter than the threshold kept measuring."""
    import manager.policy.autocache as policy

    monkeypatch.setattr(policy, "CLEAR", math.inf)  # measured, not decided on the estimate
    digest, _ = shards
    state = resume_state(digest, server, N - 32, 64)
    ds = tf_dataset(digest, cache=server.address, seed=1, read_batch=64, map_fn=parse, num_workers=0,
                    cost_dir=False, on_error="skip", autocache="auto", epochs=3)  # skip: no cardinality
    try:
        ac = ds.mlcache.autocache
        assert ac.state == "measuring", ac.line()
        ds.mlcache.sampler.load_state_dict(state)
        assert len(list(ds.as_numpy_iterator())) == 32
        assert ac.state == "decided" and ac.mode in ("compute", "source", "transformed"), ac.line()
        assert "fewer than the 64 wanted" in ac.reason and not ac.shared.keep()
    finally:
        ds.mlcache.close()
