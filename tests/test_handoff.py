"""Batches of bytes from DataLoader workers through reused shared memory (clients/handoff.py):
real spawned workers, the embedded cache and a plain torch Dataset."""
import os
import random
import time

import pytest
from torch.utils.data import DataLoader

from clients.handoff import (MIN_SLOT, PAGE, SLOT_CAP, TOTAL_CAP, Handoff, SlotBatch, make_handoff, shm_room,
                               slot_bytes)
from clients.dataset import CachedDataset
from filedigest import write_files_digest


def blobs(n: int, lo: int, hi: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(rng.randint(lo, hi)) for _ in range(n)]


class Blobs:
    """A map-style Dataset of given items: bytes of several sizes, or not bytes."""

    def __init__(self, items: list) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        return self.items[i]


def test_slots_hold_the_largest_batch_within_the_caps():
    sizes = [100_000] * 1000 + [200_000] * 10
    assert slot_bytes(sizes, 64, 2, 3) == -(-(10 * 200_000 + 54 * 100_000) // PAGE) * PAGE
    # outliers: twice an average batch, not the 64 largest together
    huge = [100_000] * 1000 + [5_000_000] * 64
    mean = sum(huge) // len(huge)
    assert slot_bytes(huge, 64, 2, 3) == -(-(2 * 64 * mean) // PAGE) * PAGE < 64 * 5_000_000
    assert slot_bytes([500_000] * 1000 + [20_000_000] * 3, 64, 2, 3) == SLOT_CAP  # one slot's cap
    outliers = [1_000_000] * 1000 + [10_000_000] * 40
    assert slot_bytes(outliers, 32, 6, 3) == -(-(TOTAL_CAP // 18) // PAGE) * PAGE  # the region's cap
    assert slot_bytes(outliers, 32, 8, 3) == 0  # capped below what most batches need: no slots at all
    assert slot_bytes([10 << 20] * 100, 64, 8, 3) == 0
    assert slot_bytes([1000] * 100, 64, 2, 3) == 0  # 64 KB batches: not worth the slots
    assert slot_bytes([1000] * 1000 + [2_000_000], 64, 2, 3) == 0  # nor made so by one outlier
    assert slot_bytes([], 64, 2, 3) == 0
    handoff = make_handoff([200_000] * 100, 8, 2, prefetch_factor=4)
    assert (handoff.workers, handoff.slots, handoff.slot % PAGE) == (2, 5, 0) and handoff.slot >= 8 * 200_000
    assert handoff.free_slots() == 10


def test_no_handoff_without_room_in_shared_memory(tmp_path):
    assert not shm_room(1 << 20, str(tmp_path / "absent"))
    assert shm_room(1 << 20, str(tmp_path))  # the test machine's tmp has a MB to spare
    free = os.statvfs(str(tmp_path)).f_bavail * os.statvfs(str(tmp_path)).f_frsize
    assert not shm_room(free, str(tmp_path))  # room for it once, not twice over
    assert make_handoff([200_000] * 100, 8, 2, None, directory=str(tmp_path / "absent")) is None
    assert make_handoff([200_000] * 100, 8, 2, None, directory=str(tmp_path)) is not None


def test_loader_workers_hand_batches_over_as_bytes(tmp_path):
    items = blobs(120, 20_000, 300_000)
    ds = CachedDataset(write_files_digest(tmp_path / "ds", items), cache_dir=str(tmp_path / "cache"))
    try:
        loader = ds.loader(batch_size=8, num_workers=2, seed=0)  # spawned, persistent
        handoff = loader.handoff
        assert handoff is not None and handoff.workers == 2
        for epoch in range(3):  # a filling epoch, then hits
            got = [x for batch in loader for x in batch]
            assert sorted(got) == sorted(items) and all(type(x) is bytes for x in got), epoch
        assert handoff.handed == 3 * 15  # every batch through a slot
        assert handoff.free_slots() == handoff.workers * handoff.slots
        next(iter(loader))  # an epoch left early: the batches prefetched for it are dropped unread
        got = [x for batch in loader for x in batch]
        assert sorted(got) == sorted(items)
        assert handoff.free_slots() == handoff.workers * handoff.slots  # the dropped ones freed their slots
        assert 4 * 15 < handoff.handed <= 4 * 15 + 1 + 4  # the early epoch's first batch and those dropped
    finally:
        ds.close()


def test_no_handoff_where_items_are_not_bytes_or_batches_are_the_callers(tmp_path):
    items = blobs(40, 150_000, 160_000)  # batches of 8 over 1 MB: worth a handoff
    path = write_files_digest(tmp_path / "ds", items)
    decoded = CachedDataset(path, cache=False, decode=len)
    transformed = CachedDataset(path, cache=False, transform=[len])
    plain = CachedDataset(path, cache=False)
    assert decoded.loader(batch_size=8, num_workers=2).handoff is None
    assert transformed.loader(batch_size=8, num_workers=2, scheduler="torch").handoff is None
    assert plain.loader(batch_size=8, num_workers=2, collate_fn=list).handoff is None
    assert plain.loader(batch_size=8, num_workers=2, persistent_workers=False).handoff is None
    assert plain.loader(batch_size=8, num_workers=0).handoff is None
    assert plain.loader(batch_size=8, num_workers=2).handoff is not None


def train(loader, out) -> None:
    """What torch.multiprocessing.spawn(train, args=(loader,)) runs: the loader's own process."""
    batches = [b for _ in range(2) for b in loader]  # two epochs
    out.put(([type(b).__name__ for b in batches], sorted(x for b in batches for x in b),
             loader.handoff.handed))


@pytest.mark.parametrize("start", ["spawn", "fork"])
def test_a_loader_handed_to_another_process_yields_bytes_there(tmp_path, start):
    import multiprocessing

    items = blobs(64, 150_000, 160_000)
    ds = CachedDataset(write_files_digest(tmp_path / "ds", items), cache=False)
    loader = ds.loader(batch_size=8, num_workers=2)
    ctx = multiprocessing.get_context(start)
    out = ctx.Queue()
    p = ctx.Process(target=train, args=(loader, out))
    p.start()
    kinds, got, handed = out.get(timeout=120)
    p.join(30)
    assert kinds == ["list"] * 16 and got == sorted(items + items) and handed == 16
    assert loader.handoff.free_slots() == loader.handoff.workers * loader.handoff.slots


def hold_lock(handoff, ready) -> None:
    handoff._lock.acquire()
    ready.set()
    time.sleep(600)


def test_a_lock_left_held_by_a_killed_process_costs_the_pipe_not_a_hang(caplog, monkeypatch):
    import multiprocessing

    from clients import handoff as module

    handoff = Handoff(workers=2, slots=3, slot=MIN_SLOT)
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    holder = ctx.Process(target=hold_lock, args=(handoff, ready))
    holder.start()
    assert ready.wait(60)
    holder.kill()
    holder.join(30)
    expect = blobs(16, 1000, 100_000, seed=4)
    loader = DataLoader(Blobs(expect), batch_size=4, num_workers=2, collate_fn=handoff, multiprocessing_context="spawn")
    got = [x for batch in loader for x in batch]
    assert got == expect and handoff.handed == 0  # each worker gave up on the lock, once
    monkeypatch.setattr(module, "FREE_WAIT_S", 0.1)
    handoff._mem[0] = module.FILLED
    handoff.free(0)  # returns, and says why the slot stays filled
    assert handoff._mem[0] == module.FILLED and "left filled" in caplog.text


def test_what_a_slot_cannot_take_goes_down_the_pipe():
    handoff = Handoff(workers=2, slots=3, slot=MIN_SLOT)
    small = blobs(32, 1000, 100_000, seed=1)
    big = blobs(8, 300_000, 400_000, seed=2)  # 4 of them outgrow a slot
    mixed = [(b, i) for i, b in enumerate(blobs(8, 1000, 2000, seed=3))]  # not bytes
    expect = small + big + mixed
    loader = DataLoader(Blobs(expect), batch_size=4, num_workers=2, collate_fn=handoff,
                        multiprocessing_context="spawn")
    got = [x for batch in loader for x in batch]
    assert got == expect
    assert handoff.handed == 8  # the small batches came through slots, the rest piped
    assert handoff.free_slots() == 6
    assert handoff(small[:4]) == small[:4]  # the main process collates nothing into slots


def mlcache_fds() -> int:
    return sum("mlcache-shm" in os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
               if os.path.exists(f"/proc/self/fd/{fd}"))


def test_a_handoff_goes_only_to_processes_as_they_start():
    import copy
    import pickle

    handoff = Handoff(workers=1, slots=1, slot=MIN_SLOT)
    before = mlcache_fds()
    for send in (pickle.dumps, copy.deepcopy):  # torch.save and queues pickle too
        with pytest.raises(RuntimeError, match="only to processes as they start"):
            send(handoff)
    assert mlcache_fds() == before  # nothing duplicated on the way to the error
    with pytest.raises(RuntimeError, match="does not hold the loader"):
        pickle.loads(pickle.dumps(SlotBatch(os.urandom(16), 0, [1])))
