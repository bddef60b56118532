"""tf_dataset review (s29): resuming an epoch from a saved state, and autocache "auto" of a
transform chain finding another job's transformed items. Real cacheserver processes (and a
real cachemanager), real TFRecords, real tf.data."""
import os
import time
from collections import Counter

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
tf = pytest.importorskip("tensorflow", reason="TensorFlow is not installed (the 'tf' extra)")

from clients import tf_dataset  # noqa: E402
from manager.manager_client import ManagerClient  # noqa: E402
from procs import manager_with_server  # noqa: E402
from test_review_tf_autocache import N, chain  # noqa: E402
from tfexamples import digested_shards, parse  # noqa: E402

pytestmark = pytest.mark.timeout(300)
CUT = 48  # items handed over before the state is saved: 3 batches of 16
# tf_dataset arguments of each path: Feed, Starter (autocache chain, map_fn). Not TicketFeed
# (read_parallel): its parallel reads run ahead of the loop, and the state counts them (see the report)
KINDS = {
    "plain": {},
    "chain": {"transform": chain, "autocache": "transformed"},
    "map_fn": {"map_fn": parse, "num_workers": 0, "cost_dir": False},
}


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    digest, _, records = digested_shards(str(tmp_path_factory.mktemp("tfs29")), N)
    return digest, records


def ident(x) -> bytes:
    """An element's record identity: the bytes (plain) or the parsed image bytes."""
    return bytes(x["image"]) if isinstance(x, dict) else bytes(x)


def make(digest, server, kind: str, **kw):
    return tf_dataset(digest, cache=server.address, seed=1, read_batch=16, read_ahead=0, **KINDS[kind], **kw)


def saved_state(digest, server, kind: str) -> tuple[dict, list[bytes]]:
    """A state saved CUT items into epoch 0, and those items."""
    ds = make(digest, server, kind)
    try:
        it = ds.as_numpy_iterator()
        first = [ident(next(it)) for _ in range(CUT)]
        time.sleep(0.3)  # time for a read ahead (tf.data's injected prefetch counted a 4th batch)
        state = {"sampler": ds.mlcache.sampler.state_dict()}  # as TFSource.state_dict() has it
        assert (state["sampler"]["epoch"], state["sampler"]["items_delivered"]) == (0, CUT)
        return state, first
    finally:
        ds.mlcache.close()


def reference(kind: str, records: list[bytes]) -> Counter:
    """Every item of the dataset once, as `ident` names its element of this kind."""
    if kind == "plain":
        return Counter(records)
    return Counter(bytes(parse(r)["image"].numpy()) for r in records)


@pytest.mark.parametrize("kind", list(KINDS))
def test_state_resumes_the_rest_of_the_epoch_once(shards, server, kind):
    """Before: a resumed epoch (the sampler's load_state_dict, the only resume there was)
    yielded its rest, then failed TensorFlow's cardinality check (the dataset declared a whole
    epoch). Now tf_dataset(state=) resumes: its first pass is the rest, every item exactly
    once across the cut, later passes whole epochs."""
    digest, records = shards
    state, first = saved_state(digest, server, kind)
    ds = make(digest, server, kind, state=state)
    try:
        assert int(ds.cardinality()) == tf.data.UNKNOWN_CARDINALITY  # passes differ: none declared
        assert ds.mlcache.state_dict() == state  # loaded, not yet run
        rest = [ident(x) for x in ds.as_numpy_iterator()]
        assert len(rest) == N - CUT
        everything = reference(kind, records)
        assert Counter(first + rest) == everything and len(everything) == N  # each once across the cut
        st = ds.mlcache.epoch_stats[-1]
        assert (st.epoch, st.items, st.complete) == (0, N - CUT, True), st.line()
        again = [ident(x) for x in ds.as_numpy_iterator()]
        assert Counter(again) == everything
        assert ds.mlcache.epoch_stats[-1].epoch == 1
    finally:
        ds.mlcache.close()


