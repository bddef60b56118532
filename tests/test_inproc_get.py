"""The embedded default's gets go straight to its core in the process that runs it
(cacheserver/inproc.py): counted as gets, still verified by the client (a forged or
flipped value is caught and replaced); DataLoader workers go through the socket.
A new embedded dir holds plain records (cacheserver/datadir.py); one made before,
sealed, stays sealed: both are covered."""
import glob
import hashlib
import os

import pytest

torch = pytest.importorskip("torch")

from cacheserver import inproc, ops, wire  # noqa: E402
from cacheserver.client.server_client import ServerClient  # noqa: E402
from clients import capability  # noqa: E402
from clients.dataset import CachedDataset  # noqa: E402
from test_verify_blake3 import forge, make  # noqa: E402


def sealed_dir(path) -> str:
    """An embedded cache dir made before plain records: a store of sealed ones."""
    from cacheserver.counters import Counters
    from cacheserver.eviction import make_policy
    from cacheserver.store import Store

    Store(str(path), 1 << 26, make_policy("lru"), Counters()).close()
    return str(path)


@pytest.mark.parametrize("plain", [True, False], ids=["plain", "sealed"])
@pytest.mark.parametrize("with_blake3", [True, False], ids=["blake3", "sha256"])
def test_embedded_gets_in_process_and_still_verified(tmp_path, with_blake3, plain):
    path, items = make(tmp_path / "ds", with_blake3)
    ds = CachedDataset(path, cache_dir=str(tmp_path / "emb") if plain else sealed_dir(tmp_path / "emb"))
    try:
        assert ds.plain_records is plain and ds.embedded.server.store.plain is plain
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
        # a plain dir's values are checked by their size (their bits by RocksDB: below;
        # a same-size rewrite by its owner is trusted: tests/test_plain_trust.py)
        bads = [items[1][:-1], items[1] + b"x"] if plain else [bytes(flipped), forge(k, bytes(len(items[1])))]
        for bad in bads:
            with ServerClient(ds.embedded.address, plain=plain) as c:
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


def test_damaged_plain_record_of_a_vouched_value_caught_by_rocksdb(tmp_path):
    """A plain store's values skip every check of ours but their size: a bit flipped in a table
    file on disk is caught by RocksDB's block checksum, dropped, and the item read from
    the store again; nothing wrong reaches the reader."""
    path, items = make(tmp_path / "ds", True)
    ds = CachedDataset(path, cache_dir=str(tmp_path / "emb"))
    try:
        store = ds.embedded.server.core.store
        assert ds.__getitems__(list(range(len(items)))) == items  # fill: vouched puts
        store.flush()
        target = items[1][100:132]
        hit = [(f, data.find(target)) for f in glob.glob(os.path.join(store.db_path, "*.sst"))
               for data in [open(f, "rb").read()] if target in data]
        assert len(hit) == 1, hit
        name, at = hit[0]
        with open(name, "r+b") as f:  # the disk, not RocksDB, changes one bit of the value
            f.seek(at)
            f.write(bytes([target[0] ^ 0x01]))
        before, dropped = ds.counters.totals(), store.counters.snapshot().get("corrupt_dropped", 0)
        assert ds.__getitems__(list(range(len(items)))) == items
        after = ds.counters.totals()
        assert store.counters.snapshot()["corrupt_dropped"] > dropped
        assert after["store_bytes"] - before["store_bytes"] >= len(items[1])
        assert after["poisoned"] == before["poisoned"]  # a miss, never a wrong value
    finally:
        ds.close()


def test_sealed_or_plain_clients_refuse_the_other_records(tmp_path):
    """A client made for sealed records refuses an embedded cache's plain store by name
    (never reads plaintext as ciphertext, never writes ciphertext there), and a plain
    one a sealed store (never sends a shared server plaintext); values of a plain store
    are refused over gRPC, its data plane has no TCP listener, its socket and dir are
    its owner's only."""
    import grpc
    import stat

    from cacheserver.client.server_client import RecordsMismatch
    from cacheserver.datadir import PlaintextDir
    from cacheserver.proto import cache_pb2 as pb
    from cacheserver.proto import cache_pb2_grpc as pb_grpc

    path, items = make(tmp_path / "ds", True)
    ds = CachedDataset(path, cache_dir=str(tmp_path / "emb"))
    sealed = CachedDataset(path, cache_dir=sealed_dir(tmp_path / "sealed"))
    try:
        assert ds.__getitems__([0]) == items[:1]
        with ServerClient(ds.embedded.address) as c:
            with pytest.raises(RecordsMismatch, match="plaintext records"):
                c.lookup(ds.ids_for([0]))
        with ServerClient(sealed.embedded.address, plain=True) as c:
            with pytest.raises(RecordsMismatch, match="holds sealed records"):
                c.lookup(ds.ids_for([0]))
        with ServerClient(ds.embedded.address, plain=True) as c:
            info = c.info()
            assert info.data_address == "" and info.unix_socket
            stub = pb_grpc.CacheStub(c.channel)
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Get(pb.GetRequest(ids=ds.ids_for([0])[0], job="x")))
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            with pytest.raises(grpc.RpcError) as err:
                ops.PUT.grpc(stub, [(b"z" * 32, b"over tcp")], "x", 10.0)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert list(c.lookup([b"z" * 32])) == [0]  # nothing stored
        assert stat.S_IMODE(os.stat(info.unix_socket).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(tmp_path / "emb").st_mode) == 0o700
        ds.close()
        with pytest.raises(PlaintextDir, match="plaintext records.*another --data-dir"):
            sealed_dir(tmp_path / "emb")  # a cacheserver's store on the embedded dir
    finally:
        sealed.close()
        ds.close()


def test_damaged_record_of_a_vouched_value_caught_by_its_tag(tmp_path):
    """In its own process the embedded server skips the record checksum (the reader opens
    every value with its AES-GCM tag) and the hash of a vouched value: a record changed on
    disk behind the server's back, with or without a matching checksum, is still caught,
    read from the store, replaced, and vouched for again."""
    from cacheserver import record

    path, items = make(tmp_path / "ds", True)
    ds = CachedDataset(path, cache_dir=sealed_dir(tmp_path / "emb"))
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
        with ServerClient(ds.embedded.address, plain=True) as c:  # the same answers over the socket
            assert list(c.lookup(ds.ids_for([0, 1, 2, 3]), ds.job, pending=claims)) == codes
        assert inproc.ask(core, ops.CLAIM, "third", ds.ids_for([2, 3]), {}) == bytes([2, 1])  # WAIT, FETCH
        with pytest.raises(wire.RemoteError, match=r"ids\[1\]: expected a 32-byte id"):
            inproc.ask(core, ops.LOOKUP, ds.job, [ds.ids_for([0])[0], b"short"], {})
    finally:
        ds.close()
