"""A tf.data.Dataset of batches from a Python generator, one generator per iteration.

What `tf.data.Dataset.from_generator` does, for tf_dataset's one case (a vector of
tf.string per call), at less cost per call and per iteration: a `numpy_function`
per batch instead of from_generator's `eager_py_func` and its structure checks, and
no `flat_map` whose inner iterator is built afresh each epoch (tools/bench/tfdata,
docs/benchmarks.md: from_generator's first batch came 20 ms after the iterator).

Each iteration of the dataset counts its calls from 0 (`Dataset.range`); call 0
starts a new generator (`start()`) and closes one left over by an iteration
abandoned before its end, which then records its epoch as stopped early (its
generator's `finally`). The generator's end is an empty batch, which
`take_while` turns into the end of the iteration. (A token drawn per iteration
from `Dataset.random` would do too, but deleting its iterator waited 0.1-0.3 s
for TensorFlow's autotuning thread under load.) One iteration at a time (as
tf_source.py says): an iterator opened while another runs starts a new epoch,
whose batches the two would then share.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import tensorflow as tf

_END = np.empty(0, dtype=object)


class Feed:
    """The Python side: the generator of the iteration now running."""

    def __init__(self, start: Callable[[], Iterator[np.ndarray]]) -> None:
        self.start = start
        self._lock = threading.Lock()  # TensorFlow may call from any of its threads
        self._gen: Iterator[np.ndarray] | None = None

    def next_batch(self, call: np.int64) -> np.ndarray:
        """The next batch of the iteration (`call`: its count of calls; 0 starts it),
        an empty one at its end."""
        with self._lock:
            if call == 0:
                self._close()
                self._gen = self.start()
            if self._gen is None:
                return _END
            try:
                return next(self._gen)
            except StopIteration:
                self._gen = None
                return _END
            except BaseException:
                self._gen = None  # failed: its finally has run
                raise

    def _close(self) -> None:
        gen, self._gen = self._gen, None
        if gen is not None:
            gen.close()  # type: ignore[attr-defined]

    def close(self) -> None:
        """Ends an iteration left open (it is recorded as stopped early)."""
        with self._lock:
            self._close()


def batches_dataset(feed: Feed) -> "tf.data.Dataset":
    """The dataset of feed's batches (tf.string vectors), a new generator per iteration."""
    import tensorflow as tf

    batches = tf.data.Dataset.range(np.iinfo(np.int64).max).map(lambda call: tf.ensure_shape(
        tf.numpy_function(feed.next_batch, [call], tf.string, stateful=True), [None]))
    return batches.take_while(lambda b: tf.size(b) > 0)
