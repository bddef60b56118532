"""What the tf.data chain fingerprint cannot key: lookup tables (refused), random ops it
missed (flagged), elements out of order (not cached by tf_autocache)."""
import os

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
tf = pytest.importorskip("tensorflow", reason="TensorFlow is not installed (the 'tf' extra)")

from clients.tf_autocache import chain_key  # noqa: E402
from preprocess.tf_fingerprint import UnfingerprintableChain, chain_fingerprint  # noqa: E402


def _table(value):
    init = tf.lookup.KeyValueTensorInitializer(tf.constant([""]), tf.constant([value], tf.int64))
    return tf.lookup.StaticHashTable(init, -1)


def test_lookup_tables_are_refused(tmp_path):
    # two tables with other contents hashed alike: the same key, other outputs
    t1, t2 = _table(1), _table(2)
    for t in (t1, t2):
        with pytest.raises(UnfingerprintableChain, match="lookup table"):
            chain_fingerprint(lambda d, t=t: d.map(t.lookup))
    (tmp_path / "vocab.txt").write_text("a\nb\n")
    init = tf.lookup.TextFileInitializer(str(tmp_path / "vocab.txt"), tf.string, tf.lookup.TextFileIndex.WHOLE_LINE,
                                         tf.int64, tf.lookup.TextFileIndex.LINE_NUMBER)
    from_file = tf.lookup.StaticHashTable(init, -1)
    dense = tf.lookup.experimental.DenseHashTable(tf.string, tf.int64, -1, "", "x")  # only a Find op in the graph
    for t in (from_file, dense):
        with pytest.raises(UnfingerprintableChain, match="lookup table"):
            chain_fingerprint(lambda d, t=t: d.map(t.lookup))
    assert chain_key(lambda d: d.map(t1.lookup))[1].startswith("the chain uses a lookup table")


def _crop(x):
    img = tf.zeros([16, 16, 3], tf.uint8)
    begin, size, _ = tf.image.sample_distorted_bounding_box(tf.shape(img), tf.zeros([1, 0, 4]),
                                                             use_image_if_no_bounding_boxes=True)
    return tf.slice(img, begin, size)


@pytest.mark.parametrize("fn", [
    _crop,
    lambda x: tf.raw_ops.ParameterizedTruncatedNormal(shape=[2], means=0., stdevs=1., minvals=-1., maxvals=1.),
    lambda x: tf.random.gamma([2], 1.0),
], ids=["sample_distorted_bounding_box", "parameterized_truncated_normal", "gamma"])
def test_random_ops_are_flagged(fn):
    assert chain_fingerprint(lambda d: d.map(fn)).random
    key, why = chain_key(lambda d: d.map(fn))
    assert key == "" and "random" in why


def test_stateless_random_and_shuffle():
    assert not chain_fingerprint(lambda d: d.map(lambda x: tf.random.stateless_uniform([2], seed=[1, 2]))).random
    assert chain_fingerprint(lambda d: d.shuffle(4, seed=1)).random  # its n-th output is not the n-th item's


def _options(deterministic):
    o = tf.data.Options()
    o.deterministic = deterministic
    return o


def _length(x):
    return tf.strings.length(x)


@pytest.mark.parametrize("chain", [
    lambda d: d.map(_length, num_parallel_calls=4, deterministic=False),
    lambda d: d.interleave(tf.data.Dataset.from_tensors, num_parallel_calls=2, deterministic=False),
    lambda d: d.batch(2, num_parallel_calls=2, deterministic=False).unbatch(),
    lambda d: d.map(_length, num_parallel_calls=4).with_options(_options(False)),
], ids=["map", "interleave", "batch", "options"])
def test_out_of_order_chains_are_not_cached(chain):
    ck = chain_fingerprint(chain)
    assert not ck.ordered and ck.random
    key, why = chain_key(chain)
    assert key == "" and "out of order" in why


@pytest.mark.parametrize("chain", [
    lambda d: d.map(_length, num_parallel_calls=4),
    lambda d: d.map(_length, num_parallel_calls=4, deterministic=True),
    lambda d: d.map(_length, num_parallel_calls=4).with_options(_options(True)),
], ids=["default", "deterministic", "options"])
def test_ordered_parallel_chains_are_still_keyed(chain):
    ck = chain_fingerprint(chain)
    assert ck.ordered and not ck.random
    assert chain_key(chain)[0]