@pytest.mark.parametrize("kind", ["plain", "chain"])
def test_a_mid_epoch_state_loaded_into_a_made_dataset_is_refused_before_reading(shards, server, kind):
    """Before: the state loaded into a dataset made without it (ds.mlcache.sampler's
    load_state_dict) ran the rest, which the training loop took, then failed at the end
    ("expected to contain 160 elements but contained only 112"), saying nothing of why. Now
    the pass is refused at its start, naming tf_dataset(..., state=); TFSource.load_state_dict
    refuses such a state at once and leaves the sampler as it was."""
    digest, _ = shards
    state, _ = saved_state(digest, server, kind)
    ds = make(digest, server, kind)
    try:
        assert int(ds.cardinality()) == N
        ds.mlcache.sampler.load_state_dict(state["sampler"])
        got = []
        with pytest.raises(tf.errors.InvalidArgumentError, match=r"pass the state when making the dataset"):
            for x in ds.as_numpy_iterator():
                got.append(x)
        assert got == [] and ds.mlcache.epoch_stats == []  # nothing read, no epoch recorded
        ds.mlcache.sampler.load_state_dict({**state["sampler"], "epoch": 0, "delivered": b""})  # a fresh epoch 0
        with pytest.raises(ValueError, match=r"tf_dataset\(\.\.\., state=state\)"):
            ds.mlcache.load_state_dict(state)
        assert ds.mlcache.state_dict()["sampler"]["items_delivered"] == 0  # left as it was
        done = make(digest, server, kind)  # a state saved at an epoch's end starts the next whole
        try:
            assert len(list(done.as_numpy_iterator())) == N
            boundary = done.mlcache.state_dict()
        finally:
            done.mlcache.close()
        ds.mlcache.load_state_dict(boundary)
        assert len(list(ds.as_numpy_iterator())) == N and ds.mlcache.epoch_stats[-1].epoch == 1
    finally:
        ds.mlcache.close()


def test_bad_state_is_refused_naming_what_it_takes(shards, server):
    digest, _ = shards
    with pytest.raises(ValueError, match=r"a dict with 'sampler'\), got a dict with keys \['epoch'\]"):
        make(digest, server, "plain", state={"epoch": 0})
    state, _ = saved_state(digest, server, "plain")
    state["sampler"]["n_items"] = N + 1
    with pytest.raises(ValueError, match=rf"the loader state was saved with n_items {N + 1} \(this loader: {N}\)"):
        make(digest, server, "plain", state=state)


def test_auto_chain_finds_the_transformed_items_another_job_cached(shards, server):
    """Before: tf_dataset(transform=chain, autocache="auto") never looked whether the
    chain's outputs were cached already (the PyTorch loader's Autocache does, state
    "found"): it measured its first epoch as source, reading every source item from the
    store and running the chain on it, although another job had kept every output. Now
    it finds them and reads them as transformed hits from its first item."""
    digest, records = shards
    first = make(digest, server, "chain")  # another job keeps every output
    try:
        reference = Counter(ident(x) for x in first.as_numpy_iterator())
        assert first.mlcache.epoch_stats[-1].transformed["puts"] == N
    finally:
        first.mlcache.close()
    ds = tf_dataset(digest, cache=server.address, seed=2, read_batch=16, transform=chain, autocache="auto",
                    epochs=3)
    try:
        ac = ds.mlcache.autocache
        assert (ac.mode, ac.state) == ("transformed", "found"), ac.line()
        assert Counter(ident(x) for x in ds.as_numpy_iterator()) == reference
        st = ds.mlcache.epoch_stats[-1]
        assert (st.transformed["hits"], st.transformed["misses"], st.store_bytes, st.cache_bytes) == (N, 0, 0, 0), \
            st.line()
        assert "autocache transformed (found)" in st.line()
    finally:
        ds.mlcache.close()
    other = tf_dataset(digest, cache=server.address, seed=2, read_batch=16, autocache="auto", epochs=3,
                       transform=lambda d: d.map(parse).map(lambda e: {**e, "label": e["label"] + 1}))
    try:  # another chain's outputs are not cached: measured as before
        assert other.mlcache.autocache.state == "measuring"
    finally:
        other.mlcache.close()


def test_a_found_chain_reports_to_the_manager(shards, tmp_path):
    """Found under a manager, the pipeline is reported all the same (as the PyTorch
    loader's Autocache._report_found): the manager counts the job on the transformed set
    it reads (else the set would go idle and be dropped under it); its plan is followed."""
    digest, _ = shards
    with manager_with_server(str(tmp_path)) as (m, _):
        first = tf_dataset(digest, manager=m.address, job="job-a", seed=1, read_batch=16, transform=chain,
                           autocache="transformed")
        try:
            assert len(list(first.as_numpy_iterator())) == N
        finally:
            first.mlcache.close()
        ds = tf_dataset(digest, manager=m.address, job="job-b", seed=2, read_batch=16, transform=chain,
                        autocache="auto", epochs=3)
        try:
            ac = ds.mlcache.autocache
            assert ac.state == "found", ac.line()
            assert len(list(ds.as_numpy_iterator())) == N
            with ManagerClient(m.address, timeout=2) as mc:
                st = mc.status_dict()
            d = st["pipelines"][0]["decision"]
            assert sorted(d["jobs"]) == ["job-a", "job-b"] and d["fingerprint"] == ac.key
            assert ac.mode == d["mode"] and ac.costs is not None and ac.costs.prefix_s > 0, ac.line()
            s1 = ds.mlcache.epoch_stats[-1]
            if ac.mode == "transformed":
                assert (s1.transformed["hits"], s1.store_bytes) == (N, 0), s1.line()
        finally:
            ds.mlcache.close()
