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

TicketFeed does the same with several batches read at once (tf_dataset's
`read_parallel`): the batches are planned in order and handed on in order.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    import tensorflow as tf

_END = np.empty(0, dtype=object)
_NO_TICKET = np.int64(-1)


def _closed(*_: Any) -> Any:
    """What starts an iteration once the dataset is closed. TensorFlow keeps the Python
    callables of a dataset's sources (numpy_function's, from_generator's) for the life of
    the process (eagerly, in its global graph), so a closed dataset's feeds must let go
    of what they start: the TFSource, with its cache client, digest and shared memory."""
    raise RuntimeError("this tf_dataset was closed (ds.mlcache.close()): make a new tf_dataset "
                       "to iterate again")


class Starter:
    """from_generator's generator function until close(), as Feed's `start`."""

    def __init__(self, start: Callable[[], Iterator[Any]]) -> None:
        self.start = start

    def __call__(self) -> Iterator[Any]:
        return self.start()

    def close(self) -> None:
        self.start = _closed


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
        """Ends an iteration left open (it is recorded as stopped early), for good: TensorFlow
        keeps next_batch, and so this feed, as long as the process lives (see _closed)."""
        with self._lock:
            self._close()
            self.start = _closed


def batches_dataset(feed: Feed) -> "tf.data.Dataset":
    """The dataset of feed's batches (tf.string vectors), a new generator per iteration."""
    import tensorflow as tf

    batches = tf.data.Dataset.range(np.iinfo(np.int64).max).map(lambda call: tf.ensure_shape(
        tf.numpy_function(feed.next_batch, [call], tf.string, stateful=True), [None]))
    return batches.take_while(lambda b: tf.size(b) > 0)


class EpochReads(Protocol):
    """One epoch as TicketFeed drives it (tf_source.py makes them)."""

    def plan(self) -> Any:
        """The next batch to read (the sampler's indices), None at the epoch's end."""

    def read(self, batch: Any) -> np.ndarray:
        """The batch's items (a numpy object array of bytes)."""

    def delivered(self) -> None:
        """A batch read was handed over (the epoch's stats)."""

    def finish(self, complete: bool) -> None:
        """The epoch ended: all its batches were handed over (complete), or it stopped."""


class TicketFeed:
    """Several batches read at once, handed over in the sampler's order.

    A sequential map plans each batch (the sampler's next one, in order: call 0
    starts a new epoch, as Feed's) and answers a ticket; a parallel map with
    `deterministic=True` reads the tickets, up to `parallel` at once, in
    TensorFlow's threads, and TensorFlow hands their batches on in ticket order.
    Reads overlap where they let go of the GIL (hashing, the store's fetches;
    not RocksDB gets, which hold it; AES-GCM decryption lets go of it but gains
    little from a second thread: tools/bench/hitfloor). The epoch ends when the
    sampler has none left and every ticket planned has been read. Tickets
    count on across epochs: a read of a ticket from an epoch abandoned
    meanwhile answers an empty batch (that iteration is gone)."""

    def __init__(self, begin: Callable[[], EpochReads]) -> None:
        self.begin = begin
        self._lock = threading.Lock()
        self._epoch: EpochReads | None = None
        self._todo: dict[int, Any] = {}  # ticket -> batch planned, not yet taken by a read
        self._next = 0  # the next ticket
        self._reading = 0  # tickets planned in this epoch whose reads have not finished
        self._planned_all = False

    def plan(self, call: np.int64) -> np.int64:
        """The ticket of the next batch (`call`: the iteration's count of calls; 0
        starts an epoch), -1 at the epoch's end."""
        with self._lock:
            if call == 0:
                self._end(False)  # an epoch left open was stopped early
                self._epoch = self.begin()
            if self._epoch is None or self._planned_all:
                return _NO_TICKET
            try:
                batch = self._epoch.plan()
            except BaseException:
                self._end(False)
                raise
            if batch is None:
                self._planned_all = True
                if not self._reading:
                    self._end(True)
                return _NO_TICKET
            ticket, self._next = self._next, self._next + 1
            self._todo[ticket] = batch
            self._reading += 1
            return np.int64(ticket)

    def read(self, ticket: np.int64) -> np.ndarray:
        """The items of the batch planned under `ticket` (read outside the lock)."""
        with self._lock:
            batch, epoch = self._todo.pop(int(ticket), None), self._epoch
        if batch is None or epoch is None:
            return _END
        try:
            out = epoch.read(batch)
        except BaseException:
            with self._lock:
                if self._epoch is epoch:
                    self._end(False)
            raise
        with self._lock:
            if self._epoch is epoch:
                epoch.delivered()
                self._reading -= 1
                if self._planned_all and not self._reading:
                    self._end(True)
        return out

    def _end(self, complete: bool) -> None:
        epoch, self._epoch = self._epoch, None
        self._todo.clear()
        self._reading, self._planned_all = 0, False
        if epoch is not None:
            epoch.finish(complete)

    def close(self) -> None:
        """Ends an iteration left open (it is recorded as stopped early), for good (as Feed's)."""
        with self._lock:
            self._end(False)
            self.begin = _closed


def ticket_batches_dataset(feed: TicketFeed, parallel: int) -> "tf.data.Dataset":
    """The dataset of feed's batches (tf.string vectors), up to `parallel` read at once."""
    import tensorflow as tf

    tickets = tf.data.Dataset.range(np.iinfo(np.int64).max).map(lambda call: tf.ensure_shape(
        tf.numpy_function(feed.plan, [call], tf.int64, stateful=True), []))
    tickets = tickets.take_while(lambda t: t >= 0)
    return tickets.map(lambda t: tf.ensure_shape(tf.numpy_function(feed.read, [t], tf.string, stateful=True), [None]),
                       num_parallel_calls=parallel, deterministic=True)
