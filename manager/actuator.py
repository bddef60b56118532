"""Carries the manager's decisions out on the cache servers.

One worker thread per server, each with its own queue: effects reach every
server in the order they were decided, and a slow or dead server delays only
its own queue. Failures are logged and counted, never retried in place:
``reconcile`` (run by the decision loop, and on every worker's first contact)
compares each server's Stats with the state and fixes what differs -- job
modes, active chunks, chunks or datasets that must not be resident, chunks left
active for datasets the state no longer knows. That one
mechanism covers lost RPCs, servers that were down when a decision was made,
servers that join later (or restart: RegisterServer asks for their reconcile at
once), and a manager restarted from its journal (whose replay deliberately
performs no side effects). An EvictDataset is the exception, as Stats cannot tell a
re-planned dataset's old chunk tags from the new plan's: it is owed to every server
until its call succeeds, journaled (evictledger.py: a manager killed while it waits
in a queue keeps it), and repeated first by the next reconcile of a server that
missed it. An EvictChunk of a chunk that started loading
again while the call waited in the queue is not sent (_Worker._send).
"""
from __future__ import annotations

import logging
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc

from cacheserver.client.server_client import ServerClient
from cacheserver.counters import Counters
from cacheserver.tls import TlsFiles
from cacheserver.vocab import CacheMode, Option

from .metrics import MANAGER_COUNTERS
from .effects import ActivateChunk, Effect, EvictChunk, EvictDataset, Note, RingChanged, ServerForgotten, SetMode
from .evictledger import StoreLedger

log = logging.getLogger("manager.actuator")


@dataclass
class Desired:
    """What every server should look like (a copy taken under the state lock)."""
    bypass: set[str] = field(default_factory=set)                  # jobs in bypass mode
    option: dict[str, str] = field(default_factory=dict)           # dataset -> none/chunked/full
    resident: dict[str, set[int]] = field(default_factory=dict)    # chunked datasets: allowed chunks
    active: dict[str, int] = field(default_factory=dict)           # dataset -> active chunk
    grace_s: float = 300.0  # how long a dataset unknown here may keep an active chunk on a server


def desired_from(m: Any) -> Desired:
    """The servers' target state from a ManagerModel (call under the state lock)."""
    d = Desired(bypass={j for j, p in m.board.jobs.items() if p.mode is CacheMode.BYPASS},
                grace_s=m.config.dataset_grace_s)
    for ds in m.datasets:
        d.option[ds] = m.option(ds).value
    for ds, buf in m.buffers.items():
        d.resident[ds] = set(buf.resident())
        if buf.active is not None:
            d.active[ds] = buf.active
    return d


def _queued(q: "queue.Queue[Any]", dataset: str) -> bool:
    """Whether an EvictDataset of ``dataset`` waits in ``q``."""
    with q.mutex:
        return any(isinstance(i, EvictDataset) and i.dataset == dataset for i in q.queue)


def _what(item: Any) -> str:
    return "reconcile" if item == "reconcile" else "retire" if item is None else type(item).__name__


def _apply(c: ServerClient, e: Effect) -> None:
    if isinstance(e, SetMode):
        c.set_job_mode(e.job, CacheMode(e.mode).code)
    elif isinstance(e, ActivateChunk):
        c.active_chunk(e.dataset, e.chunk)
    elif isinstance(e, EvictChunk):
        try:
            c.evict_chunk(e.dataset, e.chunk, force=True)
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.NOT_FOUND:  # NOT_FOUND: nothing of it stored there
                raise
    elif isinstance(e, EvictDataset):
        c.evict_dataset(e.dataset)


