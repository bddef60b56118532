"""DataLoader workers hand batches of bytes to the main process through shared memory
that they reuse, not down a pipe.

A DataLoader worker pickles each batch and sends it down a pipe: the worker copies it
into the pickle, the kernel copies it in and out, and the main process unpickles it into
fresh objects. For batches of raw items (bytes, no decode) the main process spent as
much CPU on that as each worker on its reads (0.64-0.75 core-s per GB; docs/benchmarks.md).
Here each worker owns a few slots of one shared region (shmregion.py) made before the
workers start: it copies a batch into a free slot and sends only the slot's number and
the items' ends; the main process copies each item out as `bytes` and frees the slot.
The region is reserved whole when made, and each page is faulted in once per process,
so no batch pays page faults: torch's own shared tensors make a new segment per batch,
which measured slower than the pipe.

Slot states (one byte each, at the head of the region): FREE -> FILLED when a worker
takes one for a batch (under the handoff's lock, before writing it); FILLED -> FREE when
the receiving process reads the worker's message: unpickling it copies the items out and
frees the slot (SlotBatch), whether the batch is used or dropped (an epoch left early).
FILLED is the loader's generation (1-255, a byte after the states) at the time: each epoch
the loader starts a new one, and once torch's reset of its persistent workers has read
every message of the epoch before (it does, to the workers' acknowledgements), a slot
still filled by an older generation lost its message (a Ctrl-C between the pipe's read and
the unpickling) and is freed: FILLED -> FREE (stale_freed).
The lock's acquire and release order each side's copies against the other's. In torch's
DataLoader a worker has at most prefetch_factor batches ahead and the main process reads
one message at a time, so prefetch_factor + 1 slots each suffice. Nothing waits on the
lock for long (a process killed holding it never lets go): a worker that cannot claim a
slot in time keeps to the pipe from then on; any batch that is not all bytes or does not
fit a slot goes down the pipe as before; a slot that cannot be freed in time stays FILLED,
and its worker uses the pipe for that share. The handoff changes how batches travel,
never what arrives.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import weakref
from collections.abc import Sequence
from multiprocessing.context import get_spawning_popen
from typing import Any

from .shmregion import SHM, SharedRegion

FREE, FILLED = 0, 1  # FILLED: the first generation (any state but FREE is filled)
SLOT_CAP = 64 << 20  # a batch bigger than this goes down the pipe
TOTAL_CAP = 1 << 30  # the whole region, all workers' slots
MIN_SLOT = 1 << 20  # smaller slots are not worth the handoff: the pipe is cheap at that size
PAGE = 4096
CLAIM_WAIT_S = 0.2  # a worker that waits longer for the lock sends its batch down the pipe
FREE_WAIT_S = 2.0  # a slot not freed in this long is left FILLED (logged)

log = logging.getLogger(__name__)

# Handoffs by token in this process: a SlotBatch unpickled here finds the one whose slot it names.
_HANDOFFS: "weakref.WeakValueDictionary[bytes, Handoff]" = weakref.WeakValueDictionary()


def slot_bytes(sizes: Sequence[int], batch_size: int, workers: int, slots: int) -> int:
    """Bytes per slot for items of these sizes: enough for the batch_size largest together,
    or for twice an average batch where outliers make that far more, within the caps;
    0 (no handoff) where that leaves less than MIN_SLOT, or the caps leave too little for
    most batches (memory reserved for nothing)."""
    import numpy as np

    sizes = np.asarray(sizes, dtype=np.int64)
    if len(sizes) == 0 or batch_size <= 0 or workers <= 0:
        return 0
    k = min(batch_size, len(sizes))
    largest = int(np.partition(sizes, len(sizes) - k)[len(sizes) - k:].sum())
    average = batch_size * int(sizes.mean())
    want = min(largest, 2 * average)
    if want < MIN_SLOT:  # batches this small cost the pipe little
        return 0
    want = min(want, SLOT_CAP, TOTAL_CAP // (workers * slots))
    if want < min(largest, average * 5 // 4):  # capped below what most batches need
        return 0
    return -(-want // PAGE) * PAGE


class SlotBatch:
    """A batch in a slot, as a worker sends it: the handoff's token, the slot and each item's
    end. It unpickles as the list of items itself: the receiving process copies them out and
    frees the slot as it reads the message, so no slot outlives it and no caller (torch's
    reordering of early batches, a pin-memory thread, a wrapper that rebuilds the
    DataLoader) ever meets a SlotBatch."""

    __slots__ = ("token", "slot", "ends")

    def __init__(self, token: bytes, slot: int, ends: list[int]) -> None:
        self.token, self.slot, self.ends = token, slot, ends

    def __reduce__(self) -> tuple:
        return _unpack, (self.token, self.slot, self.ends)


def _unpack(token: bytes, slot: int, ends: list[int]) -> list[bytes]:
    handoff = _HANDOFFS.get(token)
    if handoff is None:
        raise RuntimeError("a batch in a DataLoader worker's shared-memory slot reached a process that does "
                           "not hold the loader (clients/handoff.py)")
    return handoff.unpack(slot, ends)


class Handoff:
    """`workers` x `slots` slots of `slot` bytes in one shared region, and their states. As a
    collate_fn it packs a worker's batch into a slot; the batch unpacks itself where it arrives."""

    def __init__(self, workers: int, slots: int, slot: int, directory: str = SHM) -> None:
        self.workers, self.slots, self.slot = workers, slots, slot
        self.token = os.urandom(16)
        self._gen_at = workers * slots  # the generation's byte, after the states
        self._base = -(-(self._gen_at + 1) // PAGE) * PAGE  # the states' page(s), then the slots
        self._region = SharedRegion(self._base + workers * slots * slot, directory)
        self._lock = multiprocessing.get_context("spawn").Lock()
        self._attach()
        self._mem[self._gen_at] = FILLED

    def __getstate__(self) -> dict[str, Any]:
        """To the workers as they start (or a process started with the loader); nowhere else,
        checked before the region's file descriptor is duplicated for the trip."""
        if get_spawning_popen() is None:
            raise RuntimeError("a loader's batch handoff (shared memory) goes only to processes as they "
                               "start; make a new loader in the other process instead")
        return {k: self.__dict__[k] for k in ("workers", "slots", "slot", "token", "_gen_at", "_base", "_region",
                                              "_lock")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._attach()

    def _attach(self) -> None:
        self._mem = self._region.view
        self._next = 0  # a worker's next slot to try (its slots are used in turn)
        self._stuck = False  # a worker that once waited too long for the lock keeps to the pipe
        self.handed = 0  # batches received here through the slots
        _HANDOFFS[self.token] = self

    def __call__(self, batch: list) -> list | SlotBatch:
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
        mem, base, pos, ends = self._mem, self._base + slot * self.slot, 0, []
        try:
            for item in batch:
                mem[base + pos:base + pos + len(item)] = item
                pos += len(item)
                ends.append(pos)
        except BaseException:
            self.free(slot)
            raise
        return SlotBatch(self.token, slot, ends)

    def _claim(self, worker: int) -> int | None:
        """One of this worker's FREE slots, now FILLED; None if all are filled (or the lock
        is not to be had)."""
        if self._stuck or not self._lock.acquire(timeout=CLAIM_WAIT_S):
            if not self._stuck:
                log.warning("batch handoff: worker %d found its lock held too long (by a process that died?); "
                            "its batches go down the pipe from now on", worker)
            self._stuck = True
            return None
        try:
            for k in range(self.slots):
                slot = worker * self.slots + (self._next + k) % self.slots
                if self._mem[slot] == FREE:
                    self._mem[slot] = self._mem[self._gen_at]
                    self._next = (self._next + k + 1) % self.slots
                    return slot
        finally:
            self._lock.release()
        return None

    def free(self, slot: int) -> None:
        if not self._lock.acquire(timeout=FREE_WAIT_S):
            log.warning("batch handoff: slot %d left filled (its lock is held by a process that died?); "
                        "its worker's batches go down the pipe instead", slot)
            return
        try:
            self._mem[slot] = FREE
        finally:
            self._lock.release()

    def unpack(self, slot: int, ends: list[int]) -> list[bytes]:
        """The items of a batch in `slot`, as bytes; the slot freed."""
        mem, base, start, items = self._mem, self._base + slot * self.slot, 0, []
        try:
            for end in ends:
                items.append(bytes(mem[base + start:base + end]))
                start = end
        finally:
            self.free(slot)
        self.handed += 1
        return items

    def new_generation(self) -> None:
        """Slots filled from now on belong to a new generation (the loader's next epoch)."""
        if self._lock.acquire(timeout=FREE_WAIT_S):
            try:
                self._mem[self._gen_at] = self._mem[self._gen_at] % 255 + 1
            finally:
                self._lock.release()

    def free_stale(self) -> int:
        """Free the slots an older generation filled, whose messages were lost; call only once
        every message of the older generations was read (how many were freed)."""
        if not self._lock.acquire(timeout=FREE_WAIT_S):
            return 0
        try:
            gen, stale = self._mem[self._gen_at], 0
            for s in range(self.workers * self.slots):
                if self._mem[s] not in (FREE, gen):
                    self._mem[s] = FREE
                    stale += 1
        finally:
            self._lock.release()
        if stale:
            log.info("batch handoff: %d slot(s) filled for batches never received (an interrupted epoch) freed",
                     stale)
        return stale

    def free_slots(self) -> int:
        """Slots FREE now (all of them once every batch sent was received)."""
        return sum(1 for s in range(self.workers * self.slots) if self._mem[s] == FREE)


def shm_room(size: int, path: str = SHM) -> bool:
    """Whether `path` (a memory filesystem) has room for `size` bytes twice over: torch's own
    shared tensors need /dev/shm too (a container's default is 64 MB)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize >= 2 * size


def make_handoff(sizes: Sequence[int], batch_size: int, workers: int, prefetch_factor: int | None,
                 directory: str = SHM) -> Handoff | None:
    """A handoff for a loader's workers: each keeps as many slots as batches it may have
    ahead (prefetch_factor) plus the one being copied out. None where batches would not
    fit a worthwhile slot, or the memory filesystem has no room for the slots."""
    slots = (2 if prefetch_factor is None else prefetch_factor) + 1
    slot = slot_bytes(sizes, batch_size, workers, slots)
    if not slot:
        return None
    size = workers * slots * slot
    try:
        if not shm_room(size, directory):
            raise OSError(f"{directory} has less than twice {size >> 20} MB free")
        return Handoff(workers, slots, slot, directory)
    except OSError as e:
        log.info("batches from DataLoader workers go down a pipe: no shared memory for their slots (%s)", e)
        return None
