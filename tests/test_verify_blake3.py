"""Digests of format version 3 carry each item's BLAKE3: cached values (and store reads)
are checked against it instead of the slower SHA-256, which stays the key. Every poisoned
or forged value from a shared server must still be caught, under the new check and under
the SHA-256 of older digests, at 0 and 2 DataLoader workers."""
import hashlib
import os
import random
import struct
import zlib

import blake3
import pytest

torch = pytest.importorskip("torch")

from cryptography.hazmat.primitives.ciphers.aead import AESGCM  # noqa: E402

from cacheserver.client.server_client import ServerClient  # noqa: E402
from clients import capability  # noqa: E402
from clients.dataset import CachedDataset  # noqa: E402
from clients.digest import Digest, DigestBuilder, DigestError, ItemMismatch  # noqa: E402
from procs import cacheserver  # noqa: E402


def make(root, with_blake3: bool, n=40, seed=1):
    rng = random.Random(seed)
    os.makedirs(root, exist_ok=True)
    b = DigestBuilder(str(root), "files")
    items = []
    for i in range(n):
        data = rng.randbytes(rng.randint(300, 5000))
        name = f"f{i:03d}.bin"
        with open(os.path.join(root, name), "wb") as f:
            f.write(data)
        b.add(hashlib.sha256(data).digest(), len(data), name,
              blake3=blake3.blake3(data).digest() if with_blake3 else None)
        items.append(data)
    path = f"{root}.digest"
    b.build().save(path)
    return path, items


@pytest.fixture
def server(tmp_path):
    d = cacheserver(str(tmp_path / "srv")).start()
    yield d
    d.kill()


def forge(key: bytes, plaintext: bytes) -> bytes:
    """A value with a valid tag, made by a holder of K: other content under K's id."""
    ident = capability.item_id(key)
    header = struct.pack("<BQ", capability.VALUE_VERSION, len(plaintext))
    return header + AESGCM(capability.value_key(key)).encrypt(capability.NONCE, plaintext, ident + header)


def poison(address: str, key: bytes, value: bytes) -> None:
    with ServerClient(address) as c:
        c.put([(capability.item_id(key), value)], replace=True)


def stored(address: str, key: bytes) -> bytes:
    with ServerClient(address) as c:
        return bytes(c.get([capability.item_id(key)])[0])


@pytest.mark.parametrize("with_blake3", [True, False], ids=["blake3", "sha256"])
def test_flipped_forged_and_swapped_values_are_caught(tmp_path, server, with_blake3):
    path, items = make(tmp_path / "ds", with_blake3)
    ds = CachedDataset(path, cache=server.address)
    try:
        assert (ds.digest.version == 3) == with_blake3
        ds.__getitems__(list(range(len(items))))  # fill
        k1, k2 = (hashlib.sha256(items[i]).digest() for i in (1, 2))
        good = stored(server.address, k1)
        flipped = bytearray(good)
        flipped[-20] ^= 0x01
        same_size_other = bytes(len(items[1]))
        other_item = items[2][:len(items[1])].ljust(len(items[1]), b"x")
        for bad in (bytes(flipped), forge(k1, same_size_other), forge(k1, other_item)):
            poison(server.address, k1, bad)
            before = ds.counters.totals()
            assert ds.__getitems__([0, 1, 2]) == items[:3]
            after = ds.counters.totals()
            assert after["poisoned"] - before["poisoned"] == 1
            assert after["hits"] - before["hits"] == 2
            assert stored(server.address, k1) == good  # replaced by the store's item
        assert stored(server.address, k2) == forge(k2, items[2])  # convergent: the same value
    finally:
        ds.close()


def test_forged_value_caught_in_dataloader_workers(tmp_path, server):
    path, items = make(tmp_path / "ds", True)
    ds = CachedDataset(path, cache=server.address)
    try:
        loader = ds.loader(batch_size=8, num_workers=2, seed=0, multiprocessing_context="spawn")
        assert sorted(x for b in loader for x in b) == sorted(items)  # fills
        k = hashlib.sha256(items[5]).digest()
        poison(server.address, k, forge(k, bytes(len(items[5]))))
        assert sorted(x for b in loader for x in b) == sorted(items)
        st = loader.epoch_stats[-1]
        assert st.poisoned == 1
        assert stored(server.address, k) == forge(k, items[5])
    finally:
        ds.close()


def test_store_item_checked_against_blake3(tmp_path):
    """A wrong BLAKE3 in the digest (or a changed file) is an ItemMismatch, never cached."""
    root = tmp_path / "ds"
    os.makedirs(root)
    data = b"hello world" * 100
    (root / "a.bin").write_bytes(data)
    b = DigestBuilder(str(root), "files")
    b.add(hashlib.sha256(data).digest(), len(data), "a.bin", blake3=blake3.blake3(b"other").digest())
    b.build().save(str(tmp_path / "d.digest"))
    ds = CachedDataset(str(tmp_path / "d.digest"), cache=False)
    try:
        with pytest.raises(ItemMismatch, match="does not match the digest"):
            ds.__getitems__([0])
    finally:
        ds.close()


def test_version3_round_trip_and_older_versions_unchanged(tmp_path):
    path3, items = make(tmp_path / "a", True, n=5)
    path2, _ = make(tmp_path / "b", False, n=5)
    d3, d2 = Digest.load(path3), Digest.load(path2)
    assert d3.version == 3 and d2.version == 1 and d2.blake3 is None
    assert [d3.blake3[i].tobytes() for i in range(5)] == [blake3.blake3(x).digest() for x in items]
    assert Digest.from_bytes(d3.to_bytes()).blake3.tobytes() == d3.blake3.tobytes()
    assert d3.fingerprint == Digest.from_arrays(d3.root, d3.kind, d3.hashes, d3.sizes, d3.offsets,
                                                d3.path_index, d3.paths).fingerprint


def test_bad_blake3_inputs(tmp_path):
    b = DigestBuilder("/x", "files")
    b.add(bytes(32), 1, "a", blake3=bytes(32))
    with pytest.raises(ValueError, match="BLAKE3 for every item"):
        b.add(bytes(32), 1, "b")
    with pytest.raises(ValueError, match="blake3 must be 32 bytes"):
        b.add(bytes(32), 1, "b", blake3=bytes(31))
    with pytest.raises(DigestError, match="BLAKE3 column differs"):
        Digest.from_arrays("/x", "files", bytes(64), [1, 1], [0, 0], [0, 1], ["a", "b"], blake3=bytes(32))
    raw = bytearray(b.build().to_bytes())
    # The BLAKE3 flag in a version 2 header: an older writer never sets it.
    raw[8:10] = struct.pack("<H", 2)
    raw[60:64] = struct.pack("<I", zlib.crc32(bytes(raw[:60])))
    with pytest.raises(DigestError, match="inconsistent header"):
        Digest.from_bytes(bytes(raw))
    raw = bytearray(b.build().to_bytes())
    raw[-40] ^= 1  # inside the BLAKE3 column
    with pytest.raises(DigestError, match="checksum mismatch"):
        Digest.from_bytes(bytes(raw))
