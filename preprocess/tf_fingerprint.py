"""Fingerprints of tf.data transform chains: the key under which autocache may keep
what a chain made of an item.

    from preprocess.tf_fingerprint import chain_fingerprint

    key = chain_fingerprint(lambda ds: ds.map(parse).map(resize))
    key.key        # "tf2.21.0/4df53e31df0d1c19": the same chain, the same key

The chain is applied to a fixed dummy source (one element of `element_spec`,
zeros; by default a scalar tf.string, an item) and TensorFlow's own
`tf.raw_ops.DatasetFingerprint` hashes the resulting dataset graph. Checked
(tests/test_tf_fingerprint.py) and relied on:

- stable across rebuilds and processes, and blind to names: Python function
  names, op `name=`s and `map(name=)` do not count;
- everything that shapes the graph counts: ops, constants (also captured numpy
  values), op-level random seeds, and also num_parallel_calls, deterministic,
  batch and prefetch sizes (the same transform with another parallelism gets
  another key: a cache miss, never a wrong hit).

What it cannot see, and how this module deals with it:

- `shuffle` seeds are ignored (seed=1 and seed=2 hash alike): harmless for
  per-item transforms, which is what keys are for; a chain that shuffles is no
  per-item transform anyway;
- the code inside tf.py_function / tf.numpy_function (only a process-local
  token is hashed, so two different Python functions can hash alike):
  refused with UnfingerprintableChain;
- the values of captured tf.Variables (only the handle is hashed): refused;
- stateful random ops (tf.random.uniform ...) hash by their seeds, but their
  output differs per call: the key says so (`random=True`) and a cache must
  not keep such outputs as if they were the transform's.

The TensorFlow version is part of the key: nothing promises the hash across versions.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import tensorflow as tf

PY_FUNC_OPS = frozenset({"PyFunc", "PyFuncStateless", "EagerPyFunc"})
VARIABLE_OPS = frozenset({"ReadVariableOp", "VarHandleOp", "ResourceGather", "VariableV2"})
RANDOM_OPS = frozenset({"RandomUniform", "RandomUniformInt", "RandomStandardNormal", "TruncatedNormal",
                        "RandomShuffle", "RandomGamma", "RandomPoisson", "RandomPoissonV2", "Multinomial",
                        "RandomCrop", "StatefulUniform", "StatefulUniformInt", "StatefulStandardNormalV2",
                        "StatefulTruncatedNormal", "StatefulUniformFullInt", "StatefulRandomBinomial"})


class UnfingerprintableChain(ValueError):
    """The chain holds something the fingerprint cannot see; the message names it."""


@dataclass(frozen=True)
class ChainKey:
    fingerprint: int   # tf.raw_ops.DatasetFingerprint of the chain over the dummy source
    tf_version: str
    random: bool       # the chain holds stateful random ops: its outputs differ per call

    @property
    def key(self) -> str:
        return f"tf{self.tf_version}/{self.fingerprint:016x}"


def dummy_source(element_spec: Any = None) -> "tf.data.Dataset":
    """One element of zeros of `element_spec` (default: a scalar tf.string)."""
    import tensorflow as tf

    spec = tf.TensorSpec([], tf.string) if element_spec is None else element_spec
    zeros = tf.nest.map_structure(lambda s: tf.zeros([d or 1 for d in s.shape], s.dtype), spec)
    return tf.data.Dataset.from_tensors(zeros)


def chain_fingerprint(chain: Callable[["tf.data.Dataset"], "tf.data.Dataset"],
                      element_spec: Any = None) -> ChainKey:
    """The key of `chain` (a function from a tf.data.Dataset of items to a dataset)."""
    import tensorflow as tf

    ds = chain(dummy_source(element_spec))
    if not isinstance(ds, tf.data.Dataset):
        raise TypeError(f"the chain must return a tf.data.Dataset, got {type(ds).__name__}")
    ops = set(_graph_ops(ds))
    if ops & PY_FUNC_OPS:
        raise UnfingerprintableChain(
            "the chain calls Python (tf.py_function / tf.numpy_function), whose code the fingerprint "
            "cannot see: write the transform in TF ops, or key it yourself")
    if ops & VARIABLE_OPS:
        raise UnfingerprintableChain(
            "the chain reads a tf.Variable, whose value the fingerprint cannot see: capture a "
            "constant (tf.constant or a numpy value) instead")
    fp = int(tf.raw_ops.DatasetFingerprint(input_dataset=ds._variant_tensor))
    return ChainKey(fingerprint=fp, tf_version=tf.__version__, random=bool(ops & RANDOM_OPS))


def _graph_ops(ds: "tf.data.Dataset") -> Iterator[str]:
    """Op types of the dataset's graph, those inside its functions included."""
    import tensorflow as tf

    graph = tf.compat.v1.GraphDef.FromString(ds._as_serialized_graph().numpy())
    for node in graph.node:
        yield node.op
    for fn in graph.library.function:
        for node in fn.node_def:
            yield node.op
