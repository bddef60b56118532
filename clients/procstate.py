"""What one process opens for a CachedDataset (clients/dataset.py): its ring client, store
reads, hash threads and table of checked values; made afresh in each process, never pickled.

Made on first use, by whichever thread comes first: the training loop's or the manager's
prefetch thread (coordination.py). per_process() makes it once however many ask together:
two would each hold a ring client and thread pools, and one would never be closed."""
from __future__ import annotations

import asyncio
import atexit
import os
import threading
import warnings
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from cacheserver import inproc
from cacheserver.client.ring_client import RingClient, parse_spec
from cacheserver.malloc import keep_freed_memory

from . import checked
from .coalesce import HostCoalescer
from .daemonpool import DaemonPool
from .readthreads import store_read_threads
from .stats import worker_row

# Threads that check a batch's SHA-256s together (this one included).
HASH_THREADS = max(1, min(8, os.cpu_count() or 1))
T = TypeVar("T")
# At the interpreter's exit, the longest wait for a thread close() left running (close_after),
# and, once its store reads were broken off, for it to end.
EXIT_WAIT_S = 5.0
BROKEN_WAIT_S = 2.0
_open: weakref.WeakSet = weakref.WeakSet()  # the ProcessStates of this process not yet closed
# One for all objects: states are made rarely. Re-entrant: making one may ask for another.
_making = threading.RLock()


def _after_fork() -> None:
    global _making
    _making = threading.RLock()  # a forked child must not inherit it held by a thread it lacks


os.register_at_fork(after_in_child=_after_fork)


def per_process(owner: Any, attr: str, make: Callable[[], T]) -> T:
    """owner.<attr>: a state with a `pid`, made by make() once in each process, however
    many threads ask at once."""
    st = getattr(owner, attr)
    if st is None or st.pid != os.getpid():
        with _making:
            st = getattr(owner, attr)  # made by another thread while this one waited?
            if st is None or st.pid != os.getpid():
                st = make()
                setattr(owner, attr, st)
    return st


def take(owner: Any, attr: str) -> Any:
    """owner.<attr>, set to None: handed to one caller only, however many threads ask at
    once (two close() calls must not both close one state, or release one cache twice)."""
    with _making:
        value = getattr(owner, attr)
        setattr(owner, attr, None)
    return value


class DatasetClosed(RuntimeError):
    """A read of a CachedDataset in a process after its close(): it would have opened the
    process's clients and threads again, which nobody closes then."""


def close_after(thread: threading.Thread, close: Callable[[], None]) -> None:
    """close() once `thread` has ended, from a daemon thread: the coordination thread that
    CachedDataset.close() waited for in vain may be amid a store read or a put with the
    process state, which then must stay open under it (a put on a closed client was lost,
    its items read from the store for nothing, and warned about as a server's refusal).

    A process that exits meanwhile waits for both at most EXIT_WAIT_S first (atexit: before
    the store's client closes its session, fsspec's finalizer), then breaks off the store
    reads still in flight and waits for the thread to give up their claims and end: else the
    exit broke the read later, and the daemon thread ran on into the interpreter's
    finalization (a traceback on stderr, at times an abort), its items read for nothing and
    their claims left held until they lapsed."""
    def wait_then_close() -> None:
        thread.join()
        close()
        atexit.unregister(at_exit)

    closer = threading.Thread(target=wait_then_close, name="mlcache-close-after", daemon=True)

    def at_exit() -> None:
        closer.join(EXIT_WAIT_S)
        if closer.is_alive():
            for st in list(_open):
                st.break_reads()
            closer.join(BROKEN_WAIT_S)

    atexit.register(at_exit)
    closer.start()