class _Worker:
    def __init__(self, address: str, owner: "Actuator", after: "_Worker | None" = None) -> None:
        self.address = address
        self.owner = owner
        self.q: queue.Queue[Any] = queue.Queue()
        self.client: ServerClient | None = None
        self.failing = False
        self.unknown_since: dict[str, float] = {}  # dataset -> when reconcile first saw it unknown, pinned
        # The retired worker of this address (its server left the ring and came back while
        # a call of it was still in flight): that one ends first, so nothing lands after
        # this worker's reconcile.
        self.after = after
        # (number, monotonic start, item) of the item in hand, None while idle; read by
        # Actuator._log_stuck from another thread, so set and cleared whole
        self.busy: tuple[int, float, Any] | None = None
        self._items = 0
        self.stuck_logged = 0  # the number of the last item whose stall was logged
        self.thread = threading.Thread(target=self._run, name=f"actuator-{address}", daemon=True)
        self.thread.start()

    def _client(self) -> ServerClient:
        if self.client is None:
            self.client = ServerClient(self.address, tls=self.owner.tls, timeout=self.owner.timeout,
                                       use_dataplane=False, control_token=self.owner.token)
        return self.client

    def _drop_client(self) -> None:
        # read and cleared in one step: stop() may drop it from another thread meanwhile
        client, self.client = self.client, None
        if client is not None:
            client.close()

    def retire(self) -> int:
        """Its server left the ring: the calls still queued are dropped (were it to come back,
        the new worker's reconcile brings it up to date, and they would land after that),
        and the thread ends after the call in flight. How many were dropped."""
        dropped = 0
        while True:
            try:
                item = self.q.get_nowait()
            except queue.Empty:
                break
            self.q.task_done()
            self.owner.owe([self.address], item, save=False)  # under the actuator's lock: saved after it
            dropped += item is not None and item != "reconcile"
        self.q.put(None)
        return dropped

    def _run(self) -> None:
        if self.after is not None:
            self.after.thread.join()
            self.after = None
        while True:
            item = self.q.get()
            self._items += 1
            self.busy = (self._items, time.monotonic(), item)
            try:
                if item is None:
                    self._drop_client()  # retired: its channel goes now, not when collected
                    return
                if item == "reconcile":
                    self._reconcile()
                elif self._send(self._client(), item):
                    self.owner.counters.add("server_calls")
                    if isinstance(item, EvictDataset):
                        self.owner.paid(self.address, item.dataset, self.q)
                if self.failing:
                    log.info("server %s reachable again", self.address)
                    self.failing = False
            except grpc.RpcError as e:
                self.owner.owe([self.address], item)
                self.owner.counters.add("server_call_failures")
                # once per outage (reconcile retries every decision round), but every missed
                # EvictDataset (rare: a re-plan): the operator sees each eviction owed
                if not self.failing or isinstance(item, EvictDataset):
                    log.warning("server %s: %s failed: %s %s", self.address, _what(item), e.code(), e.details())
                    self.failing = True
                self._drop_client()  # a restarted server is a new connection
            except Exception:
                self.owner.owe([self.address], item)
                self.owner.counters.add("server_call_failures")
                log.exception("server %s: %r failed", self.address, item)
            finally:
                self.busy = None
                self.q.task_done()

    def _reconcile(self) -> None:
        c = self._client()
        for ds in self.owner.owed(self.address):  # before Stats: the fixes below re-set the active chunk
            log.info("reconcile %s: EvictDataset %s, which it missed", self.address, ds)
            c.evict_dataset(ds)
            self.owner.paid(self.address, ds, self.q)
        st = c.stats()  # Stats first, then the state: the state is the newer of the two
        want = self.owner.desired()
        fixes: list[Effect] = []
        on_server = {job for job, mode in st.job_modes.items() if mode == CacheMode.BYPASS.code}
        fixes += [SetMode(j, CacheMode.NORMAL.value, "reconcile") for j in sorted(on_server - want.bypass)]
        fixes += [SetMode(j, CacheMode.BYPASS.value, "reconcile") for j in sorted(want.bypass - on_server)]
        for ds, chunk in sorted(want.active.items()):
            if st.active_chunks.get(ds, -1) != chunk:
                fixes.append(ActivateChunk(ds, chunk))
        held: dict[str, set[int]] = {}
        for ch in st.chunks:
            if ch.items or ch.refs:
                held.setdefault(ch.dataset, set()).add(ch.chunk)
        for ds, chunks in sorted(held.items()):
            opt = want.option.get(ds)
            if opt == Option.NONE:  # no chunk entries; spare ones take only room nobody needs
                fixes += [EvictChunk(ds, c, True, "reconcile: not allocated") for c in sorted(chunks) if c >= 0]
            elif opt == Option.CHUNKED:
                for chunk in sorted(chunks - want.resident.get(ds, set())):
                    if chunk >= 0:
                        fixes.append(EvictChunk(ds, chunk, True, "reconcile: not resident in the plan"))
            # full: everything may stay; unknown datasets: not the manager's to judge (but _unpin)
        fixes += self._unpin(st.active_chunks, want)
        for e in fixes:
            log.info("reconcile %s: %s", self.address, e)
            self._send(c, e)
        self.owner.counters.add("reconcile_fixes", len(fixes))
        self.owner.counters.add("reconciles")

    def _send(self, c: ServerClient, e: Effect) -> bool:
        """Carry ``e`` out on this server, except an EvictChunk of a chunk that is resident in the
        state again, read now, just before the call: its chunk started loading again (the same
        plan: the same entries, content-addressed; a re-plan evicts the whole dataset after it)
        while the call waited in this queue (a slow server; k >= 3 a whole pass behind; the last
        job leaving and the next registering), and the clients' puts of the reload, which the
        server cannot tell from the old entries (same tag), may be there already. Only a call
        already on its way when the reload is decided can still land after those puts. Whether
        it was sent."""
        if isinstance(e, EvictChunk) and e.chunk in self.owner.desired().resident.get(e.dataset, ()):
            log.info("server %s: EvictChunk(%s, %d) not sent: the chunk is resident in the plan again",
                     self.address, e.dataset, e.chunk)
            self.owner.counters.add("chunk_evictions_skipped")
            return False
        _apply(c, e)
        return True

    def _unpin(self, active: Mapping[str, int], want: Desired) -> list[Effect]:
        """Active chunks of datasets the manager does not know, once unknown for a grace period.
        Only a manager sets one, and it keeps the chunk's entries from eviction for ever: an
        EvictDataset lost when the dataset was forgotten (the server out of the ring or not
        answering then; the manager killed before the call) or a manager that lost its state
        left it. A job registering the dataset meanwhile keeps it (it is known again)."""
        now = time.monotonic()
        self.unknown_since = {ds: self.unknown_since.get(ds, now) for ds in active if ds not in want.option}
        return [EvictChunk(ds, active[ds], True, "reconcile: active chunk of a dataset the manager does not know")
                for ds, since in sorted(self.unknown_since.items()) if now - since >= want.grace_s]


