"""tf_dataset(transform=..., autocache=...): real TFRecords, a real cache server, real tf.data."""
import os
from collections import Counter

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
tf = pytest.importorskip("tensorflow", reason="TensorFlow is not installed (the 'tf' extra)")

from clients import tf_dataset  # noqa: E402
from clients.digest_tool import main as digest_main  # noqa: E402
from tfexamples import parse, write_shards  # noqa: E402

pytestmark = pytest.mark.timeout(300)
N = 160


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("tfauto")
    paths, records = write_shards(str(root / "data"), N, shards=2)
    digest = str(root / "train.dig")
    assert digest_main([str(root / "data"), "-o", digest, "-f", "tfrecord", "-q"]) == 0
    return digest, paths


def chain(ds):
    return ds.map(parse)


def chain_plus_one(ds):
    return ds.map(parse).map(lambda d: {**d, "label": d["label"] + 1})


def chain_random(ds):
    return ds.map(parse).map(lambda d: {**d, "x": d["x"] + tf.random.uniform([4])})


def canon(elements):
    return Counter((bytes(e["image"]), int(e["label"]), tuple(float(v) for v in e["x"])) for e in elements)


def test_tf_transformed_items_hit_in_epoch_two(shards, server):
    digest, paths = shards
    reference = canon(chain(tf.data.TFRecordDataset(paths)).as_numpy_iterator())
    ds = tf_dataset(digest, cache=server.address, seed=1, transform=chain, autocache="transformed")
    try:
        assert ds.element_spec == chain(tf.data.TFRecordDataset(paths)).element_spec
        assert int(ds.cardinality()) == N
        e1 = canon(ds.as_numpy_iterator())
        s1 = ds.mlcache.epoch_stats[-1]
        assert (s1.transformed["misses"], s1.transformed["puts"], s1.inserted) == (N, N, 0)
        e2 = canon(ds.as_numpy_iterator())
        s2 = ds.mlcache.epoch_stats[-1]
        assert (s2.transformed["hits"], s2.transformed["misses"]) == (N, 0)
        assert s2.store_bytes == 0 and s2.cache_bytes == 0 and s2.misses == 0  # no source read in epoch 2
        assert e1 == e2 == reference  # every item once, as TensorFlow computes it
        assert "autocache transformed (fixed)" in s2.line()
    finally:
        ds.mlcache.close()
    # a changed transform misses; the same one, in another job, hits
    for transform, hits in ((chain_plus_one, 0), (chain, N)):
        other = tf_dataset(digest, cache=server.address, seed=2, transform=transform, autocache="transformed")
        try:
            got = list(other.as_numpy_iterator())
            assert len(got) == N and other.mlcache.epoch_stats[-1].transformed["hits"] == hits
        finally:
            other.mlcache.close()


def test_tf_compute_source_and_refusals(shards, server):
    digest, paths = shards
    reference = canon(chain(tf.data.TFRecordDataset(paths)).as_numpy_iterator())
    comp = tf_dataset(digest, cache=server.address, seed=1, transform=chain, autocache="compute")
    src = tf_dataset(digest, cache=server.address, seed=1, transform=chain)  # source: the chain in TF
    try:
        for _ in range(2):
            assert canon(comp.as_numpy_iterator()) == reference
            st = comp.mlcache.epoch_stats[-1]
            assert (st.hits, st.inserted, st.transformed["puts"]) == (0, 0, 0) and st.store_bytes > 0
        assert canon(src.as_numpy_iterator()) == reference
    finally:
        comp.mlcache.close()
        src.mlcache.close()
    with pytest.raises(ValueError, match="random"):
        tf_dataset(digest, cache=server.address, transform=chain_random, autocache="transformed")
    with pytest.raises(ValueError, match="need a transform"):
        tf_dataset(digest, cache=server.address, autocache="transformed")


def test_tf_auto_decides_and_reports(shards, server):
    digest, paths = shards
    ds = tf_dataset(digest, cache=server.address, seed=1, read_batch=16, transform=chain, autocache="auto",
                    epochs=3)
    try:
        assert ds.mlcache.autocache.state == "measuring"
        e1 = canon(ds.as_numpy_iterator())
        ac = ds.mlcache.autocache
        assert ac.state == "decided" and ac.mode in ("compute", "source", "transformed")
        assert ac.costs.cacheable and ac.costs.prefix_s > 0 and ac.costs.items == N and ac.costs.epochs_left == 2
        assert f"autocache {ac.mode} (decided)" in ds.mlcache.epoch_stats[-1].line()
        assert canon(ds.as_numpy_iterator()) == e1
    finally:
        ds.mlcache.close()


@pytest.mark.parametrize("mode", ["source", "transformed", "compute", "auto"])
def test_a_per_item_function_as_transform_says_what_transform_is(shards, tmp_path, mode):
    """transform=parse (a function of one item, not of the dataset) is refused with the
    same message in every mode; the modes other than source passed TensorFlow's own
    'Attempt to convert a value (<_TensorDataset ...>) ... to a Tensor'."""
    digest, _ = shards
    with pytest.raises(TypeError, match=r"transform= is a function of a tf\.data\.Dataset of items.*map_fn="):
        tf_dataset(digest, cache_dir=str(tmp_path / "emb"), capacity="64MB", transform=parse, autocache=mode)