class ProcessState:
    """What one process opens for the dataset; never pickled."""

    def __init__(self, ds: Any) -> None:  # a CachedDataset (typed loosely: dataset.py imports this)
        import fsspec

        self.pid = os.getpid()
        if ds.keep_freed_memory:  # batches of values would otherwise page-fault afresh (cacheserver/malloc.py)
            keep_freed_memory()
        # resolved once in CachedDataset.__init__: every process routes over the same ring
        self.ring = (RingClient(parse_spec(ds.cache_spec), down_backoff=ds.down_backoff, plain=ds.plain_records)
                     if ds.cache_spec else None)
        # the embedded server, when it runs in this very process: gets that say which values it vouches for
        nodes = self.ring.ring.nodes if self.ring is not None else []
        self.core = inproc.core_for(nodes[0]) if len(nodes) == 1 else None
        self.fs, _ = fsspec.core.url_to_fs(ds.digest.root, **ds.storage_options)
        self.read_threads = store_read_threads(self.fs, ds.digest.root, ds.fetch_threads)
        # daemons: a local read that never returns must not hold the exit of the process
        self.pool = DaemonPool(self.read_threads, thread_name_prefix="store-fetch")
        # DataLoader workers already check in parallel, one process each: only the
        # main process (num_workers=0) spreads a batch's hashes over threads.
        self.hash_threads = 1 if worker_row() else HASH_THREADS
        self.hash_pool = (ThreadPoolExecutor(self.hash_threads - 1, thread_name_prefix="hash")
                          if self.hash_threads > 1 else None)
        # only a process that inserts what it reads has others wait for it; one with no cache
        # (cache=False) or insert=False would make them wait for nothing, then read anyway
        self.coalescer = (_coalescer(ds.dataset_tag) if ds.coalesce and ds.insert and self.ring is not None
                          else None)
        # values from a server that this process or another of the loader's checked once:
        # known again by a MAC (checked.py)
        self.checked = (checked.CheckedValues(ds.checked_table, len(ds.digest))
                        if ds.hashes_hits() and self.core is None else None)
        _open.add(self)

    def break_reads(self) -> None:
        """Break off the store reads in flight (at the process's exit only). An async fsspec
        filesystem (http, gcs, s3): its session closed, as its own finalizer would a moment
        later, and the tasks on its event loop cancelled, as a closed session alone does not
        end every read (s3fs opens a new one and retries, for minutes). Local reads cannot be
        broken off: their threads are daemons (DaemonPool), which no exit waits for."""
        if self.pid != os.getpid():
            return
        close_session = getattr(type(self.fs), "close_session", None)
        session = getattr(self.fs, "_session", None)
        if close_session is not None and session is not None:
            try:
                close_session(getattr(self.fs, "loop", None), session)
            except Exception:  # the exit goes on regardless
                pass
        loop = getattr(self.fs, "loop", None) if getattr(self.fs, "async_impl", False) else None
        if loop is not None and loop.is_running():
            try:
                loop.call_soon_threadsafe(_cancel_tasks, loop)
            except RuntimeError:  # closed meanwhile
                pass

    def close(self) -> None:
        _open.discard(self)
        self.pool.shutdown(wait=False, cancel_futures=True)
        if self.hash_pool is not None:
            self.hash_pool.shutdown(wait=False, cancel_futures=True)
        if self.ring is not None:
            self.ring.close()
        if self.coalescer is not None:
            self.coalescer.close()


def _cancel_tasks(loop: asyncio.AbstractEventLoop) -> None:
    """On `loop`'s own thread: cancel its tasks (the fsspec calls waited on by our threads,
    which then raise storeread.ReadBrokenOff)."""
    for task in asyncio.all_tasks(loop):
        task.cancel()


def _coalescer(tag: str) -> HostCoalescer | None:
    """The host's coalescing of this dataset's misses; None (each process reads its own
    misses) where its directory cannot be used: coalescing is an optimization only."""
    try:
        return HostCoalescer(tag)
    except OSError as e:
        warnings.warn(f"misses of this dataset are not coalesced with other processes of the host: {e}",
                      RuntimeWarning, stacklevel=2)
        return None
