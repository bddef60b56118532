"""A tf.data.Dataset of batches from a Python generator, one generator per iteration.

What `tf.data.Dataset.from_generator` does, for tf_dataset's one case (a vector of
tf.string per call), at less cost per call and per iteration: a `numpy_function`
per batch instead of from_generator's `eager_py_func` and its structure checks, and
no `flat_map` whose inner iterator is built afresh each epoch (tools/bench/tfdata,
docs/benchmarks.md: from_generator's first batch came 20 ms after the iterator).

Each iteration of the dataset carries a token from call to call (`Dataset.scan`,
whose state is the iterator's own): -1 on its first call, which draws the
iteration's token, makes its generator (`start()`, which runs nothing yet) and
closes a generator left over by an iteration abandoned before its end, which then
records its epoch as stopped early (its generator's `finally`). That call hands
over no batch (`skip(1)` drops its element): the epoch begins at the next call,
which carries the token. So an error at the epoch's start (a raising
`on_epoch_start`, a failed first read) leaves the iterator's token its own, and the
call TensorFlow makes after an error (its prefetch's, a parallel map's) ends the
iteration instead of starting a second epoch under -1. The generator's end is an
empty batch, which `take_while` turns into the end of the iteration. (A token drawn per
iteration from `Dataset.random` would do too, but deleting its iterator waited
0.1-0.3 s for TensorFlow's autotuning thread under load.) One iteration at a time
(as tf_source.py says): an iterator still open when another starts has had its
epoch ended, and its next call raises `overlapped()`'s error (the token tells it
from the new one: without it the two would share the new epoch's batches, and
both fail TensorFlow's cardinality check, which says nothing of why).

TicketFeed does the same with several batches read at once (tf_dataset's
`read_parallel`): the batches are planned in order and handed on in order.

At interpreter exit the feeds end their iterations (CALLS): an iterator still open
then would otherwise hang the exit.
"""
from __future__ import annotations

import atexit
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    import tensorflow as tf

_END = np.empty(0, dtype=object)
_NO_TICKET = np.int64(-1)
_NEW = np.int64(-1)  # the token of an iteration's first call: start an epoch
QUIET_AT_EXIT = 0.2  # seconds without a call into a feed, at exit: TensorFlow's threads stopped calling
EXIT_WAIT = 40.0  # the longest wait at exit (a read in progress may wait 30 s for other jobs' inserts)


class _Calls:
    """TensorFlow's calls into the feeds, counted for the interpreter's exit.

    A TensorFlow thread that calls into Python once the interpreter is finalizing never
    returns, and an iterator still open then (a global `it = iter(ds)`, one held by a
    traceback) is destroyed after that, waiting forever for its read-ahead thread (our
    prefetch, or the one tf.data injects), which was reading or about to: the process hung at
    exit. At exit (atexit runs before finalizing) the feeds end every iteration at its next
    call and start none, and the exit waits for the calls under way and until none has come
    for QUIET_AT_EXIT: the threads then have their iterations' ends and call no more."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running = 0
        self._last = 0.0  # when a call last ended or a feed was made (time.monotonic); 0: neither yet
        self.exiting = False

    def touch(self) -> None:
        """A feed was made: its iterator's first call may come any moment."""
        with self._lock:
            self._last = time.monotonic()

    def __enter__(self) -> bool:
        """`with CALLS as exiting:` around each call from TensorFlow; exiting: end the
        iteration. A plain context manager, not a generator one: from_generator's modes
        come here once per element."""
        with self._lock:
            self._running += 1
        return self.exiting

    def __exit__(self, *exc: Any) -> None:
        with self._lock:
            self._running -= 1
            self._last = time.monotonic()

    def drain(self) -> None:
        """At exit: end the feeds' iterations; wait until TensorFlow's threads stop calling."""
        self.exiting = True
        deadline = time.monotonic() + EXIT_WAIT
        while time.monotonic() < deadline:
            with self._lock:
                if not self._running and (not self._last or time.monotonic() - self._last >= QUIET_AT_EXIT):
                    return
            time.sleep(0.01)  # lets go of the GIL: a thread waiting for it to call comes in


CALLS = _Calls()
atexit.register(CALLS.drain)


def overlapped() -> RuntimeError:
    """The error of an iterator whose epoch another iterator's start ended."""
    return RuntimeError(
        "two iterators of this tf_dataset were open at once: another one started the next epoch, which ended "
        "this one's (each pass is one epoch of the sampler, every item once; two at a time would share its "
        "items). Iterate one pass at a time: finish or delete an iterator before making the next; for two "
        "pipelines at once, make two tf_datasets")


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
        self._token = 0  # the iteration now running (from_generator makes one generator per iterator)
        self._gen: Any = None  # its generator
        CALLS.touch()

    def __call__(self) -> Iterator[Any]:
        self._token += 1
        gen = self.start()
        self._stop()  # an iteration left open stops early (recorded so), as Feed's
        self._gen = gen
        return self._guarded(gen, self._token)

    def _stop(self) -> None:
        gen, self._gen = self._gen, None
        if gen is not None:
            try:
                gen.close()
            except ValueError:  # running in another thread now: it stops at its next step
                pass

    def _guarded(self, gen: Iterator[Any], token: int) -> Iterator[Any]:
        """gen, until a later iteration starts: then it raises overlapped() (the two
        would share the sampler, and the preprocessing workers)."""
        try:
            while True:
                with CALLS as exiting:
                    if exiting:  # the interpreter exits: end here (_Calls)
                        return
                    if token != self._token:
                        raise overlapped()
                    try:
                        item = next(gen)
                    except StopIteration:
                        return
                yield item
        finally:
            gen.close()  # type: ignore[attr-defined]
            if self._gen is gen:
                self._gen = None

    def close(self) -> None:
        self.start = _closed
        self._stop()  # and let go of it (and so of the TFSource)


