"""Cache operations shared by both transports (gRPC and the binary data plane).

Validation happens here, before anything is written: a request with one bad
item is refused whole, so there are no partial writes.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

from .admission import Busy, answer_budget
from .chunkrefs import STATE_KEY, ChunkTable
from .claims import DEFAULT_TTL, ClaimTable
from .counters import Counters
from .getbound import bounded_get
from .identity import PeerCounts, current_peer
from .stallwrite import WriteStopped
from .store import UNTAGGED, Store
from .trust import WriteTrust
from .vocab import FETCH, ID_LEN, PRESENT, WAIT, BadRequest, CacheMode, check_ids

_NORMAL, _BYPASS = CacheMode.NORMAL.code, CacheMode.BYPASS.code
FOLLOWER_FLUSH_INTERVAL = 5.0  # seconds between flushes made for opening followers


@dataclass(frozen=True)
class Limits:
    max_item_bytes: int = 64 << 20
    max_batch_bytes: int = 256 << 20
    max_batch_items: int = 100_000
    max_inflight_bytes: int = 1 << 30  # request bodies held at once, all data-plane connections
    max_connections: int = 4096  # open data-plane connections
    request_timeout_s: float = 30.0  # a request's frame must arrive within this once it starts
    max_grpc_calls: int = 64  # gRPC calls served at once; past it RESOURCE_EXHAUSTED (grpcopts.py)


class CacheCore:
    def __init__(self, store: Store, counters: Counters, limits: Limits = Limits(),
                 claim_ttl: float = DEFAULT_TTL) -> None:
        self.store = store
        self.counters = counters
        self.replacers = PeerCounts()  # replaces by client identity (identity.py)
        self.limits = limits
        # saved as the store keeps derived state: held in memory while a write stop lasts
        self.chunks = ChunkTable(lambda: store.get_state(STATE_KEY), lambda raw: store.keep_state(STATE_KEY, raw))
        store.set_protector(self.chunks.is_protected)
        self._modes: dict[str, int] = {}
        self._modes_lock = threading.Lock()
        self.claims = ClaimTable(claim_ttl)
        self._follower_lock = threading.Lock()
        self._last_follower_flush = float("-inf")
        # values a client in this process wrote or checked (inproc.py); every other put forgets its ids
        self.trust = WriteTrust()

    # ---- validation -----------------------------------------------------
    def _check_ids(self, ids: Sequence[bytes]) -> None:
        if len(ids) > self.limits.max_batch_items:
            raise BadRequest(f"batch of {len(ids)} ids exceeds the limit of {self.limits.max_batch_items}")
        check_ids(ids)

    def bypassed(self, job: str) -> bool:
        return bool(job) and self._modes.get(job, _NORMAL) == _BYPASS

    # ---- data operations ------------------------------------------------
    def lookup(self, job: str, ids: Sequence[bytes], pending: bool = False, not_spare: bool = False) -> bytes:
        """1 present / 0 absent per id; with `pending`, 2 for absent ids another
        job is reading from the store now (claims.py); with `not_spare`, ids held
        only as spare entries count as absent (store.is_spare)."""
        self._check_ids(ids)
        if self.bypassed(job):
            self.counters.add_many({"lookups": len(ids), "bypassed": len(ids)})
            return bytes(len(ids))
        present = self.store.contains(ids, not_spare)
        self.counters.add_many({"lookups": len(ids), "lookup_hits": present.count(1)})
        return self.claims.pending(job, ids, present) if pending else present

    def claim(self, job: str, ids: Sequence[bytes]) -> bytes:
        """Before reading misses from the store: FETCH/WAIT/PRESENT per id (claims.py)."""
        self._check_ids(ids)
        if self.bypassed(job):  # it reads everything itself (what probing measures): nothing to wait for
            return bytes([FETCH]) * len(ids)
        out = self.claims.claim(job, ids, self.store.contains(ids))
        self.counters.add_many({"claims_granted": out.count(FETCH), "claims_waited": out.count(WAIT),
                                "claims_present": out.count(PRESENT)})
        return out

    def give_up(self, job: str, ids: Sequence[bytes]) -> bytes:
        """The job will not insert these claimed misses (its store read failed, its put
        never reached a store): its own claims on them end now, so that the jobs told
        WAIT read them themselves instead of waiting out the claims' ttl. 1 per id released."""
        self._check_ids(ids)
        out = self.claims.give_up(job, ids)
        self.counters.add("claims_released", out.count(1))
        return out

    def _get_bypassed(self, job: str, n: int) -> bool:
        """True (and counted as n missed gets) if the job is in bypass mode."""
        if not self.bypassed(job):
            return False
        self.counters.add_many({"gets": n, "get_misses": n, "bypassed": n})
        return True

    def get(self, job: str, ids: Sequence[bytes], count: bool = True, trailer: bool = True
            ) -> list[memoryview | None]:
        """Values or None; count=False for the fallback of a get already counted by get_local;
        trailer=False (in this process only: inproc.get_vouched) skips the record checksum.
        Raises admission.Busy where the data plane's budget grants none of its values."""
        self._check_ids(ids)
        if self._get_bypassed(job, len(ids)):
            return [None] * len(ids)
        get_many = self.store.get_many if trailer else partial(self.store.get_many, trailer=False)
        budget = answer_budget()  # a data-plane get's: values count against --max-inflight-bytes as read
        values, cut = bounded_get(get_many, ids, self.limits.max_batch_bytes, budget.take if budget else None)
        if budget is not None and budget.why and all(v is None for v in values):
            raise Busy(budget.why)  # nothing to send: busy, and not counted as a get (it was not answered)
        if cut:
            self.counters.add("get_cut_for_size", cut)
        if not count:
            return values
        hits = sum(1 for v in values if v is not None)
        self.counters.add_many({"gets": len(ids), "get_hits": hits, "get_misses": len(ids) - hits,
                                "get_bytes": sum(len(v) for v in values if v is not None)})
        return values

    def get_local(self, job: str, ids: Sequence[bytes]) -> bytes:
        """A get whose values a same-host reader takes from the store files itself:
        answer presence, and count and order it exactly like a get."""
        self._check_ids(ids)
        if self._get_bypassed(job, len(ids)):
            return bytes(len(ids))
        present = self.store.touch(ids)
        hits = present.count(1)
        self.counters.add_many({"gets": len(ids), "get_hits": hits, "get_misses": len(ids) - hits,
                                "local_reads": hits})
        return present

    def get_local_inline(self, job: str, ids: Sequence[bytes]) -> list[memoryview | bool | None]:
        """get_local for a reader that takes values not flushed yet inline: True
        for a value to read from the files, the value itself for one only in
        the memtable (the follower cannot see it), None for a miss."""
        self._check_ids(ids)
        if self._get_bypassed(job, len(ids)):
            return [None] * len(ids)
        present, late = self.store.touch_split(ids)
        out: list[memoryview | bool | None] = [True if p else None for p in present]
        inline = cut = 0
        if late:
            budget = answer_budget()  # values past the data plane's budget are misses: the presence is the answer
            inline_values, cut = bounded_get(self.store.get_many, [ids[i] for i in late], self.limits.max_batch_bytes,
                                             budget.take if budget else None)
            for i, v in zip(late, inline_values):
                out[i] = v  # None: evicted since the look: a miss
                inline += len(v) if v is not None else 0
        hits = sum(1 for v in out if v is not None)
        self.counters.add_many({"gets": len(ids), "get_hits": hits, "get_misses": len(ids) - hits,
                                "local_reads": present.count(1) - len(late), "local_inline": len(late),
                                "get_bytes": inline, "get_cut_for_size": cut})
        return out

    def generation(self) -> int:
        """The store's generation (Store.generation): what a same-host reader's view must have
        caught up to before it reads the values get_local_inline answered LOCAL from the files."""
        return self.store.generation

    def put(self, job: str, items: Sequence[tuple[bytes, int, bytes | memoryview]],
            dataset: str = "", chunk: int = -1, replace: bool = False, vouch: bool = False) -> tuple[int, int, int]:
        """Store items; `vouch`: put by a client in this process (inproc.py) that sealed
        them from items it had checked against its digest: vouched for (trust.py)."""
        if len(items) > self.limits.max_batch_items:
            raise BadRequest(f"batch of {len(items)} items exceeds the limit of {self.limits.max_batch_items}")
        total = 0
        for i, (key, size, value) in enumerate(items):
            if len(key) != ID_LEN:
                raise BadRequest(f"items[{i}].id: expected a {ID_LEN}-byte id, got {len(key)} bytes")
            if size != len(value):
                raise BadRequest(f"items[{i}]: declared size {size} but value has {len(value)} bytes")
            if size > self.limits.max_item_bytes:
                raise BadRequest(f"items[{i}]: {size} bytes exceeds the item limit of {self.limits.max_item_bytes}")
            total += size
        if total > self.limits.max_batch_bytes:
            raise BadRequest(f"batch of {total} bytes exceeds the limit of {self.limits.max_batch_bytes}")
        if chunk < -1:
            raise BadRequest(f"chunk must be >= -1, got {chunk}")
        if chunk >= 0 and not dataset:
            raise BadRequest("a chunk tag needs a dataset")
        tag = (dataset, chunk) if dataset else UNTAGGED
        self.counters.add("puts", len(items))
        if replace:
            self.counters.add("put_replaced", len(items))
            self.replacers.add(current_peer(), len(items))
        pairs = [(k, v) for k, _, v in items]
        try:
            if vouch:
                since, written = self.trust.mark(), []
                result = self.store.put_many(pairs, tag, replace, written)
                self.trust.vouch(written, since)
            else:
                with self.trust.foreign_write([k for k, _ in pairs]):
                    result = self.store.put_many(pairs, tag, replace)
        except WriteStopped:  # the store logged why: refused as the puts after it are, not an internal
            # error, which clients take as a failed server whose values they then stop reading too
            held = self.store.held(k for k, _ in pairs)
            self.counters.add_many({"rejected_disk_full": len(pairs) - held, "put_already": held})
            result = (0, held, len(pairs) - held)
        self.claims.release([k for k, _, _ in items])  # stored, or refused: either way, not being read
        return result

    def adopt(self, job: str, ids: Sequence[bytes], dataset: str, chunk: int) -> bytes:
        """A job loading chunk `chunk` of `dataset` takes the ids held as spare
        entries into it, values staying where they are (store.adopt): 1 held
        other than as spare afterwards, 0 absent (the job reads those itself).
        A bypassing job adopts nothing: it sees no cache (every lookup answers
        absent), so it reads those items from the store itself."""
        self._check_ids(ids)
        if not dataset:
            raise BadRequest("adopt needs a dataset")
        if chunk < 0:
            raise BadRequest(f"adopt needs a chunk >= 0, got {chunk}")
        if self.bypassed(job):
            return bytes(len(ids))
        return self.store.adopt(ids, (dataset, chunk))

    def open_follower(self) -> bool:
        """A same-host reader is about to open a follower (localread.py): make
        its replay short. At most one flush per FOLLOWER_FLUSH_INTERVAL, so
        readers that reopen often cannot turn the store into a flush loop."""
        with self._follower_lock:
            now = time.monotonic()
            if now - self._last_follower_flush < FOLLOWER_FLUSH_INTERVAL:
                return False
            flushed = self.store.flush_for_followers()
            if flushed:
                self._last_follower_flush = now
                self.counters.add("follower_flushes")
            return flushed

    # ---- control --------------------------------------------------------
    def set_job_mode(self, job: str, mode: int) -> int:
        if not job:
            raise BadRequest("job must not be empty")
        try:
            CacheMode.of_code(mode)
        except ValueError as e:
            raise BadRequest(str(e)) from None
        with self._modes_lock:
            previous = self._modes.get(job, _NORMAL)
            if mode == _NORMAL:
                self._modes.pop(job, None)
            else:
                self._modes[job] = mode
        return previous

    def job_modes(self) -> dict[str, int]:
        with self._modes_lock:
            return dict(self._modes)

    def _chunk_known(self, dataset: str, chunk: int) -> bool:
        return (dataset, chunk) in self.store.usage_by_tag()

    def ref_chunk(self, dataset: str, chunk: int, job: str) -> int:
        return self.chunks.ref(dataset, chunk, job)

    def unref_chunk(self, dataset: str, chunk: int, job: str) -> int:
        return self.chunks.unref(dataset, chunk, job, self._chunk_known(dataset, chunk))

    def evict_chunk(self, dataset: str, chunk: int, force: bool) -> tuple[int, int]:
        self.chunks.before_evict(dataset, chunk, force, self._chunk_known(dataset, chunk))
        items, freed = self.store.evict_tags(lambda tag: tag == (dataset, chunk))
        self.counters.add("chunk_evictions")
        return items, freed

    def evict_dataset(self, dataset: str) -> tuple[int, int]:
        if not dataset:
            raise BadRequest("dataset must not be empty")
        self.chunks.forget_dataset(dataset)
        items, freed = self.store.evict_tags(lambda tag: tag[0] == dataset)
        self.counters.add("dataset_evictions")
        return items, freed
