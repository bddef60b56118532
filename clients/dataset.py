"""CachedDataset: a map-style torch Dataset over a digest, read through the cache.

    ds = CachedDataset("imagenet.digest", cache="10.0.0.1:7000,10.0.0.2:7000")
    for batch in ds.loader(batch_size=256, num_workers=8):
        ...

cache: None = the embedded default (an in-process server under cache_dir),
"host:port,..." = a ring (one address is expanded to its --peers), False = no
cache (read the store only; a baseline).

Reads: batched get from the ring; each value is decrypted and verified
(capability.py); a miss or a poisoned value is read from the store through
fsspec, sealed, and inserted (overwriting a poisoned one); before reading,
the misses are claimed on their servers, so that a miss another job is
already reading is awaited rather than read twice (`claims`; across hosts:
cacheserver/claims.py; `coalesce` is the same-host flock fallback when
claims are off). The object is
picklable: each process (main, every DataLoader worker) opens its own
connections, filesystem and thread pool on first use.

keep_freed_memory (default True): on first use each process sets glibc's
mmap and trim thresholds (cacheserver/malloc.py), so the megabyte buffers of
each batch reuse freed memory instead of page-faulting in fresh memory.
This cut the jobs' CPU by about 12% in tools/bench/partial. The process
then keeps its peak heap. Pass False to leave the allocator alone.
"""
from __future__ import annotations

import logging
import operator
import os
import pickle
import socket
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from cacheserver import inproc
from cacheserver.core import Limits
from cacheserver.client.ring_client import RingClient, parse_spec
from cacheserver.runtime import split_hostport
from cacheserver.sizes import parse_size
from cacheserver.vocab import HIT, PENDING

from . import capability, checked, fill, inserts, itemview, readwatch
from .coordination import JobCoordinator, SharedPlan
from .digest import Digest, Kind
from .storeread import read_items
from .embedded import DEFAULT_CAPACITY, EmbeddedCache
from .procstate import DatasetClosed, ProcessState, close_after, per_process, take
from .samples import Samples
from .stats import SharedCounters

log = logging.getLogger("clients.dataset")
GET_BYTES = 64 << 20  # a batch's items read in gets of at most this: a server answers up to its --max-batch-size
# ids one request may carry: a server refuses a request of more whole (BadRequest). Not announced
# in Info nor set by a flag, so every server's is the default
MAX_IDS = Limits.max_batch_items


def by_parts(fn: Callable[[Sequence], list], keys: Sequence, n: int = MAX_IDS) -> list:
    """fn on keys in parts of at most n (MAX_IDS): its answers, in order (no copy of a batch
    that fits in one: the sampler's look-ahead calls this every batch)."""
    if len(keys) <= n:
        return fn(keys)
    return [x for k in range(0, len(keys), n) for x in fn(keys[k:k + n])]

try:  # torch is an extra: the rest of the package works without it
    from torch.utils.data import Dataset as _TorchDataset
except ImportError:  # pragma: no cover - exercised only without the torch extra
    _TorchDataset = object


