"""DataLoader workers hand batches of bytes to the main process through shared memory
that they reuse, not down a pipe.

A DataLoader worker pickles each batch and sends it down a pipe: the worker copies it
into the pickle, the kernel copies it in and out, and the main process unpickles it into
fresh objects. For batches of raw items (bytes, no decode) the main process spent as
much CPU on that as each worker on its reads (0.6-0.9 core-s per GB; docs/benchmarks.md).
Here each worker owns a few slots of one shared region made before the workers start:
it copies a batch into a free slot and sends only the slot's number and the items' ends;
the main process copies each item out as `bytes` and frees the slot. Every page of the
region is touched once, when it is made, so no batch pays page faults: torch's own
shared tensors make a new segment per batch, which measured slower than the pipe.

Slot states (one byte each, in shared memory): FREE -> FILLED when a worker takes it for
a batch (under the ring's lock, before writing); FILLED -> FREE when the main process
has copied the batch out, or drops it unread (an epoch left early: RingBatch.__del__).
The lock's acquire and release order each side's copies against the other's. A worker
has at most prefetch_factor batches ahead and the main process takes one at a time, so
prefetch_factor + 1 slots each suffice (more batches ahead than that go down the pipe). A batch
that is not all bytes, does not fit a slot, or finds its worker's slots all filled goes
down the pipe as before: the ring changes how batches travel, never what arrives.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import weakref
from collections.abc import Sequence
from typing import Any

FREE, FILLED = 0, 1
SLOT_CAP = 64 << 20  # a batch bigger than this goes down the pipe
TOTAL_CAP = 512 << 20  # the whole region, all workers' slots
MIN_SLOT = 1 << 20  # smaller slots are not worth a ring: the pipe is cheap at that size
PAGE = 4096
SHM = "/dev/shm"  # where multiprocessing puts shared memory on Linux, if it has room

log = logging.getLogger(__name__)

# Rings made in this process, by token: a RingBatch unpickled here finds the ring whose slot
# it names. Workers only unpickle rings, never make them, so their batches free nothing.
_OWNED: "weakref.WeakValueDictionary[bytes, BatchRing]" = weakref.WeakValueDictionary()


def slot_bytes(sizes: Sequence[int], batch_size: int, workers: int, slots: int) -> int:
    """Bytes per slot for items of these sizes: enough for the batch_size largest together,
    or for twice an average batch where outliers make that far more, within the caps;
    0 where that leaves less than MIN_SLOT (no ring)."""
    import numpy as np

    sizes = np.asarray(sizes, dtype=np.int64)
    if len(sizes) == 0 or batch_size <= 0 or workers <= 0:
        return 0
    k = min(batch_size, len(sizes))
    largest = int(np.partition(sizes, len(sizes) - k)[len(sizes) - k:].sum())
    want = min(largest, max(2 * batch_size * int(sizes.mean()), MIN_SLOT))
    want = min(want, SLOT_CAP, TOTAL_CAP // (workers * slots))
    return 0 if want < MIN_SLOT else -(-want // PAGE) * PAGE


class RingBatch:
    """A batch in a slot, as sent from a worker: the slot and each item's end offset."""

    __slots__ = ("token", "slot", "ends", "_ring")

    def __init__(self, token: bytes, slot: int, ends: list[int]) -> None:
        self.token, self.slot, self.ends = token, slot, ends
        self._ring: BatchRing | None = None  # set only where unpickled in the ring's own process

    def __reduce__(self) -> tuple:
        return _rebuild, (self.token, self.slot, self.ends)

    def __del__(self) -> None:
        ring, self._ring = self._ring, None
        if ring is not None:  # dropped unread: free the slot
            try:
                ring.free(self.slot)
            except Exception:  # at interpreter exit the lock may be gone already
                pass


def _rebuild(token: bytes, slot: int, ends: list[int]) -> RingBatch:
    batch = RingBatch(token, slot, ends)
    batch._ring = _OWNED.get(token)
    return batch


