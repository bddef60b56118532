"""Values a process checked once are known again, byte for byte, by a MAC under a key of its
own (clients/checked.py): a cache server's hits skip step 4 the second time, and a value
changed since, even one sealed with a valid tag by a holder of K, is hashed and caught."""
import hashlib
import os

import pytest

torch = pytest.importorskip("torch")

from cacheserver.client.server_client import ServerClient  # noqa: E402
from clients import capability  # noqa: E402
from clients.checked import HEADER, SLOT, CheckedValues, key, new_table, table_slots, unknown  # noqa: E402
from clients.dataset import CachedDataset  # noqa: E402
from procs import cacheserver  # noqa: E402
from test_verify_blake3 import forge, make  # noqa: E402
from test_vouched import read_counts  # noqa: E402


@pytest.fixture
def server(tmp_path):
    d = cacheserver(str(tmp_path / "srv")).start()
    yield d
    d.kill()


def test_known_only_as_the_same_bytes_under_the_same_entry():
    table = new_table(1)
    m = CheckedValues(table)
    a, b = b"a" * 32, b"b" * 32
    v = bytes(range(256)) * 40
    assert m.known([key(a, b)], [v]) == [False]
    m.remember([key(a, b)], [v])
    flipped = bytearray(v)
    flipped[1000] ^= 1
    assert m.known([key(a, b), key(a, b), key(b, b), key(a, a)],
                   [memoryview(v), bytes(flipped), v, v]) == [True, False, False, False]
    other = new_table(1)  # the same slots under another key: known to nobody
    other[HEADER:] = table[HEADER:]
    assert CheckedValues(other).known([key(a, b)], [v]) == [False]
    todo, pairs, entries, n = unknown(m, [a, b], [v, v], [0, 1], [(b, v), (b, v)])
    assert (todo, n, entries) == ([1], 1, [key(b, b)])


def test_a_full_table_keeps_the_last_written_and_knows_only_what_it_holds():
    full = CheckedValues()  # the smallest table: 1024 slots
    v = b"x" * 5000
    entries = [key(os.urandom(32), b"h" * 32) for _ in range(3000)]
    full.remember(entries, [v] * len(entries))
    held = len(full)
    assert 900 < held <= table_slots(0) == 1024
    assert full.known(entries[-1:], [v]) == [True]
    assert sum(full.known(entries, [v] * len(entries))) == held  # the rest are hashed again


def test_a_shared_table_is_one_memo_and_binds_entry_and_value():
    table = new_table(10, shared=True)
    one, other = CheckedValues(table), CheckedValues(table)  # as in two processes of a loader
    a, b, h = b"a" * 32, b"b" * 32, b"h" * 32
    v = bytes(range(256)) * 20
    one.remember([key(a, h)], [v])
    assert other.known([key(a, h), key(b, h)], [v, v]) == [True, False]
    mem = memoryview(table).cast("B")
    filled = [s for s in range(HEADER, len(mem), SLOT) if mem[s:s + 12] != bytes(12)]
    assert len(filled) == 1
    s = filled[0]
    # a's nonce and tag moved to b's entry (as a torn or stale slot would show them): not b's
    other.remember([key(b, h)], [v])
    t = [x for x in range(HEADER, len(mem), SLOT) if mem[x:x + 12] != bytes(12) and x != s][0]
    mem[t:t + 28] = mem[s:s + 28]
    assert one.known([key(a, h), key(b, h)], [v, v]) == [True, False]
    mem[s + 3] ^= 1  # a nonce half written
    assert one.known([key(a, h)], [v]) == [False]


def _entries(seed: int, n: int) -> list[bytes]:
    return [key(hashlib.sha256(bytes([seed]) + i.to_bytes(4, "little")).digest(), b"h" * 32) for i in range(n)]


def _remember_many(table, seed: int, n: int) -> None:
    m = CheckedValues(table)
    for e in _entries(seed, n):
        m.remember([e], [bytes([seed]) * 3000])


