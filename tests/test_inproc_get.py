"""The embedded default's gets go straight to its core in the process that runs it
(cacheserver/inproc.py): counted as gets, still verified by the client (a forged or
flipped value is caught and replaced); DataLoader workers go through the socket."""
import hashlib
import os

import pytest

torch = pytest.importorskip("torch")

from cacheserver import inproc, ops, wire  # noqa: E402
from cacheserver.client.server_client import ServerClient  # noqa: E402
from clients import capability  # noqa: E402
from clients.dataset import CachedDataset  # noqa: E402
from test_verify_blake3 import forge, make  # noqa: E402


@pytest.mark.parametrize("with_blake3", [True, False], ids=["blake3", "sha256"])
def test_embedded_gets_in_process_and_still_verified(tmp_path, with_blake3):
    path, items = make(tmp_path / "ds", with_blake3)
    ds = CachedDataset(path, cache_dir=str(tmp_path / "emb"))
    try:
        core = ds.embedded.server.core
        assert inproc.core_for(ds.embedded.address) is core
        assert ds.__getitems__(list(range(len(items)))) == items  # fill
        before = core.counters.snapshot()
        assert ds.__getitems__([0, 1, 2]) == items[:3]
        after = core.counters.snapshot()
        assert after["get_hits"] - before["get_hits"] == 3
        assert after["local_reads"] == before["local_reads"]  # no follower, no socket
        k = hashlib.sha256(items[1]).digest()
        flipped = bytearray(forge(k, items[1]))
        flipped[12] ^= 0x10
        for bad in (bytes(flipped), forge(k, bytes(len(items[1])))):
            with ServerClient(ds.embedded.address) as c:
                c.put([(capability.item_id(k), bad)], replace=True)
            before = ds.counters.totals()
            assert ds.__getitems__([0, 1, 2]) == items[:3]
            after = ds.counters.totals()
            assert after["poisoned"] - before["poisoned"] == 1 and after["hits"] - before["hits"] == 2
    finally:
        ds.close()
    assert inproc.core_for(ds.cache_spec) is None  # closed: unregistered


def test_embedded_forked_workers_read_through_the_socket(tmp_path):
    """A forked worker inherits the table of in-process servers but not their threads."""
    path, items = make(tmp_path / "ds", True)
    ds = CachedDataset(path, cache_dir=str(tmp_path / "emb"))
    try:
        loader = ds.loader(batch_size=8, num_workers=2, seed=0, multiprocessing_context="fork")
        for _ in range(2):
            assert sorted(x for b in loader for x in b) == sorted(items)
        assert loader.epoch_stats[-1].hits == len(items)
        assert inproc.core_for(ds.embedded.address) is not None
        assert os.getpid() == inproc._cores[ds.embedded.address][0]
    finally:
        ds.close()


def test_damaged_record_of_a_vouched_value_caught_by_its_tag(tmp_path):
    """In its own process the embedded server skips the record checksum (the reader opens
    every value with its AES-GCM tag) and the hash of a vouched value: a record changed on
    disk behind the server's back, with or without a matching checksum, is still caught,
    read from the store, replaced, and vouched for again."""
    from cacheserver import record

    path, items = make(tmp_path / "ds", True)
    ds = CachedDataset(path, cache_dir=str(tmp_path / "emb"))
    try:
        db = ds.embedded.server.core.store._db
        assert ds.__getitems__(list(range(len(items)))) == items  # fill: vouched puts
        ident = capability.item_id(hashlib.sha256(items[1]).digest())
        good = db.get(ident)
        flipped = bytearray(good[:-record.TRAILER])
        flipped[40] ^= 0x01
        for damaged in (record.wrap(bytes(flipped)), bytes(flipped) + good[-record.TRAILER:], good[:-1]):
            db.put(ident, damaged)  # under the store: no write the trust table sees
            before = ds.counters.totals()
            assert ds.__getitems__([0, 1, 2]) == items[:3]
            after = ds.counters.totals()
            assert {k: after[k] - before[k] for k in ("hits", "poisoned", "vouched")} == \
                dict(hits=2, poisoned=1, vouched=2)
            assert after["store_bytes"] - before["store_bytes"] == len(items[1])
            assert bytes(db.get(ident)) == bytes(good)  # replaced by the sealed store read
            before = ds.counters.totals()
            assert ds.__getitems__([1]) == items[1:2]
            after = ds.counters.totals()
            assert after["vouched"] - before["vouched"] == 1 and after["poisoned"] == before["poisoned"]
    finally:
        ds.close()


@pytest.mark.parametrize("claims", [True, False])
def test_embedded_lookups_go_to_the_core_and_answer_as_the_ring(tmp_path, claims):
    """Look-ups and claims in the embedded process go straight to the core (inproc.ask):
    the same codes as over the socket (HIT, ABSENT; PENDING for ids another job claimed,
    only where this dataset claims too), counted as look-ups; ids of a wrong size are
    refused by name, as over the wire."""
    path, items = make(tmp_path / "ds", True)
    ds = CachedDataset(path, cache_dir=str(tmp_path / "emb"), claims=claims)
    try:
        core = ds.embedded.server.core
        assert ds.__getitems__([0, 1]) == items[:2]
        assert core.claim("other", ds.ids_for([2])) == bytes([1])  # FETCH: another job reads item 2
        before = core.counters.snapshot()
        codes = ds.lookup_codes([0, 1, 2, 3])
        assert codes == ([1, 1, 2, 0] if claims else [1, 1, 0, 0])
        assert ds.lookup([0, 1, 2, 3]) == [True, True, False, False]
        after = core.counters.snapshot()
        assert after["lookups"] - before["lookups"] == 8 and after["lookup_hits"] - before["lookup_hits"] == 4
        with ServerClient(ds.embedded.address) as c:  # the same answers over the socket
            assert list(c.lookup(ds.ids_for([0, 1, 2, 3]), ds.job, pending=claims)) == codes
        assert inproc.ask(core, ops.CLAIM, "third", ds.ids_for([2, 3]), {}) == bytes([2, 1])  # WAIT, FETCH
        with pytest.raises(wire.RemoteError, match=r"ids\[1\]: expected a 32-byte id"):
            inproc.ask(core, ops.LOOKUP, ds.job, [ds.ids_for([0])[0], b"short"], {})
    finally:
        ds.close()