class Actuator:
    def __init__(self, desired: Callable[[], Desired], addresses: Callable[[], list[str]], *,
                 tls: TlsFiles | None = None, timeout: float = 2.0, counters: Counters | None = None,
                 token: bytes | None = None, stuck_after_s: float | None = None) -> None:
        self.desired = desired
        self.addresses = addresses
        self.tls = tls
        self.token = token  # the cluster token: the manager's role on the servers
        self.timeout = timeout
        # A worker's item in hand this long is stuck (each call's deadline should have ended it):
        # reconcile logs where its thread hangs (_log_stuck)
        self.stuck_after_s = 10 * timeout if stuck_after_s is None else stuck_after_s
        self.counters = counters or Counters(MANAGER_COUNTERS)
        self._workers: dict[str, _Worker] = {}
        self._retired: dict[str, _Worker] = {}  # left the ring, calls still queued
        self._lock = threading.Lock()
        # EvictDatasets a server missed (the call failed or was dropped, or it was out of the
        # ring), by address: a re-plan's old chunk tags stay on it, and reconcile cannot tell
        # them from the new plan's (same numbers), so it repeats the eviction first. Its own
        # lock: a worker retired under self._lock records what it drops.
        self._owed: dict[str, set[str]] = {}
        self._owed_lock = threading.Lock()
        # Every address that had a worker (or the state knows: restore), less those forgotten
        # (forget); under _owed_lock: a worker retired under self._lock owes only to these.
        self._known: set[str] = set()
        self.ledger: StoreLedger | None = None  # journals _owed (restore); None: memory only

    def restore(self, ledger: StoreLedger) -> None:
        """After a (re)start, before any call: the missed EvictDatasets the state kept, and every
        server address it knows (one out of the ring now gets what is decided while it is away);
        from now on ``ledger`` journals each change of them."""
        saved, known = ledger.saved(), ledger.known_addresses()
        with self._owed_lock:
            for addr, datasets in saved.items():
                self._owed.setdefault(addr, set()).update(datasets)
        with self._owed_lock:
            self._known |= known
        self.ledger = ledger

    def owe(self, addresses: list[str], item: Any, save: bool = True) -> None:
        """Record that ``item``, if an EvictDataset, has not reached the servers at ``addresses``
        (yet; ``save``: journal it now; not while holding self._lock, taken under the state's)."""
        if isinstance(item, EvictDataset) and addresses:
            with self._owed_lock:
                self._owe_locked(addresses, item)
            if save:
                self.save_owed()

    def _owe_locked(self, addresses: list[str], item: EvictDataset) -> None:
        for addr in addresses:
            if addr in self._known:  # not one forgotten meanwhile (a retired worker's last call)
                self._owed.setdefault(addr, set()).add(item.dataset)

    def owe_chunked(self, address: str) -> None:
        """A server registers under an id the state does not know, with entries: forgotten
        while it was away (or the state lost), so what it missed is not known. Stats cannot
        tell a CHUNKED dataset's old chunk tags from its plan's, so each of those is owed to
        it (the others reconcile checks). Call before the join: its reconcile pays them first."""
        chunked = sorted(ds for ds, opt in self.desired().option.items() if opt == Option.CHUNKED)
        with self._owed_lock:
            self._known.add(address)
        for ds in chunked:
            self.owe([address], EvictDataset(ds, "a server the state did not know, with entries"), save=False)
        if chunked:
            log.info("actuator: %s joins with entries under an unknown server id: owed EvictDataset of %s",
                     address, ", ".join(chunked))
            self.save_owed()

    def forget(self, e: ServerForgotten) -> None:
        """A forgotten server's address, unless in the ring or still known, owes nothing more."""
        with self._lock:
            keep = set(e.known) | set(self._workers)
        with self._owed_lock:
            self._known &= keep
            for addr in [a for a in self._owed if a not in keep]:
                del self._owed[addr]

    def owed(self, address: str) -> list[str]:
        with self._owed_lock:
            return sorted(self._owed.get(address, ()))

    def paid(self, address: str, dataset: str, pending: "queue.Queue[Any] | None" = None) -> None:
        """An EvictDataset of ``dataset`` reached ``address``; still owed while another of it waits
        in ``pending`` (the server's queue: a re-plan's call behind the reconcile that paid the
        owed one, or two re-plans): the puts between the two are the old plan's, and a load
        report counts only once none is owed (model.evicting)."""
        with self._owed_lock:
            left = self._owed.get(address)
            if left is None or dataset not in left or (pending is not None and _queued(pending, dataset)):
                return
            left.discard(dataset)
            if not left:
                del self._owed[address]
        self.save_owed()

    def _owed_copy(self) -> dict[str, set[str]]:
        with self._owed_lock:
            return {addr: set(datasets) for addr, datasets in self._owed.items()}

    def save_owed(self) -> None:
        """Journal the missed EvictDatasets, if a ledger was given. A failure (the journal not
        writable) is logged: memory still holds them, and the next change saves them again."""
        if self.ledger is None:
            return
        try:
            self.ledger.save(self._owed_copy)
        except Exception:
            log.warning("actuator: the EvictDatasets servers missed could not be journaled", exc_info=True)

    def _sync_workers(self) -> list[_Worker]:
        want = set(self.addresses())
        with self._lock:
            for addr in [a for a, w in self._retired.items() if not w.thread.is_alive()]:
                del self._retired[addr]
            leaving = sorted(set(self._workers) - want)
            for addr in leaving:
                w = self._retired[addr] = self._workers.pop(addr)
                dropped = w.retire()
                if dropped:
                    log.info("actuator: %s left the ring; %d call(s) queued for it dropped", addr, dropped)
            for addr in sorted(want - set(self._workers)):
                # One thread at a time per server: a retired worker's call in flight must
                # not land after the new worker's reconcile and calls (decision order).
                with self._owed_lock:  # before its thread starts: a call it fails is owed
                    self._known.add(addr)
                w = self._workers[addr] = _Worker(addr, self, after=self._retired.pop(addr, None))
                w.q.put("reconcile")  # a (re)joining server catches up first
            workers = [self._workers[a] for a in sorted(want)]
        if leaving:
            self.save_owed()  # what the retired workers dropped
        return workers

    def submit(self, effects: list[Effect]) -> None:
        """Log every effect; queue the server calls for every server in the ring.
        Called under the state lock, so queues get effects in decision order."""
        for e in effects:
            if isinstance(e, Note):
                # key=value in the message too: the text log format drops `fields`
                kv = " ".join(f"{k}={v}" for k, v in e.fields)
                log.info("%s %s", e.message, kv, extra={"fields": dict(e.fields)})
            elif isinstance(e, RingChanged):
                log.info("ring changed: version %d, %s", e.version, ", ".join(e.addresses))
            elif isinstance(e, ServerForgotten):
                self.forget(e)
            else:
                log.info("decision: %s", e)
        calls = [e for e in effects if isinstance(e, (SetMode, ActivateChunk, EvictChunk, EvictDataset))]
        changed = any(isinstance(e, RingChanged) for e in effects)
        if not calls and not changed:
            return
        workers = self._sync_workers()
        with self._owed_lock:
            everyone = sorted(self._known)  # the ring's (each had a worker) and those away
        # An EvictDataset is owed to every server until its call succeeds (paid), and journaled
        # before it is queued: one out of the ring gets it when back, and one whose call still
        # waits in its queue when the manager is killed gets it at its first reconcile after the
        # restart (reconcile cannot tell the old plan's chunk tags from the new one's).
        for e in calls:
            self.owe(everyone, e, save=False)
        evictions = any(isinstance(e, EvictDataset) for e in calls)
        if evictions:
            self.save_owed()
        with self._owed_lock:  # owed again and queued at once: a paid() in between (an earlier
            for e in calls:    # eviction of the dataset landing) sees it queued, or owes it after
                if isinstance(e, EvictDataset):
                    self._owe_locked(everyone, e)
            for w in workers:
                for e in calls:
                    w.q.put(e)
        if evictions:
            self.save_owed()  # journals only what such a paid() dropped meanwhile

    def reconcile(self, address: str | None = None) -> None:
        """Reconcile every server, or only the one at ``address``: a server that registered
        (it started) lost its job modes, and with a new data dir its active chunks too; its
        address may be in the ring already, so no ring change brings it up to date."""
        self._log_stuck()
        for w in self._sync_workers():
            if (address is None or w.address == address) and w.q.qsize() < 4:  # a stuck server
                w.q.put("reconcile")                                             # must not pile them up

    def _log_stuck(self) -> None:
        """Log, once per item, the stack of a worker thread whose item (a server call, or a
        reconcile's few) has run past stuck_after_s: every call has a deadline, so a CI stall or a
        wedged server shows where it hangs. Cheap: the frames are read only for such a thread."""
        with self._lock:
            workers = list(self._workers.values()) + list(self._retired.values())
        now = time.monotonic()
        for w in workers:
            busy = w.busy
            if busy is None or busy[0] == w.stuck_logged or now - busy[1] < self.stuck_after_s:
                continue
            w.stuck_logged = busy[0]
            frame = sys._current_frames().get(w.thread.ident or -1)
            stack = "".join(traceback.format_stack(frame)) if frame is not None else "(no frame)\n"
            self.counters.add("server_calls_stuck")
            log.warning("server %s: %s stuck for %.1f s (call timeout %g s); thread %s is at:\n%s",
                        w.address, _what(busy[2]), now - busy[1], self.timeout, w.thread.name, stack.rstrip())

    def drain(self, timeout: float = 5.0) -> bool:
        """Wait until every queued call has been tried (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            workers = list(self._workers.values())
        for w in workers:
            while w.q.unfinished_tasks and time.monotonic() < deadline:
                time.sleep(0.01)
        return all(not w.q.unfinished_tasks for w in workers)

    def stop(self) -> None:
        with self._lock:
            workers, self._workers = list(self._workers.values()), {}
            retired, self._retired = list(self._retired.values()), {}
        for w in workers:
            w.q.put(None)
        workers += retired  # None queued already
        for w in workers:
            w.thread.join(self.timeout + 1)
            w._drop_client()