class CachedDataset(_TorchDataset):
    def __init__(self, digest: str | os.PathLike | Digest, cache: str | None | bool = None,
                 manager: str | None = None, job: str | None = None,
                 decode: Callable[..., Any] | None = None,
                 storage_options: dict | None = None, *,
                 target: str | Callable[[itemview.Entry], Any] | None = None,
                 samples: bool | None = None,
                 cache_dir: str | None = None, capacity: int | str = DEFAULT_CAPACITY,
                 verify_hash: bool = True, insert: bool = True, fetch_threads: int = 16,
                 coalesce: bool = True, claims: bool = True, down_backoff: float = 2.0,
                 n_gpus: int = 1, keep_freed_memory: bool = True, transform: Any = None,
                 read_warning: float | None = readwatch.READ_WARNING_S) -> None:
        _not_while_spawning()
        readwatch.check(read_warning)
        self.read_warning = read_warning  # seconds a store read may hang before a warning (readwatch.py)
        # absolute: workers reload it from there, whatever their working directory
        self._digest_path = None if isinstance(digest, Digest) else os.path.abspath(os.fspath(digest))
        self.digest = digest if isinstance(digest, Digest) else Digest.load(digest)
        if len(self.digest) == 0:
            raise ValueError(f"digest {digest} holds no items")
        self._set_view(decode, target, samples, str(digest))
        # a preprocess.Pipeline (or a list of steps): the loader runs it per sample in its workers
        self.transform = _as_pipeline(transform)
        self.storage_options = dict(storage_options or {})
        self.job = job or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.verify_hash = verify_hash
        self.insert = insert
        if fetch_threads < 1:
            raise ValueError(f"fetch_threads must be >= 1 (concurrent store reads), got {fetch_threads}")
        self.fetch_threads = fetch_threads  # fewer on a local disk (readthreads.py)
        self.coalesce = coalesce
        self.claims = claims
        self.down_backoff = down_backoff
        self.keep_freed_memory = keep_freed_memory
        self.dataset_tag = self.digest.fingerprint.hex()  # the name the manager evicts by
        self._stale_digest: str | None = None  # set in a worker whose reload of the digest file differs
        self.manager = manager
        self.plan = SharedPlan()  # without a manager: insert everything as chunk 0
        self.coordinator: JobCoordinator | None = None
        self.embedded: EmbeddedCache | None = None
        self._state: ProcessState | None = None
        self._closed = False  # close() ran in this process (or before this copy was pickled)
        self._draining: threading.Thread | None = None  # close()'s coordination thread, still ending
        if isinstance(cache, str):
            if not cache.strip(" ,"):
                raise ValueError(f"cache={cache!r} names no server: pass 'host:port[,host:port...]', "
                                 f"cache=None for the embedded cache or cache=False for none")
            parse_spec(cache)  # a malformed address fails here, not at the first batch
        try:
            self._connect(cache, manager, n_gpus, bool(job), cache_dir, capacity)
        except BaseException:
            # a registered job and its token file (or a started embedded cache) outlived the
            # error: the corrected retry of a job= was refused as "held by a running process"
            try:
                self.close()
            except Exception:  # the error raised is the construction's, not the clean-up's
                log.exception("closing a CachedDataset whose construction failed")
            raise
        self.counters = SharedCounters()
        self._ids: list[bytes | None] | None = None

    def _connect(self, cache: str | None | bool, manager: str | None, n_gpus: int, named: bool,
                 cache_dir: str | None, capacity: int | str) -> None:
        """Register the job with the manager (taking its ring where no cache is given), then
        set the cache up (_set_cache)."""
        if manager is not None:
            split_hostport(manager, "cache manager address")
            self.coordinator = JobCoordinator(self, manager, n_gpus, keep_token=named)
            if cache is None:
                cache = self.coordinator.ring_spec()
                if cache is None:
                    why = ("knows no cache servers yet" if self.coordinator.reached
                           else "cannot be reached and no ring of it is saved")
                    raise ValueError(f"cache manager {manager} {why}, and no cache= addresses were given")
        self._set_cache(cache, cache_dir, capacity)

    def _set_cache(self, cache: str | None | bool, cache_dir: str | None, capacity: int | str) -> None:
        """The ring every process reads (cache_spec: resolved addresses, or None for no
        cache), the embedded cache when `cache` is None, and how hits are checked."""
        if cache is not None and not isinstance(cache, (str, bool)):
            raise TypeError(f"cache must be None (the embedded default), False (no cache) or cache server "
                            f"addresses as 'host:port[,host:port...]', got {type(cache).__name__} {cache!r}")
        if cache is False:  # no cache at all: every read goes to the store (a baseline)
            cache = None
        elif cache is True:
            raise ValueError("cache=True names no cache: pass None (the embedded default), False (no cache) "
                             "or cache server addresses 'host:port[,host:port...]'")
        elif cache is None:
            self.embedded = EmbeddedCache.shared(cache_dir, parse_size(capacity))
            cache = self.embedded.address
        # one ring for the main process and every DataLoader worker
        self.cache_spec = ",".join(RingClient.resolve(cache)) if cache else cache
        # an embedded cache in this process (ours or another's) keeps plain items: docs/security.md
        self.plain_records = inproc.plain_store(self.cache_spec)
        self.checked_table = None  # shared by the processes a loader spawns (_share_checked)

    def hashes_hits(self) -> bool:
        """Whether values from the cache are hashed against the digest (step 4): with
        verify_hash, from any cache but a plain store. checked.py then spares a value read again."""
        return self.verify_hash and bool(self.cache_spec) and not self.plain_records

    def _share_checked(self) -> None:
        """The table of values checked against the digest (checked.py) in shared memory, for
        the processes a loader spawns: made once, and only then (up to 8 MB of /dev/shm)."""
        if self.checked_table is None and self.hashes_hits():
            self.checked_table = checked.new_table(len(self.digest), shared=True)

    def _set_view(self, decode: Callable[..., Any] | None, target: Any, samples: bool | None,
                  source: str) -> None:
        """What an index yields: decode, target and, for tar shards, WebDataset samples
        (members sharing a key) unless samples=False. Tar digests made before format 2
        lack member names: one item per member, as before."""
        itemview.check_target(target, self.digest, source)
        self.target = target
        self.decode = decode
        self._decode_entry = decode is not None and itemview.takes_entry(decode)
        if samples is None:
            samples = self.digest.kind is Kind.TAR and self.digest.has_names
        if samples and self.digest.kind is not Kind.TAR:
            raise ValueError(f"samples=True groups tar members into WebDataset samples; digest {source} "
                             f"is of kind {self.digest.kind.value}")
        self.samples = Samples(self.digest) if samples else None

    # ---- pickling: per-process state is rebuilt, the digest travels as bytes
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_state"] = None
        state["embedded"] = None  # owned by the process that started it
        state["coordinator"] = None  # the main process talks to the manager
        state["_ids"] = None  # cheap to derive again
        state["_draining"] = None  # a thread of this process
        # Workers reload the digest from its file (fast), else from its bytes.
        state["digest"] = None if self._digest_path else self.digest.to_bytes()
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self.counters is None:  # pickled for another machine (remote_copy)
            self.counters, self.plan = SharedCounters(), SharedPlan()
        raw = state["digest"]
        self.digest = Digest.load(self._digest_path) if raw is None else Digest.from_bytes(raw)
        # Raised at the first read, not here: a worker that fails to unpickle dies without saying why
        self._stale_digest = None if self.digest.fingerprint.hex() == self.dataset_tag else (
            f"digest file {self._digest_path} changed since this dataset was made: a DataLoader worker "
            f"would read other items than the main process samples; write a new digest to a new path "
            f"(or make the dataset again after replacing it)")
        if self.samples is not None:
            self.samples.rebind(self.digest)

    def remote_copy(self, transform: Any = None) -> bytes:
        """This dataset pickled for a process on another machine (a remote preprocessing
        worker): the digest as bytes, no shared memory, no manager connection. Where a
        manager plans the cache budget the copy inserts no source items it reads."""
        clone = CachedDataset.__new__(CachedDataset)
        clone.__dict__.update(self.__dict__)
        clone.__dict__.update(_digest_path=None, counters=None, plan=None, manager=None, checked_table=None,
                              insert=self.insert and self.manager is None,
                              transform=self.transform if transform is None else transform)
        return pickle.dumps(clone)  # __getstate__: the digest as bytes (no path), no process state

    def _proc(self) -> ProcessState:
        if self._closed:
            st = self._state
            if st is not None and st.pid == os.getpid() and threading.current_thread() is self._draining:
                return st  # the coordination thread ending its step: the state closes once it ends
            self.check_open()
        return per_process(self, "_state", lambda: ProcessState(self))

    def check_open(self) -> None:
        """DatasetClosed once close() ran in this process (or before this copy was pickled)."""
        if self._closed:
            raise DatasetClosed(f"this CachedDataset (digest {self._digest_path or self.digest.root}) was "
                                f"closed: make a new one to read again")

    # ---- ids ------------------------------------------------------------
    def ids_for(self, indices: Sequence[int]) -> list[bytes]:
        """Cache ids of items, derived once per process and kept (33 bytes an item):
        the sampler looks each item up several times an epoch."""
        if self._ids is None:
            self._ids = [None] * len(self.digest)
        ids, h = self._ids, self.digest.hashes
        out = []
        for i in indices:
            v = ids[i]
            if v is None:
                v = ids[i] = capability.item_id(h[i].tobytes())
            out.append(v)
        return out

    def lookup(self, indices: Sequence[int], not_spare: bool = False) -> list[bool]:
        """Which items are cached now (with not_spare: other than as spare entries,
        which any insert evicts first; see cacheserver/store.py)."""
        ring = self._proc().ring
        if ring is None:
            return [False] * len(indices)
        return by_parts(lambda ids: ring.lookup(ids, self.job, not_spare), self.ids_for(indices))

    def lookup_codes(self, indices: Sequence[int]) -> list[int]:
        """The sampler's cheap look-ahead: 1 cached, 0 not, 2 (vocab.PENDING)
        not yet, but another job is reading it from the store now. Indices are the
        dataset's: WebDataset samples are cached when all their members are."""
        ring = self._proc().ring
        if ring is None:
            return [0] * len(indices)
        items = indices if self.samples is None else self.samples.flatten(indices)
        if self.claims and self.insert:
            codes = by_parts(lambda ids: ring.lookup_pending(ids, self.job), self.ids_for(items))
        else:
            codes = [int(p) for p in by_parts(lambda ids: ring.lookup(ids, self.job), self.ids_for(items))]
        return codes if self.samples is None else self.samples.combine_codes(indices, codes, HIT, PENDING)

    def plan_hooks(self) -> tuple[Callable[[int], bool] | None, Callable[[list[int]], None] | None,
                                  Callable[[Sequence[int] | None], None] | None]:
        """The manager's chunk plan, on dataset indices: (prefer, consumed, expect) for the
        sampler: which misses to read first, what a batch consumed, what an epoch reads."""
        coord, smp = self.coordinator, self.samples
        if coord is None:
            return None, None, None
        if smp is None:
            return coord.prefer, coord.consumed, coord.expect
        return ((lambda s: coord.prefer(smp.first_member(s))), (lambda b: coord.consumed(smp.flatten(b))),
                (lambda e: coord.expect(None if e is None else smp.flatten(e))))

    @property
    def classes(self) -> list[str]:
        """Class names by target, as torchvision's ImageFolder (tools/digest --targets dir)."""
        return self.digest.classes

    @property
    def class_to_idx(self) -> dict[str, int]:
        return {c: k for k, c in enumerate(self.digest.classes)}

    def entry(self, index: int) -> itemview.Entry:
        """Metadata of dataset index `index` (an item, or a WebDataset sample)."""
        return self._entry(self._index(index) if self.samples is None else self._sample_index(index))

    # ---- reads ----------------------------------------------------------
    def __len__(self) -> int:
        return len(self.digest) if self.samples is None else len(self.samples)

    def __getitem__(self, index: int) -> Any:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """read(), then the transform (on the sample of a (sample, target) pair), in order,
        in this process (the loader schedules it per sample instead)."""
        out = self.read(indices)
        if self.transform is not None:
            t = self.transform
            out = [(t(x[0]), x[1]) for x in out] if self.target is not None else [t(x) for x in out]
        return out

    def read(self, indices: Sequence[int]) -> list[Any]:
        """Items (or sample dicts), decoded, as (sample, target) pairs when target= is set;
        before any transform."""
        if self._stale_digest:
            raise ValueError(self._stale_digest)
        if self.samples is None:
            indices = self._indices(indices)
            out = self._read(indices)
        else:
            indices = [self._sample_index(i) for i in indices]
            out = self.samples.assemble(self.digest, indices, self._read(self.samples.flatten(indices)))
        if self.decode is None and self.target is None:
            return out
        # Entries only for whom reads them: a plain decode(data) pays nothing per item for them
        ents = ([self._entry(i) for i in indices] if self._decode_entry or self.target is not None
                else [None] * len(indices))
        if self.decode is not None:
            out = [self._decode(i, e, x) for i, e, x in zip(indices, ents, out)]
        if self.target is not None:
            out = [(x, itemview.target_of(self.target, e)) for e, x in zip(ents, out)]
        return out

    def _entry(self, i: int) -> itemview.Entry:
        """The Entry of a checked dataset index: an item, or a WebDataset sample."""
        if self.samples is None:
            return itemview.entry(self.digest, i, [i])
        return itemview.entry(self.digest, i, self.samples.flatten([i]), self.samples.key(i))

    def _sample_index(self, i: Any) -> int:
        n = len(self.samples)
        try:
            j = operator.index(i)
        except TypeError:
            raise TypeError(f"sample index must be an integer, got {type(i).__name__} {i!r}") from None
        j = j + n if j < 0 else j
        if not 0 <= j < n:
            raise IndexError(f"sample {i} out of range for {n} WebDataset samples")
        return j

    def _read(self, indices: list[int]) -> list[bytes]:
        """Digest items' bytes: from the cache, else the store (inserted), verified. A batch of
        large items is read in parts of GET_BYTES, or of a server's smaller --max-batch-size:
        a get's answer past it is cut, and the items cut off would be misses every epoch.
        Their values are sealed: capability.OVERHEAD bytes each beyond the item. More than
        MAX_IDS items are read in parts of MAX_IDS: their misses' claims and puts too."""
        n = len(indices)
        if n > MAX_IDS:
            return by_parts(self._read, indices)
        st = self._proc()
        limit = inserts.batch_bytes(st.ring, GET_BYTES, st.core) if n > 1 else GET_BYTES
        per = capability.OVERHEAD
        sizes = self.digest.sizes[indices] + per if n > 1 and n * (self.digest.largest + per) > limit else None
        if sizes is None or int(sizes.sum()) <= limit:  # the usual batch: one get
            return self._read_part(indices)
        parts = inserts.split_by_bytes(list(range(n)), sizes.tolist(), limit)
        return [x for part in parts for x in self._read_part([indices[j] for j in part])]

    def _read_part(self, indices: list[int]) -> list[bytes]:
        st = self._proc()
        n = len(indices)
        ids = self.ids_for(indices)
        out: list[Any] = [None] * n
        if st.core is not None and self.plain_records:
            values, vouched, since = inproc.get_plain(st.core, self.job, ids), None, None
        elif st.core is not None:
            values, vouched, since = inproc.get_vouched(st.core, self.job, ids)
        else:
            values = st.ring.get(ids, self.job) if st.ring is not None else [None] * n
            vouched, since = None, None
        opened = self._open_many(st, indices, values, vouched, (ids, since))
        todo, poisoned, cache_bytes = [], set(), 0
        for j, v in enumerate(values):
            item = opened[j]
            if item is None:
                todo.append(j)
                if v is not None:
                    poisoned.add(j)
            else:
                out[j] = item
                cache_bytes += len(v)
        counts = dict(hits=n - len(todo), misses=len(todo), cache_bytes=cache_bytes, poisoned=len(poisoned),
                      vouched=sum(1 for j in range(n) if vouched[j] and opened[j] is not None) if vouched else 0)
        if todo:
            items, filled = fill.fill(self, st, [indices[j] for j in todo], [ids[j] for j in todo],
                                      [j in poisoned for j in todo])
            for j, item in zip(todo, items):
                out[j] = item
            counts["poisoned"] += filled.pop("poisoned")  # found while waiting for another reader
            counts.update(filled)
        self.counters.add(**counts)
        return out

    def _indices(self, indices: Sequence[int]) -> list[int]:
        """Item indices checked and made non-negative: a batch of plain ints in range (what
        samplers give) in one pass, others one by one (their errors name the index)."""
        n, out = len(self.digest), list(indices)
        if all(type(i) is int and 0 <= i < n for i in out):
            return out
        return [self._index(i) for i in out]

    def _index(self, i: Any) -> int:
        try:
            return self.digest.index(operator.index(i))
        except TypeError:
            raise TypeError(f"item index must be an integer, got {type(i).__name__} {i!r}") from None

    def _decode(self, i: int, e: itemview.Entry | None, data: Any) -> Any:
        try:
            return self.decode(data, e) if self._decode_entry else self.decode(data)
        except Exception as err:  # the user's own error, kept, with which item it was
            e = e or self._entry(i)
            what = "item" if self.samples is None else "sample"
            err.add_note(f"while decoding {what} {e.index} of {self.digest.root} "
                         f"({e.path} @ {e.offset}+{e.length})")
            raise

    def _open_many(self, st: ProcessState, indices: Sequence[int],
                   values: list[memoryview | None], vouched: list[bool] | None = None,
                   read: tuple[list[bytes], inproc.Since] | None = None) -> list[bytes | None]:
        """_open for a batch: decrypt in this thread (split over threads it ran slower:
        tools/bench/hitfloor), then check the hashes split over up to procstate.HASH_THREADS
        threads (hashlib and blake3 let go of the GIL): BLAKE3 where the digest carries
        it (version 3), several times faster than the SHA-256 (K) that older digests are
        checked against. Values the in-process server vouches for (put or checked by this
        process, written by nobody else since: cacheserver/trust.py) skip the hash; those
        checked here are vouched for from now on (`read`: their ids and when they were read).
        Values from a server that this process checked before as the same bytes skip the
        hash too (checked.py). A plain store's values get a size check only (docs/security.md)."""
        sizes = self.digest.sizes[list(indices)].tolist()
        if self.plain_records:
            return capability.open_plain(values, sizes)
        ids = read[0] if read is not None else self.ids_for(indices)
        keys = [self.digest.hashes[i].tobytes() for i in indices]
        items = capability.open_values(keys, ids, values, sizes)
        if self.verify_hash:
            todo = [j for j, item in enumerate(items) if item is not None and not (vouched and vouched[j])]
            pairs = list(zip(self.expected_hashes([indices[j] for j in todo]), [items[j] for j in todo]))
            todo, pairs, memo, known = checked.unknown(st.checked, ids, values, todo, pairs)
            if known:  # checked before as these very bytes: as good as vouched
                self.counters.add(vouched=known)
            hash_fn = capability.sha256 if self.digest.blake3 is None else capability.blake3
            for j, ok in zip(todo, capability.hashes_match(pairs, st.hash_pool, st.hash_threads,
                                                           hash_fn=hash_fn)):
                if not ok:
                    items[j] = None  # forged by a holder of the key: poisoned
            if memo:
                ok = [p for p, j in enumerate(todo) if items[j] is not None]
                st.checked.remember([memo[p] for p in ok], [values[todo[p]] for p in ok])
            if st.core is not None and read is not None and read[1] is not None:
                inproc.vouch(st.core, [read[0][j] for j in todo if items[j] is not None], read[1])
        return items

    def expected_hashes(self, indices: Sequence[int]) -> list[bytes]:
        """The hash each item is checked against (step 4): its BLAKE3 where the digest
        carries it, else its SHA-256 (K)."""
        b3 = self.digest.blake3
        return ([b3[i].tobytes() for i in indices] if b3 is not None
                else [self.digest.sha256(i) for i in indices])

    def open_item(self, i: int, value: memoryview) -> bytes | None:
        """Decrypt and verify a cached value; None if it is poisoned."""
        return self._open_many(self._proc(), [i], [value])[0]

    def read_store(self, st: ProcessState, indices: list[int]) -> list[bytes]:
        """Items from the store, always checked against the digest (ItemMismatch
        names a changed item: stale data never reaches training). verify_hash
        only governs cache reads. Items bound for a plain dir: by the SHA-256 of their ids.
        Marked in flight meanwhile: a read that hangs is warned about (readwatch.py)."""
        warn = self.read_warning
        key = readwatch.WATCH.begin(warn, self.digest, indices) if warn is not None and indices else None
        try:
            return read_items(self.digest, indices, st.fs, verify=True, by_key=self.plain_records and self.insert,
                              concurrency=st.read_threads, pool=st.pool)
        finally:
            if key is not None:
                readwatch.WATCH.end(key)

    def prefetch(self, indices: Sequence[int]) -> None:
        """Fetch and insert items ahead of need (the loading chunk); not counted as reads.
        Items the cache holds as spare entries join their chunk where they lie
        (adopt: no value travels); the rest come from the store."""
        indices = list(indices)
        if len(indices) > MAX_IDS:  # adopts, claims and puts of at most MAX_IDS ids each
            for k in range(0, len(indices), MAX_IDS):
                self.prefetch(indices[k:k + MAX_IDS])
            return
        st = self._proc()
        n = len(indices)
        ids = self.ids_for(indices)
        if st.ring is not None and self.insert:
            groups: dict[int, list[int]] = {}
            for p, i in enumerate(indices):
                chunk = self.plan.insert_chunk(i)
                if chunk is not None and chunk >= 0:
                    groups.setdefault(chunk, []).append(p)
            held: set[int] = set()
            for chunk, ps in groups.items():
                got = st.ring.adopt([ids[p] for p in ps], self.job, self.dataset_tag, chunk)
                held.update(p for p, h in zip(ps, got) if h)
            keep = [p for p in range(n) if p not in held]
            indices, ids = [indices[p] for p in keep], [ids[p] for p in keep]
        _, filled = fill.fill(self, st, indices, ids, [False] * len(ids))
        self.counters.add(store_bytes=filled["store_bytes"], inserted=filled["inserted"],
                          poisoned=filled["poisoned"], prefetched=n)

    # ---- loader ---------------------------------------------------------
    def loader(self, batch_size: int, num_workers: int | None = 0, seed: int = 0, lookahead: int = 10,
               substitute: bool = True, miss_seed: int | None = None, *, drop_last: bool = False,
               rank: int | None = None, world_size: int | None = None, **dataloader_kwargs):
        """A torch DataLoader whose batch sampler fills batches with cached items first.

        `seed` fixes this job's order. Which misses it reads first is drawn afresh per
        loader, so jobs with equal seeds still spread their store reads; `miss_seed`
        fixes that too, for a run that repeats exactly given the same cache contents.
        `rank`/`world_size` (default: torch.distributed's when initialised) give each
        rank its share of every epoch; the loader has state_dict()/load_state_dict().
        With a `transform`, the pipeline runs per sample in preprocess workers
        (docs/preprocess.md: num_workers=None adapts their count; auto_order, on_error,
        cost_dir; scheduler="torch" runs it in DataLoader workers instead)."""
        from .loader import make_loader

        self.check_open()  # a loader of a closed dataset could read nothing
        if num_workers != 0:  # workers (or preprocess workers, None) share what each checked
            self._share_checked()
        return make_loader(self, batch_size, num_workers=num_workers, seed=seed, lookahead=lookahead,
                           substitute=substitute, miss_seed=miss_seed, drop_last=drop_last,
                           rank=rank, world_size=world_size, **dataloader_kwargs)

    def close(self) -> None:
        """Let go of what the dataset holds in this process: its job at the manager, the
        process's clients and threads, its share of the embedded cache. Reads after it raise
        DatasetClosed; closing again does nothing. A coordination thread that outlives the
        coordinator's close() (amid a slow store read) keeps the process state until it ends."""
        self._closed = True
        coord = take(self, "coordinator")
        if coord is not None:
            self._draining = coord._thread  # may use the state while coord.close() waits for it
            coord.close()
            if self._draining is not None and self._draining.is_alive():
                close_after(self._draining, self._release)
                return
        if self._draining is None or not self._draining.is_alive():  # else close_after releases
            self._release()

    def _release(self) -> None:
        state = take(self, "_state")
        if state is not None:
            state.close()
        embedded = take(self, "embedded")
        if embedded is not None:
            embedded.release()  # closed when no other dataset of this process shares it


def _as_pipeline(transform: Any) -> Any:
    if transform is None:
        return None
    from preprocess.pipeline import as_pipeline
    return as_pipeline(transform)


def _not_while_spawning() -> None:
    """A DataLoader worker is spawned: it imports the main script again. Code that makes a
    dataset there must sit under `if __name__ == "__main__":`; say so in plain words."""
    import multiprocessing

    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise RuntimeError(
            "CachedDataset created while a spawned process (a DataLoader worker) imports your main "
            "script: workers are spawned and re-import it, so put the code that makes the dataset and "
            "iterates the loader under `if __name__ == \"__main__\":` (see README)")