class BatchRing:
    """The shared region, `workers` x `slots` slots of `slot` bytes, and their states. As a
    collate_fn it packs a worker's batch into a slot; take() unpacks it in the main process."""

    def __init__(self, workers: int, slots: int, slot: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.workers, self.slots, self.slot = workers, slots, slot
        self.token = os.urandom(16)
        self._mem = ctx.RawArray("B", workers * slots * slot)
        self._states = ctx.RawArray("B", workers * slots)
        self._lock = ctx.RLock()  # re-entrant: a dropped batch may free its slot from a GC pass run under it
        self._view: memoryview | None = None
        self._next = 0  # a worker's next slot to try (its slots are used in turn)
        self.handed = self.piped = 0  # batches through the ring, down the pipe (main process)
        view = self._memory()
        for off in range(0, len(view), PAGE):  # commit every page now: none faults in a batch,
            view[off] = 0  # and a full /dev/shm fails here, not as SIGBUS in a worker
        _OWNED[self.token] = self

    def __getstate__(self) -> dict[str, Any]:  # to the workers, as they are spawned
        return {"workers": self.workers, "slots": self.slots, "slot": self.slot, "token": self.token,
                "_mem": self._mem, "_states": self._states, "_lock": self._lock}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._view, self._next, self.handed, self.piped = None, 0, 0, 0

    def _memory(self) -> memoryview:
        if self._view is None:
            self._view = memoryview(self._mem).cast("B")
        return self._view

    def __call__(self, batch: list) -> list | RingBatch:
        """collate_fn in a worker: the batch in one of this worker's free slots, or as it is."""
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        if info is None or info.id >= self.workers or not all(type(x) is bytes for x in batch):
            return batch
        if sum(map(len, batch)) > self.slot:
            return batch
        slot = self._claim(info.id)
        if slot is None:
            return batch
        mem, off, ends = self._memory(), slot * self.slot, []
        for item in batch:
            mem[off:off + len(item)] = item
            off += len(item)
            ends.append(off)
        return RingBatch(self.token, slot, ends)

    def _claim(self, worker: int) -> int | None:
        """One of this worker's FREE slots, now FILLED; None if all are filled."""
        with self._lock:
            for k in range(self.slots):
                slot = worker * self.slots + (self._next + k) % self.slots
                if self._states[slot] == FREE:
                    self._states[slot] = FILLED
                    self._next = (self._next + k + 1) % self.slots
                    return slot
        return None

    def free(self, slot: int) -> None:
        with self._lock:
            self._states[slot] = FREE

    def take(self, batch: Any) -> Any:
        """In the main process: a RingBatch's items as bytes (its slot freed); any other
        batch as it came."""
        if type(batch) is not RingBatch or batch._ring is not self:
            self.piped += 1
            return batch
        batch._ring = None  # freed here, not again when it is dropped
        mem, start, items = self._memory(), batch.slot * self.slot, []
        try:
            for end in batch.ends:
                items.append(bytes(mem[start:end]))
                start = end
        finally:
            self.free(batch.slot)
        self.handed += 1
        return items

    def free_slots(self) -> int:
        """Slots FREE now (all of them once every batch handed over was taken or dropped)."""
        with self._lock:
            return sum(1 for s in self._states if s == FREE)


def shm_room(size: int, path: str = SHM) -> bool:
    """Whether `path` (a memory filesystem) has room for `size` bytes twice over: torch's own
    shared tensors need /dev/shm too. Where it has not (a container's 64 MB default, or no
    /dev/shm at all), multiprocessing would back the region with a file on disk instead."""
    try:
        st = os.statvfs(path)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize >= 2 * size


def batch_ring(sizes: Sequence[int], batch_size: int, workers: int, prefetch_factor: int | None) -> BatchRing | None:
    """A ring for a loader's workers: each keeps as many slots as batches it may have
    ahead (prefetch_factor) plus the one the main process is copying out. None where
    batches would not fit a worthwhile slot, or /dev/shm has no room for them."""
    slots = (2 if prefetch_factor is None else prefetch_factor) + 1
    slot = slot_bytes(sizes, batch_size, workers, slots)
    if not slot:
        return None
    if not shm_room(workers * slots * slot):
        log.info("batches from DataLoader workers go down a pipe: %s has no room for %d MB of slots",
                 SHM, workers * slots * slot >> 20)
        return None
    return BatchRing(workers, slots, slot)
