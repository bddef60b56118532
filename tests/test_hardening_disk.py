"""Issue 12 item 4: under LRU churn at several times --capacity, the data dir's
bytes on disk (as `du` counts them) stay within the capacity; a real daemon."""
import hashlib
import os
import threading
import time

import numpy as np

from cacheserver.client.server_client import ServerClient
from procs import cacheserver

CAPACITY = 48 << 20
ITEM = 128 << 10
CHURN = 3  # capacities' worth of new items
LIMIT_S = 240.0


def du(path: str) -> int:
    """Allocated bytes under ``path``, as `du` counts them."""
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_blocks * 512
            except FileNotFoundError:  # a compaction removed it meanwhile
                pass
    return total


class DuSampler(threading.Thread):
    def __init__(self, path: str) -> None:
        super().__init__(daemon=True)
        self.path, self.peak, self.stop = path, 0, threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.05):
            self.peak = max(self.peak, du(self.path))


def test_disk_use_stays_within_capacity_under_churn(tmp_path):
    data = str(tmp_path / "d")
    s = cacheserver(data, str(CAPACITY), 0, "--unix-socket", "off").start()
    sampler = DuSampler(data)
    sampler.start()
    try:
        recent: dict[bytes, bytes] = {}
        rng = np.random.default_rng(12)
        deadline = time.monotonic() + LIMIT_S
        with ServerClient(s.address, local_read=False) as c:
            for _ in range(CHURN * CAPACITY // (16 * ITEM)):
                items = []
                for _ in range(16):
                    v = rng.bytes(ITEM)  # incompressible
                    items.append((hashlib.sha256(v).digest(), v))
                c.put(items)
                recent = dict(items)
                assert time.monotonic() < deadline, "churn did not finish in time"
            time.sleep(1.0)
            st = c.stats()
            got = c.get(list(recent))
        sampler.stop.set()
        sampler.join()
        end = du(data)
        assert all(g is not None and bytes(g) == recent[k] for k, g in zip(recent, got))  # the last batch is held
        assert st.counters["evicted_items"] > 0 and st.used_bytes <= CAPACITY
        assert sampler.peak <= 1.10 * CAPACITY, f"du peaked at {sampler.peak / CAPACITY:.2f}x --capacity"
        assert end <= CAPACITY, f"du ended at {end / CAPACITY:.2f}x --capacity"
    finally:
        sampler.stop.set()
        assert s.stop() == 0


def test_room_waits_for_dead_bytes_and_evicts_only_what_they_lack():
    from cacheserver.diskbudget import SLACK, OnDisk, headroom, room
    cap = 100 << 20
    budget = cap - headroom(cap)
    # Room left: admitted, nothing evicted.
    assert room(cap, OnDisk(50 << 20, 5 << 20), 0, 50 << 20, 0, 1 << 20) == (budget - (55 << 20), 0)
    # Full on disk, 30 MiB of evicted values not compacted yet: wait, evict nothing.
    full = OnDisk(budget - (5 << 20), 5 << 20)
    assert room(cap, full, 0, budget - (35 << 20), 0, 1 << 20) == (0, 0)
    # Full, nothing dead: evict the put and the slack ahead.
    used = full.tables * 100 // 102 + 1  # the table files hold nothing but live entries
    assert room(cap, full, 0, used, 0, 1 << 20) == (0, (1 << 20) + int(cap * SLACK))
    # Waiting did not help (no compaction ran): what looked dead is not.
    assert room(cap, full, 0, budget - (35 << 20), 0, 1 << 20, stuck=True)[1] == (1 << 20) + int(cap * SLACK)


def test_putting_held_ids_again_evicts_nothing_when_full(tmp_path):
    from cacheserver.counters import Counters
    from cacheserver.eviction import LRUPolicy
    from cacheserver.store import Store
    s = Store(str(tmp_path / "s"), CAPACITY, LRUPolicy(), Counters())
    try:
        rng = np.random.default_rng(7)
        held = []
        for _ in range(CAPACITY // (8 * ITEM)):  # fill until the files on disk leave no room
            items = [(hashlib.sha256(v).digest(), v) for v in (rng.bytes(ITEM) for _ in range(8))]
            s.put_many(items)
            held = items
        s.flush()
        before = s.counters.snapshot()
        t0 = time.monotonic()
        assert s.put_many(held) == (0, len(held), 0)  # co-operative misses put held ids again
        after = s.counters.snapshot()
        assert after["evicted_items"] == before["evicted_items"] and after["disk_waits"] == before["disk_waits"]
        assert time.monotonic() - t0 < 1.0
    finally:
        s.close()


def test_large_values_with_hits_keep_disk_bounded_and_the_cache_full(tmp_path):
    """Values from diskbudget.BLOB_MIN up live in blob files, which go only once every value in
    them is deleted: hits that keep a fifth of the items alive would pin files full of evicted
    ones (the cache shrank to a third of --capacity), unless the store rewrites the oldest
    survivors (Store.relocate_oldest)."""
    from cacheserver.diskbudget import BLOB_MIN
    capacity, item = 128 << 20, BLOB_MIN
    data = str(tmp_path / "d")
    s = cacheserver(data, str(capacity), 0, "--unix-socket", "off").start()
    sampler = DuSampler(data)
    sampler.start()
    try:
        rng = np.random.default_rng(5)
        pool = [rng.bytes(item) for _ in range(8)]
        hot: list[bytes] = []
        deadline = time.monotonic() + LIMIT_S
        with ServerClient(s.address, local_read=False, timeout=60) as c:
            for b in range(4 * capacity // (16 * item)):  # fill, then 3x churn
                items = [(rng.bytes(32), pool[(b + i) % 8]) for i in range(16)]
                if len(hot) < capacity // 5 // item:
                    hot.extend(k for k, _ in items[:3])  # every fifth item or so
                c.get(hot[b % 10::10])  # each hot id read every 10 batches: LRU keeps them
                c.put(items)
                assert time.monotonic() < deadline, "churn did not finish in time"
            time.sleep(1.0)
            st = c.stats()
            held = sum(v is not None for v in c.get(hot))
        sampler.stop.set()
        sampler.join()
        end = du(data)
        assert held == len(hot)
        assert st.counters["relocated_items"] > 0 and st.counters["evicted_items"] > 0
        assert st.used_bytes >= 0.5 * capacity, f"the cache holds {st.used_bytes / capacity:.2f}x --capacity"
        assert sampler.peak <= 1.10 * capacity, f"du peaked at {sampler.peak / capacity:.2f}x --capacity"
        assert end <= capacity, f"du ended at {end / capacity:.2f}x --capacity"
    finally:
        sampler.stop.set()
        assert s.stop() == 0
