"""A plain embedded dir (cacheserver/datadir.py) is written only by its owner's processes,
each of which checked an item against its digest before putting it: reads there check the
value's size (RocksDB its bits: tests/test_plain_records.py), not its hash, in the owning
process and in its DataLoader workers alike; a plain dir not private to its owner is
refused (docs/security.md)."""
import hashlib
import os
import socket

import pytest

torch = pytest.importorskip("torch")

import blake3  # noqa: E402

from cacheserver.client.server_client import peer_uid  # noqa: E402
from cacheserver.datadir import PlaintextDir  # noqa: E402
from clients import capability  # noqa: E402
from clients.dataset import CachedDataset  # noqa: E402
from clients.digest import DigestBuilder, ItemMismatch  # noqa: E402
from test_verify_blake3 import make  # noqa: E402
from test_vouched import put_from_another_process, read_counts  # noqa: E402


def test_plain_values_are_trusted_as_their_owner_put_them(tmp_path):
    path, items = make(tmp_path / "ds", True)
    n = len(items)
    ds = CachedDataset(path, cache_dir=str(tmp_path / "emb"))
    try:
        assert ds.plain_records
        ds.__getitems__(list(range(n)))  # fill
        # a same-size rewrite by another process of this user (the only one who can reach
        # the 0600 socket): served as it stands, unhashed, here and in the workers
        ident = capability.item_id(hashlib.sha256(items[1]).digest())
        other = bytes(len(items[1]))
        put_from_another_process(ds.embedded.address, ident, other, plain=True)
        got, c = read_counts(ds, list(range(n)))
        assert got == items[:1] + [other] + items[2:]
        assert c == dict(hits=n, vouched=0, poisoned=0, store_bytes=0)
        # the rewrite in table files before the workers open their followers: this test is about
        # trust, not about a follower's view of a replace racing a flush (tests/test_samehost_replace_view.py)
        assert ds.embedded.server.core.store.flush()
        loader = ds.loader(batch_size=8, num_workers=2, seed=0, multiprocessing_context="fork",
                           persistent_workers=False)
        _an_epoch_of_hits_serves(loader, sorted(items[:1] + [other] + items[2:]), sorted(items))
        assert read_counts(ds, [1])[0] == [other]  # a worker's miss did not put over it
        # a value of another length than the digest's: dropped, read from the store again
        put_from_another_process(ds.embedded.address, ident, items[1] + b"!", plain=True)
        got, c = read_counts(ds, list(range(n)))
        assert got == items and c == dict(hits=n - 1, vouched=0, poisoned=1, store_bytes=len(items[1]))
    finally:
        ds.close()


def _an_epoch_of_hits_serves(loader, rewritten: list, genuine: list, epochs: int = 5) -> None:
    """Epochs (fresh fork workers each) until one whose items were all cache hits: it must
    yield `rewritten`, the cached values as they stand, unhashed. A worker whose first Info
    the embedded server answered later than ring_client.PROBE_TIMEOUT_S (2 s: the main
    process that serves it starved on a loaded host) takes the server as down for 2 s: its
    items are misses, read from the store (the genuine ones), logged and counted as such.
    A hash check would have found the rewrite poisoned: never, in any epoch."""
    for _ in range(epochs):
        got = sorted(x for b in loader for x in b)
        st = loader.epoch_stats[-1]
        assert st.poisoned == 0, st.line()
        if st.misses == 0 and st.hits == len(got):
            assert got == rewritten, st.line()
            return
        assert got in (rewritten, genuine), st.line()
    pytest.fail(f"no epoch of {epochs} found the embedded server from its workers: {st.line()}")


def test_items_for_a_plain_dir_are_checked_by_the_sha256_of_their_ids(tmp_path):
    """A digest whose BLAKE3 vouches for other content than its SHA-256 names must not
    file that content under the SHA-256's id, where other digests read it unhashed."""
    root = tmp_path / "ds"
    root.mkdir()
    x, y = b"x" * 5000, b"y" * 5000
    (root / "a.bin").write_bytes(y)
    (root / "b.bin").write_bytes(x)
    b = DigestBuilder(str(root), "files")
    b.add(hashlib.sha256(x).digest(), len(y), "a.bin", blake3=blake3.blake3(y).digest())  # inconsistent
    b.add(hashlib.sha256(x).digest(), len(x), "b.bin", blake3=blake3.blake3(x).digest())
    b.build().save(str(tmp_path / "bad.digest"))
    ds = CachedDataset(str(tmp_path / "bad.digest"), cache_dir=str(tmp_path / "emb"))
    try:
        with pytest.raises(ItemMismatch, match="item 0 .*BLAKE3 but not its SHA-256.*tools/digest verify"):
            ds.__getitems__([0])
        assert ds.__getitems__([1]) == [x]  # the genuine item under that id
        assert ds.__getitems__([1]) == [x]
    finally:
        ds.close()


def test_a_plain_dir_open_to_others_is_refused(tmp_path):
    path, items = make(tmp_path / "ds", True, n=4)
    emb = tmp_path / "emb"
    CachedDataset(path, cache_dir=str(emb)).close()
    assert os.stat(emb).st_mode & 0o777 == 0o700
    os.chmod(emb, 0o750)
    with pytest.raises(PlaintextDir, match=r"open to others \(mode 750\).*delete it"):
        CachedDataset(path, cache_dir=str(emb))
    os.chmod(emb, 0o700)
    ds = CachedDataset(path, cache_dir=str(emb))
    try:
        assert ds.__getitems__([0, 3]) == [items[0], items[3]]
    finally:
        ds.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a dir away takes root")
def test_a_plain_dir_of_another_user_is_refused(tmp_path):
    path, _ = make(tmp_path / "ds", True, n=4)
    emb = tmp_path / "emb"
    CachedDataset(path, cache_dir=str(emb)).close()
    os.chown(emb, 65534, -1)
    with pytest.raises(PlaintextDir, match="belongs to uid 65534, not this user"):
        CachedDataset(path, cache_dir=str(emb))
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    os.chown(fresh, 65534, -1)
    with pytest.raises(PlaintextDir, match="belongs to uid 65534, not this user"):
        CachedDataset(path, cache_dir=str(fresh))  # refused by name, not a bare chmod error
    assert not (fresh / "records").exists()


def test_the_peer_of_a_unix_socket_is_known(tmp_path):
    """A plain client takes values unhashed only over a socket of this user's (server_client.py)."""
    path = str(tmp_path / "s.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    cl = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        cl.connect(path)
        assert peer_uid(cl, path) == os.geteuid()
    finally:
        cl.close()
        srv.close()


def test_the_embedded_server_refuses_control_calls_and_leaves_no_thread(tmp_path):
    """Before: the embedded server ran without a cluster token, so any process on the host
    could change its job modes or evict over its loopback gRPC port (and it logged the
    daemon's "no --cluster-token-file" warning in every user's process); each one closed
    left its gRPC executor's threads behind."""
    import threading

    import grpc

    from cacheserver.client.server_client import ServerClient

    path, items = make(tmp_path / "ds", True)
    before = {t.ident for t in threading.enumerate()}
    for k in range(2):
        ds = CachedDataset(path, cache_dir=str(tmp_path / f"emb{k}"))
        ds.__getitems__(list(range(len(items))))
        with ServerClient(ds.embedded.address, use_dataplane=False, local_read=False) as c:
            with pytest.raises(grpc.RpcError) as e:
                c.set_job_mode("someone-else", 1)
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        ds.close()
    left = [t.name for t in threading.enumerate() if t.ident not in before and t.is_alive()]
    assert not [n for n in left if n.startswith("grpc")], left
