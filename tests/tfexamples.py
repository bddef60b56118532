"""TFRecord shards of tf.train.Example records, for the tf.data tests and tools/bench/tfdata.

Each record holds `image` (random bytes of lo..hi bytes, like an encoded image),
`x` (4 floats that a tiny model can learn `label` from) and `label` (0..9)."""
from __future__ import annotations

import os
import random


def example_bytes(rng: random.Random, label: int, lo: int, hi: int) -> bytes:
    import tensorflow as tf

    x = [float(label == k) + 0.1 * rng.random() for k in range(4)]
    feature = {
        "image": tf.train.Feature(bytes_list=tf.train.BytesList(value=[rng.randbytes(rng.randint(lo, hi))])),
        "x": tf.train.Feature(float_list=tf.train.FloatList(value=x)),
        "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[label])),
    }
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


def write_shards(root: str, n: int, shards: int = 4, lo: int = 200, hi: int = 2000, seed: int = 0,
                 compression: str | None = None) -> tuple[list[str], list[bytes]]:
    """n records over `shards` files under root (written with TensorFlow's own writer);
    returns (file paths in order, records in file order)."""
    import tensorflow as tf

    os.makedirs(root, exist_ok=True)
    rng = random.Random(seed)
    paths, records = [], []
    per = -(-n // shards)
    for s in range(shards):
        path = os.path.join(root, f"train-{s:05d}-of-{shards:05d}.tfrecord")
        with tf.io.TFRecordWriter(path, options=compression) as w:
            for i in range(s * per, min(n, (s + 1) * per)):
                rec = example_bytes(rng, i % 4, lo, hi)
                w.write(rec)
                records.append(rec)
        paths.append(path)
    return paths, records


def parse(record):
    """The map both sides of the tf.data tests and benchmark apply."""
    import tensorflow as tf

    features = {"image": tf.io.FixedLenFeature([], tf.string),
                "x": tf.io.FixedLenFeature([4], tf.float32),
                "label": tf.io.FixedLenFeature([], tf.int64)}
    return tf.io.parse_single_example(record, features)


def digested_shards(root: str, n: int, shards: int = 3) -> tuple[str, list[str], list[bytes]]:
    """n records in TFRecord files under root/data, digested (--format tfrecord):
    (digest path, TFRecord paths, records in file order)."""
    from clients.digest_tool import main as digest_main

    paths, records = write_shards(os.path.join(root, "data"), n, shards=shards)
    digest = os.path.join(root, "train.dig")
    if digest_main([os.path.join(root, "data"), "-o", digest, "-f", "tfrecord", "-q"]) != 0:
        raise RuntimeError(f"tools/digest failed on {root}/data")
    return digest, paths, records