class Feed:
    """The Python side: the generator of the iteration now running."""

    def __init__(self, start: Callable[[], Iterator[np.ndarray]]) -> None:
        self.start = start
        self._lock = threading.Lock()  # TensorFlow may call from any of its threads
        self._gen: Iterator[np.ndarray] | None = None
        self._token = 0  # the iteration now running
        CALLS.touch()

    def next_batch(self, token: np.int64) -> tuple[np.int64, np.ndarray]:
        """(the iteration's token, its next batch; an empty one at its end). `token`: -1
        on the iteration's first call, which draws its token and makes its generator (its
        element is dropped: the module's docstring); an earlier iteration's raises."""
        with CALLS as exiting, self._lock:
            if exiting:  # the interpreter exits: end the iteration, start none (_Calls)
                return np.int64(token), _END
            if token == _NEW:
                self._close()
                self._token += 1
                self._gen = self.start()
                return np.int64(self._token), _END
            if token != self._token:
                raise overlapped()
            own = np.int64(self._token)
            if self._gen is None:
                return own, _END
            try:
                return own, next(self._gen)
            except StopIteration:
                self._gen = None
                return own, _END
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

    def call(token: Any, _: Any) -> tuple[Any, Any]:
        token, batch = tf.numpy_function(feed.next_batch, [token], (tf.int64, tf.string), stateful=True)
        return tf.ensure_shape(token, []), tf.ensure_shape(batch, [None])

    batches = tf.data.Dataset.range(np.iinfo(np.int64).max).scan(tf.constant(_NEW), call)
    return batches.skip(1).take_while(lambda b: tf.size(b) > 0)  # skip: the token's call


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

    A sequential scan plans each batch (the sampler's next one, in order: the
    iteration's first call starts a new epoch, as Feed's, and draws its token) and
    answers the token and a ticket; a parallel map with
    `deterministic=True` reads the tickets, up to `parallel` at once, in
    TensorFlow's threads, and TensorFlow hands their batches on in ticket order.
    Reads overlap where they let go of the GIL (hashing, the store's fetches;
    not RocksDB gets, which hold it; AES-GCM decryption lets go of it but gains
    little from a second thread: tools/bench/hitfloor). The epoch ends when the
    sampler has none left and every ticket planned has been read. Tickets
    count on across epochs; a plan or read of an earlier iteration's (its epoch
    ended by a later iteration's start) raises overlapped()."""

    def __init__(self, begin: Callable[[], EpochReads]) -> None:
        self.begin = begin
        self._lock = threading.Lock()
        self._epoch: EpochReads | None = None
        self._todo: dict[int, Any] = {}  # ticket -> batch planned, not yet taken by a read
        self._next = 0  # the next ticket
        self._reading = 0  # tickets planned in this epoch whose reads have not finished
        self._planned_all = False
        self._token = 0  # the iteration now running
        self._starting = False  # its token drawn, its epoch not begun yet (the next plan begins it)
        CALLS.touch()

    def plan(self, token: np.int64) -> tuple[np.int64, np.int64]:
        """(the iteration's token, the ticket of its next batch; -1 at the epoch's end).
        `token`: -1 on the iteration's first call, which draws its token and plans nothing
        (its element is dropped, as Feed's); the next call begins the epoch."""
        with CALLS as exiting, self._lock:
            if exiting:  # the interpreter exits: plan no more (_Calls)
                return np.int64(token), _NO_TICKET
            if token == _NEW:
                self._end(False)  # an epoch left open was stopped early
                self._token += 1
                self._starting = True
                return np.int64(self._token), _NO_TICKET
            if token != self._token:
                raise overlapped()
            if self._starting:  # one that raises begins none: the next call ends the iteration
                self._starting = False
                self._epoch = self.begin()
            return np.int64(self._token), self._plan()

    def _plan(self) -> np.int64:
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

    def read(self, token: np.int64, ticket: np.int64) -> np.ndarray:
        """The items of the batch planned under `ticket` (read outside the lock); none
        once the interpreter exits (_Calls)."""
        with CALLS as exiting:
            return _END if exiting else self._read(token, ticket)

    def _read(self, token: np.int64, ticket: np.int64) -> np.ndarray:
        with self._lock:
            if token != self._token:
                raise overlapped()
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
                try:
                    epoch.delivered()  # the user's on_batch_time callbacks run here
                except BaseException:
                    self._end(False)  # the epoch stops with the error, as a failed read's
                    raise
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

    def plan(token: Any, _: Any) -> tuple[Any, Any]:
        token, ticket = tf.numpy_function(feed.plan, [token], (tf.int64, tf.int64), stateful=True)
        token = tf.ensure_shape(token, [])
        return token, (token, tf.ensure_shape(ticket, []))

    tickets = tf.data.Dataset.range(np.iinfo(np.int64).max).scan(tf.constant(_NEW), plan)
    tickets = tickets.skip(1).take_while(lambda _, t: t >= 0)  # skip: the token's call
    return tickets.map(lambda token, t: tf.ensure_shape(tf.numpy_function(feed.read, [token, t], tf.string,
                                                                          stateful=True), [None]),
                       num_parallel_calls=parallel, deterministic=True)
