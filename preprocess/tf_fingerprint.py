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
- the contents of lookup tables (tf.lookup.StaticHashTable, StringLookup ...:
  two tables with other contents hash alike, and an initialiser may read a
  file): refused;
- stateful random ops (tf.random.uniform, sample_distorted_bounding_box,
  shuffle ...) hash by their seeds, but their output differs per call: the key
  says so (`random=True`) and a cache must not keep such outputs as if they
  were the transform's;
- elements that may come out of order (deterministic=False, a sloppy
  interleave, Options.deterministic=False): counted, but the n-th output is no
  longer the n-th item's, so the key says so (`ordered=False`, and `random`).

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
# stateful ops whose output differs per call (stateless ones are fixed by their seed inputs: fine)
RANDOM_OPS = frozenset({
    "RandomUniform", "RandomUniformInt", "RandomStandardNormal", "TruncatedNormal", "ParameterizedTruncatedNormal",
    "RandomShuffle", "RandomGamma", "RandomPoisson", "RandomPoissonV2", "Multinomial", "RandomCrop",
    "SampleDistortedBoundingBox", "SampleDistortedBoundingBoxV2",  # tf.image.sample_distorted_bounding_box
    "StatefulUniform", "StatefulUniformInt", "StatefulUniformFullInt", "StatefulStandardNormal",
    "StatefulStandardNormalV2", "StatefulTruncatedNormal", "StatefulRandomBinomial",
    "RngReadAndSkip", "RngSkip",  # tf.random.Generator: seeds stateless ops from its advancing state
    "AllCandidateSampler", "FixedUnigramCandidateSampler", "LearnedUnigramCandidateSampler",
    "LogUniformCandidateSampler", "ThreadUnsafeUnigramCandidateSampler", "UniformCandidateSampler",
    "RandomShuffleQueue", "RandomShuffleQueueV2",
    # datasets drawing random numbers: Dataset.random(), shuffle (another order per run, even seeded
    # the n-th output is not the n-th item's)
    "RandomDataset", "RandomDatasetV2", "ExperimentalRandomDataset", "ShuffleDataset", "ShuffleDatasetV2",
    "ShuffleDatasetV3", "ShuffleAndRepeatDataset", "ShuffleAndRepeatDatasetV2", "GlobalShuffleDataset",
    "AnonymousRandomSeedGenerator", "AnonymousSeedGenerator",
    "NonDeterministicInts"})  # fresh entropy per call (a seed for stateless ops)
# parallel interleaves whose `sloppy` is an input tensor, not an attr: taken as unordered
SLOPPY_INPUT_OPS = frozenset({"ParallelInterleaveDataset", "ExperimentalParallelInterleaveDataset"})


def is_table_op(op: str) -> bool:
    """A lookup-table op (HashTableV2, MutableDenseHashTableV2, AnonymousHashTable, LookupTableFindV2,
    InitializeTableFromTextFileV2 ...): the fingerprint hashes a table's handle, not its contents."""
    return "HashTable" in op or op.startswith(("LookupTable", "InitializeTable"))


class UnfingerprintableChain(ValueError):
    """The chain holds something the fingerprint cannot see; the message names it."""


@dataclass(frozen=True)
class ChainKey:
    fingerprint: int   # tf.raw_ops.DatasetFingerprint of the chain over the dummy source
    tf_version: str
    random: bool       # its outputs may differ per call: stateful random ops, shuffles, or not ordered
    ordered: bool = True  # False: elements may come out of order (deterministic=False ...)

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
    nodes = list(_graph_nodes(ds))
    ops = {n.op for n in nodes}
    _refuse_unseen(ops)
    fp = int(tf.raw_ops.DatasetFingerprint(input_dataset=ds._variant_tensor))
    ordered = not any(_reorders(n) for n in nodes)
    # out of order, the n-th output differs per call as a random op's does
    return ChainKey(fingerprint=fp, tf_version=tf.__version__, random=bool(ops & RANDOM_OPS) or not ordered,
                    ordered=ordered)


def _refuse_unseen(ops: set[str]) -> None:
    """UnfingerprintableChain if the graph holds something whose value is outside it."""
    if ops & PY_FUNC_OPS:
        raise UnfingerprintableChain(
            "the chain calls Python (tf.py_function / tf.numpy_function), whose code the fingerprint "
            "cannot see: write the transform in TF ops, or key it yourself")
    if ops & VARIABLE_OPS:
        raise UnfingerprintableChain(
            "the chain reads a tf.Variable, whose value the fingerprint cannot see: capture a "
            "constant (tf.constant or a numpy value) instead")
    tables = sorted(op for op in ops if is_table_op(op))
    if tables:
        # a table's contents live in a resource (filled by an initialiser, maybe from a file), not in the graph
        raise UnfingerprintableChain(
            f"the chain uses a lookup table ({', '.join(tables)}; tf.lookup, StringLookup ...), whose "
            "contents the fingerprint cannot see: tables with other contents get the same key; map "
            "with constants instead, or key the chain yourself")


def _reorders(node: Any) -> bool:
    """Whether this dataset node may yield its elements out of input order."""
    attr = node.attr
    if "deterministic" in attr and attr["deterministic"].s == b"false":  # map/interleave/batch(deterministic=False)
        return True
    if ("sloppy" in attr and attr["sloppy"].b) or node.op in SLOPPY_INPUT_OPS:
        return True
    if node.op == "OptionsDataset":  # with_options(Options(deterministic=False)) rules every op of the chain
        from tensorflow.core.framework import dataset_options_pb2

        opts = dataset_options_pb2.Options.FromString(attr["serialized_options"].s)
        return opts.WhichOneof("optional_deterministic") is not None and not opts.deterministic
    return False


def _graph_ops(ds: "tf.data.Dataset") -> Iterator[str]:
    """Op types of the dataset's graph, those inside its functions included."""
    return (node.op for node in _graph_nodes(ds))


def _graph_nodes(ds: "tf.data.Dataset") -> Iterator[Any]:
    """NodeDefs of the dataset's graph, those inside its functions included."""
    import tensorflow as tf

    graph = tf.compat.v1.GraphDef.FromString(ds._as_serialized_graph().numpy())
    yield from graph.node
    for fn in graph.library.function:
        yield from fn.node_def
