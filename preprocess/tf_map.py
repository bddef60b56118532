"""A tf.data `.map` function as a pipeline step that our workers can run.

    from preprocess.tf_map import TFMap

    step = TFMap(parse)          # parse: tf.string record -> tensors, written in TF ops
    step(record_bytes)           # {"image": b"...", "x": array([...]), "label": 3}: numpy
    step.key                     # "tf2.21.0/4df53e31df0d1c19": the chain's fingerprint

The function is traced once, for one scalar tf.string item, and shipped as a
SavedModel (its graph, as bytes inside the pickled step), so a worker process
(spawned locally, or on another host) runs it without the user's Python code
and without the training process. That is what the tf.data service cannot do
for a dataset fed from Python (docs/client.md). The function must be made of
TF ops: `tf.py_function` / `tf.numpy_function` and tf.Variables are refused
(preprocess/tf_fingerprint.py: their code or value is outside the graph, so
neither a SavedModel nor a fingerprint holds them).

Keys: the step's fingerprint is the chain's (`chain_fingerprint` of
`ds.map(fn)` over the fixed dummy source: stable across rebuilds and
processes, blind to names) plus the output spec, so autocache keys
transformed items by what TensorFlow computes, not by Python object
identity. A function with stateful random ops is a random step (`random`):
the cacheable prefix of a pipeline ends before it.
"""
from __future__ import annotations

import io
import os
import tarfile
import tempfile
from collections.abc import Callable
from typing import Any

from .tf_fingerprint import chain_fingerprint

SAVED_NAME = "fn"  # the attribute of the saved tf.Module that holds the function


class TFMap:
    """A picklable, fingerprintable step running a TF function on one item's bytes."""

    def __init__(self, fn: Callable[[Any], Any], name: str | None = None) -> None:
        import tensorflow as tf

        key = chain_fingerprint(lambda ds: ds.map(fn))  # refuses py_function and Variables
        traced = tf.function(fn, input_signature=[tf.TensorSpec([], tf.string)])
        concrete = traced.get_concrete_function()
        self.element_spec = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype),
                                                  concrete.structured_outputs)
        self.key = key.key
        self.random = key.random
        self.name = name or getattr(fn, "__qualname__", type(fn).__name__)
        self.__name__ = self.__qualname__ = f"TFMap({self.name})"  # the pipeline's step name
        self._saved = _save(traced)
        self._fn: Any = None  # the loaded function, per process

    def __fingerprint__(self) -> tuple:
        """What keys this step (preprocess/fingerprint.py): the graph's, not the object's."""
        return ("tf.map", self.key, repr(self.element_spec))

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_fn"] = None
        return state

    def __call__(self, item: bytes) -> Any:
        """The function on one item: numpy values in the function's output structure."""
        import tensorflow as tf

        if self._fn is None:
            self._fn = _load(self._saved)
        return tf.nest.map_structure(lambda t: t.numpy(), self._fn(tf.constant(item, tf.string)))


def _save(traced: Any) -> bytes:
    import tensorflow as tf

    module = tf.Module()
    setattr(module, SAVED_NAME, traced)
    with tempfile.TemporaryDirectory(prefix="mlcache-tfmap-") as d:
        tf.saved_model.save(module, os.path.join(d, "m"))
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            tar.add(os.path.join(d, "m"), arcname="m")
    return buf.getvalue()


def _load(saved: bytes) -> Any:
    import tensorflow as tf

    with tempfile.TemporaryDirectory(prefix="mlcache-tfmap-") as d:
        with tarfile.open(fileobj=io.BytesIO(saved)) as tar:
            tar.extractall(d, filter="data")
        return getattr(tf.saved_model.load(os.path.join(d, "m")), SAVED_NAME)