def test_two_processes_writing_one_table_at_once_never_vouch_for_other_bytes():
    """Two spawned writers fill one small table without a lock (racing for its slots while
    they overlap): an entry is known only with the very bytes it was remembered with, or not
    at all."""
    import multiprocessing

    N = 20000
    table = new_table(0, shared=True)  # 1024 slots for 2 x 20000 entries: every bucket contested
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_remember_many, args=(table, seed, N)) for seed in (1, 2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    m = CheckedValues(table)
    entries = _entries(1, N) + _entries(2, N)
    right = [bytes([1 + i // N]) * 3000 for i in range(len(entries))]
    known = m.known(entries, right)
    assert 900 < sum(known) <= len(m) <= 1024
    assert not any(m.known(entries, [bytes([2 - i // N]) * 3000 for i in range(len(entries))]))
    assert not any(m.known(entries, [r[:-1] for r in right]))


@pytest.mark.parametrize("with_blake3", [True, False], ids=["blake3", "sha256"])
def test_server_hits_checked_once_then_known_and_changes_caught(tmp_path, server, with_blake3):
    path, items = make(tmp_path / "ds", with_blake3)
    n = len(items)
    filler = CachedDataset(path, cache=server.address)
    ds = CachedDataset(path, cache=server.address)  # another job: a table of its own
    try:
        got, c = read_counts(filler, list(range(n)))  # fill: store reads, sealed, put
        assert got == items and c["hits"] == 0
        got, c = read_counts(filler, list(range(n)))  # what it sealed itself it knows already
        assert got == items and c == dict(hits=n, vouched=n, poisoned=0, store_bytes=0)
        got, c = read_counts(ds, list(range(n)))  # first hits: each hashed once
        assert got == items and c == dict(hits=n, vouched=0, poisoned=0, store_bytes=0)
        got, c = read_counts(ds, list(range(n)))
        assert got == items and c == dict(hits=n, vouched=n, poisoned=0, store_bytes=0)
        k = hashlib.sha256(items[1]).digest()
        with ServerClient(server.address) as cl:  # a holder of K replaces the value, valid tag and all
            cl.put([(capability.item_id(k), forge(k, bytes(len(items[1]))))], replace=True)
        got, c = read_counts(ds, list(range(n)))
        assert got == items and c == dict(hits=n - 1, vouched=n - 1, poisoned=1, store_bytes=len(items[1]))
        # the repair sealed the item again: sealing is deterministic, so the very bytes checked before
        got, c = read_counts(ds, [1])
        assert got == items[1:2] and c == dict(hits=1, vouched=1, poisoned=0, store_bytes=0)
    finally:
        ds.close()
        filler.close()


@pytest.mark.parametrize("fill", ["other job", "itself"])
def test_spawned_workers_share_what_each_checked(tmp_path, server, fill):
    """A loader's workers meet different items each epoch: what one checked or sealed, all know."""
    path, items = make(tmp_path / "ds", True)
    n = len(items)
    if fill == "other job":
        filler = CachedDataset(path, cache=server.address)
        read_counts(filler, list(range(n)))
        filler.close()
    ds = CachedDataset(path, cache=server.address)
    try:
        loader = ds.loader(batch_size=4, num_workers=2, seed=0)  # spawned, persistent
        counts = []
        for _ in range(3):  # hits, each hashed once by one worker (or fill); all known
            before = ds.counters.totals()
            assert sorted(x for b in loader for x in b) == sorted(items)
            after = ds.counters.totals()
            counts.append({k: after[k] - before[k] for k in ("hits", "vouched", "poisoned")})
        # with a memo of its own, a worker would know about half of its items (2^-40 all)
        if fill == "other job":
            assert counts[0] == dict(hits=n, vouched=0, poisoned=0)
            assert counts[1] == counts[2] == dict(hits=n, vouched=n, poisoned=0)
        else:  # the worker that sealed an item told the others
            assert counts[0] == dict(hits=0, vouched=0, poisoned=0)
            assert counts[1] == counts[2] == dict(hits=n, vouched=n, poisoned=0)
        del loader
    finally:
        ds.close()


def test_a_damaged_record_read_by_the_follower_goes_to_the_server_which_drops_it(tmp_path):
    """A same-host reader checks each record's xxh3 trailer (cacheserver/client/localread.py):
    a record damaged on disk is left to the server, which drops it; the item is read from the
    store and put again, whether or not its hash was known before."""
    from cacheserver.counters import Counters
    from cacheserver.eviction import make_policy
    from cacheserver.store import Store

    path, items = make(tmp_path / "ds", True)
    data_dir = str(tmp_path / "srv")
    srv = cacheserver(data_dir).start()
    ds = CachedDataset(path, cache=srv.address)
    try:
        read_counts(ds, list(range(len(items))))  # fill
        read_counts(ds, list(range(len(items))))  # checked once: known to the table
        srv.stop()
        store = Store(data_dir, 1 << 30, make_policy("lru"), Counters())
        try:
            ident = ds.ids_for([3])[0]
            raw = bytearray(store._db.get(ident))
            raw[len(raw) // 2] ^= 1  # the value and its trailer no longer agree
            store._db.put(ident, bytes(raw))
        finally:
            store.close()
        srv = cacheserver(data_dir).start()
        ds.close()
        ds = CachedDataset(path, cache=srv.address)
        read_counts(ds, [0])
        assert [c.transport for c in ds._proc().ring.clients.values()] == ["local"]
        got, c = read_counts(ds, list(range(len(items))))
        assert got == items and c["hits"] == len(items) - 1 and c["poisoned"] == 0
        assert c["store_bytes"] == len(items[3])
        got, c = read_counts(ds, list(range(len(items))))
        assert got == items and c["poisoned"] == 0 and c["hits"] == len(items)
    finally:
        ds.close()
        srv.kill()
