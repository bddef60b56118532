"""Digest file format: round trips, damage detection, scale; TFRecord framing."""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import struct
import sys
import tarfile
import time
import zlib
from pathlib import Path

import fsspec
import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))

import objstore

from clients import crc32c as crcmod
from clients.digest import (
    MAGIC,
    Digest,
    DigestBuilder,
    DigestError,
    ItemMismatch,
    Kind,
    Location,
)
from clients.itemscan import ScanError, scan
from clients.storeread import read_item, read_items
from clients.tfrecord import RecordError, encode_record, iter_records, masked_crc

# -- helpers -------------------------------------------------------------------


def _blobs(n: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.bytes(int(rng.integers(0, 3000))) for _ in range(n)]


def make_dataset(root: Path, kind: str) -> list[tuple[str, bytes]]:
    """Write a small dataset of ``kind``; return (relpath, item bytes) in digest order."""
    items: list[tuple[str, bytes]] = []
    if kind == "files":
        for i, b in enumerate(_blobs(6, 1)):
            rel = f"{'sub/' if i % 2 else ''}img{i}.bin"
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_bytes(b)
            items.append((rel, b))
        items.sort()
    elif kind == "tfrecord":
        for k in range(3):
            recs = _blobs(4, 10 + k)
            (root / f"part-{k:03d}.tfrecord").write_bytes(b"".join(map(encode_record, recs)))
            items += [(f"part-{k:03d}.tfrecord", r) for r in recs]
    else:
        for k in range(2):
            buf = io.BytesIO()
            with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
                for j, b in enumerate(_blobs(3, 20 + k)):
                    for ext, data in (("jpg", b), ("cls", str(j).encode())):
                        # a long name forces an extra pax header before the data
                        name = f"{'x' * 120 if j == 1 else ''}{k:02d}{j:04d}.{ext}"
                        ti = tarfile.TarInfo(name)
                        ti.size = len(data)
                        tf.addfile(ti, io.BytesIO(data))
                        items.append((f"shard-{k}.tar", data))
            (root / f"shard-{k}.tar").write_bytes(buf.getvalue())
    return items


def digest_of(root: Path, kind: str) -> Digest:
    """Scan with the same code tools/digest uses, in-process."""
    b = DigestBuilder(f"file://{root}", kind, {"created": "test"})
    for p in sorted(q for q in root.rglob("*") if q.is_file()):
        rel = p.relative_to(root).as_posix()
        with open(p, "rb") as f:
            for off, size, sha, *_ in scan(kind, f, rel):
                b.add(sha, size, rel, off)
    return b.build()


def sample_digest(n: int = 5) -> Digest:
    b = DigestBuilder("gs://bucket/prefix", Kind.TFRECORD, {"created": "now", "tool": "t"})
    for i in range(n):
        b.add(hashlib.sha256(bytes([i])).digest(), 10 + i, f"f{i % 2}.tfrecord", 100 * i + 12)
    return b.build()


def assert_same(a: Digest, b: Digest) -> None:
    assert (a.root, a.kind, len(a), a.meta) == (b.root, b.kind, len(b), b.meta)
    assert np.array_equal(a.hashes, b.hashes) and np.array_equal(a.sizes, b.sizes)
    assert [a.location(i) for i in range(len(a))] == [b.location(i) for i in range(len(b))]
    assert a.fingerprint == b.fingerprint and a.total_bytes == b.total_bytes


# -- round trips -------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["files", "tfrecord", "tar"])
def test_round_trip_and_read_item(tmp_path: Path, kind: str) -> None:
    data = tmp_path / "data"
    data.mkdir()
    expected = make_dataset(data, kind)
    d = digest_of(data, kind)
    assert len(d) == len(expected) and d.kind == Kind(kind)
    d.save(tmp_path / "d.dig")
    e = Digest.load(tmp_path / "d.dig")
    assert_same(d, e)
    assert e.num_paths == len({rel for rel, _ in expected})  # paths de-duplicated
    fs = fsspec.filesystem("file")
    for i, (rel, blob) in enumerate(expected):
        assert e.location(i).path == rel
        assert e.sha256(i) == hashlib.sha256(blob).digest() and e.size(i) == len(blob)
        assert read_item(e, i, fs, verify=True) == blob
    assert read_item(e, 0) == expected[0][1]  # fs from the root URL
    assert e.total_bytes == sum(len(b) for _, b in expected)
    assert_same(pickle.loads(pickle.dumps(e)), e)


def test_accessors_and_errors() -> None:
    d = sample_digest()
    assert d.location(3) == Location("f1.tfrecord", 312, 13)
    assert d.location(-1) == d.location(4) and d.paths == ["f0.tfrecord", "f1.tfrecord"]
    assert d.sha256(2) == hashlib.sha256(b"\x02").digest()
    with pytest.raises(IndexError):
        d.sha256(5)
    assert not d.hashes.flags.writeable
    b = DigestBuilder("file:///x", "files")
    with pytest.raises(ValueError):
        b.add(b"short", 1, "a")
    with pytest.raises(ValueError):
        DigestBuilder("file:///x", "zip")
    empty = Digest.from_bytes(b.build().to_bytes())
    assert len(empty) == 0 and empty.total_bytes == 0


def test_fingerprint_is_content_identity() -> None:
    a = sample_digest()
    h = a.hashes
    moved = Digest.from_arrays("s3://other/place", "files", h, a.sizes, np.zeros(len(a)),
                               range(len(a)), [f"x{i}" for i in range(len(a))])
    assert moved.fingerprint == a.fingerprint  # root/locations do not matter
    swapped = Digest.from_arrays("gs://bucket/prefix", "tfrecord", h[::-1], a.sizes, a.offsets,
                                 a.path_index, a.paths)
    assert swapped.fingerprint != a.fingerprint  # order does
    want = hashlib.sha256(b"mlcache/fingerprint/v1\x00" + h.tobytes()).digest()
    assert a.fingerprint == want


def test_read_item_detects_changed_store(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    make_dataset(data, "tfrecord")
    d = digest_of(data, "tfrecord")
    p = data / d.location(5).path
    raw = bytearray(p.read_bytes())
    raw[d.location(5).offset] ^= 1
    p.write_bytes(bytes(raw))
    with pytest.raises(ItemMismatch, match="item 5"):
        read_item(d, 5, verify=True)


def _rebased(d: Digest, root: str) -> Digest:
    return Digest.from_arrays(root, d.kind, d.hashes, d.sizes, d.offsets, d.path_index, d.paths, d.meta)


@pytest.mark.parametrize("kind", ["files", "tfrecord"])
def test_read_items_batches_over_http_and_local(tmp_path: Path, kind: str) -> None:
    """read_items: one cat_ranges call on an async filesystem, a pool on a local
    one; same bytes as read_item, in order, zero-length records included."""
    from concurrent.futures import ThreadPoolExecutor

    data = tmp_path / "data"
    data.mkdir()
    expected = make_dataset(data, kind)
    if kind == "tfrecord":  # a zero-length record: no read at all
        (data / "part-009.tfrecord").write_bytes(encode_record(b""))
        expected.append(("part-009.tfrecord", b""))
    d = digest_of(data, kind)
    want = [read_item(d, i) for i in range(len(d))]
    assert sorted(want) == sorted(b for _, b in expected)
    order = list(range(len(d)))[::-1]
    with ThreadPoolExecutor(3) as pool:
        assert read_items(d, order, fsspec.filesystem("file"), verify=True, pool=pool) == [want[i] for i in order]
    with objstore.ObjectStore(data) as store:
        h = _rebased(d, store.url)
        fs = fsspec.filesystem("http", skip_instance_cache=True)
        before = store.stats()["requests"]
        got = read_items(h, order, fs, verify=True, concurrency=2)
        assert got == [want[i] for i in order]
        assert store.stats()["requests"] - before == sum(1 for w in want if w or kind == "files")
        assert read_items(h, [], fs) == [] and read_items(h, [1], fs) == [want[1]]


def test_read_items_raises_the_first_failure(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    make_dataset(data, "files")
    d = digest_of(data, "files")
    with objstore.ObjectStore(data) as store:
        h = _rebased(d, store.url)
        fs = fsspec.filesystem("http", skip_instance_cache=True)
        p = data / d.location(2).path
        p.write_bytes(p.read_bytes() + b"x")  # grown: the size check names it
        with pytest.raises(ItemMismatch, match="item 2"):
            read_items(h, [0, 1, 2, 3], fs, verify=True)
        assert len(read_items(h, [2], fs)[0]) == d.size(2) + 1  # unchecked without verify
        (data / d.location(4).path).unlink()
        with pytest.raises(FileNotFoundError):
            read_items(h, [0, 4, 5], fs, verify=True)


# -- damaged files -------------------------------------------------------------------


@pytest.fixture
def raw() -> bytes:
    return sample_digest().to_bytes()


@pytest.mark.parametrize("cut", [0, 3, 9, 40, 63, 64, 100, -33, -1])
def test_truncated(raw: bytes, cut: int) -> None:
    with pytest.raises(DigestError, match="truncated"):
        Digest.from_bytes(raw[:cut])


@pytest.mark.parametrize("data", [b"PK\x03\x04" + bytes(100), b"hello world\n" * 10, b"\x00" * 64, b"X"])
def test_foreign(data: bytes) -> None:
    with pytest.raises(DigestError, match="not a digest file"):
        Digest.from_bytes(data, "x.bin")


def test_wrong_version(raw: bytes) -> None:
    bad = raw[:8] + struct.pack("<H", 7) + raw[10:]
    with pytest.raises(DigestError, match="unsupported version 7"):
        Digest.from_bytes(bad)
    # Version is judged before anything else, even on a short file.
    with pytest.raises(DigestError, match="unsupported version 4"):
        Digest.from_bytes(MAGIC + struct.pack("<H", 4))


@pytest.mark.parametrize("where", [70, 150, 200, -40, -5])
def test_flipped_byte(raw: bytes, where: int) -> None:
    bad = bytearray(raw)
    bad[where] ^= 0x40
    with pytest.raises(DigestError, match="checksum mismatch"):
        Digest.from_bytes(bytes(bad))


def test_flipped_header_and_trailing_garbage(raw: bytes) -> None:
    bad = bytearray(raw)
    bad[20] ^= 1  # item count
    with pytest.raises(DigestError, match="header checksum"):
        Digest.from_bytes(bytes(bad))
    with pytest.raises(DigestError, match="unexpected bytes"):
        Digest.from_bytes(raw + b"\0")


def test_corrupt_but_checksummed_is_rejected(raw: bytes) -> None:
    # A buggy writer (valid checksums, nonsense inside) must still be caught.
    d = sample_digest()
    bad = Digest.__new__(Digest)
    bad.__dict__.update(d.__dict__)
    bad._path_index = np.array([0, 1, 0, 1, 9], "<u4")
    with pytest.raises(DigestError, match="missing path"):
        Digest.from_bytes(bad.to_bytes())


def test_load_error_names_file(tmp_path: Path) -> None:
    p = tmp_path / "notes.txt"
    p.write_text("not a digest")
    with pytest.raises(DigestError, match="notes.txt"):
        Digest.load(p)


# -- scale ---------------------------------------------------------------------------


def test_million_entries_load(tmp_path: Path) -> None:
    n, files = 1_000_000, 1000
    rng = np.random.default_rng(7)
    hashes = np.frombuffer(rng.bytes(32 * n), np.uint8).reshape(n, 32)
    sizes = rng.integers(1, 1 << 20, n)
    d = Digest.from_arrays("gs://bucket/imagenet", "tfrecord", hashes, sizes,
                           np.arange(n) * 4096 + 12, np.arange(n) // (n // files),
                           [f"train/shard-{k:05d}-of-{files:05d}.tfrecord" for k in range(files)])
    path = tmp_path / "big.dig"
    d.save(path)
    size = path.stat().st_size
    times = []
    for _ in range(3):
        t = time.perf_counter()
        e = Digest.load(path)
        times.append(time.perf_counter() - t)
    t = time.perf_counter()
    fp = e.fingerprint
    fp_time = time.perf_counter() - t
    print(f"\n1M-entry digest: {size / 2**20:.1f} MiB, load {min(times) * 1e3:.0f} ms "
          f"(best of 3; all {[round(x * 1e3) for x in times]} ms), fingerprint {fp_time * 1e3:.0f} ms")
    assert len(e) == n and e.num_paths == files and fp == d.fingerprint
    for i in (0, 1, 999, 123_456, n - 1):
        assert e.sha256(i) == hashes[i].tobytes() and e.size(i) == sizes[i]
        assert e.location(i) == (f"train/shard-{i // 1000:05d}-of-01000.tfrecord", i * 4096 + 12, sizes[i])
    assert size < 60 * 2**20  # ~52 bytes per entry + path table


# -- TFRecord framing and crc32c ---------------------------------------------------------


def test_crc32c_known_values() -> None:
    assert crcmod.crc32c(b"123456789") == 0xE3069283  # the standard check value
    assert crcmod.crc32c_py(b"123456789") == 0xE3069283
    assert crcmod.crc32c_py(b"6789", crcmod.crc32c_py(b"12345")) == 0xE3069283
    assert crcmod.crc32c(bytearray(32)) == 0x8A9136AA  # RFC 3720 B.4: 32 zero bytes


def test_tfrecord_round_trip_and_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    recs = [b"", b"a", os.urandom(5000)]
    raw = b"".join(map(encode_record, recs))
    got = list(iter_records(io.BytesIO(raw), "t"))
    assert [d for _, d in got] == recs
    assert [raw[o:o + len(d)] for o, d in got] == recs  # offsets point at the data
    # the framing TensorFlow writes: masked crc of the 8 length bytes
    assert raw[8:12] == struct.pack("<I", masked_crc(raw[:8]))

    monkeypatch.setattr(crcmod, "FAST", False)  # the pure-Python path must agree
    assert [d for _, d in iter_records(io.BytesIO(raw), "t")] == recs

    bad = bytearray(raw)
    bad[got[2][0] + 10] ^= 1
    with pytest.raises(RecordError, match=r"t: bad data crc in record at offset 33"):
        list(iter_records(io.BytesIO(bytes(bad)), "t"))
    assert len(list(iter_records(io.BytesIO(bytes(bad)), "t", verify_data_crc=False))) == 3
    with pytest.raises(RecordError, match="bad length crc at offset 0"):
        list(iter_records(io.BytesIO(b"\xff" * 40), "junk"))
    with pytest.raises(RecordError, match="truncated record at offset 33"):
        list(iter_records(io.BytesIO(raw[:-3]), "t"))
    with pytest.raises(RecordError, match="truncated record header"):
        list(iter_records(io.BytesIO(raw + b"\0\0"), "t"))


def test_tar_scan_rejects_compressed_and_truncated(tmp_path: Path) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        ti = tarfile.TarInfo("a.jpg")
        ti.size = 3
        tf.addfile(ti, io.BytesIO(b"abc"))
    with pytest.raises(ScanError, match="not an uncompressed tar"):
        scan("tar", io.BytesIO(buf.getvalue()), "s.tar.gz")
    make_dataset(tmp_path, "tar")
    raw = (tmp_path / "shard-0.tar").read_bytes()
    with pytest.raises(ScanError, match="shard-0.tar"):
        scan("tar", io.BytesIO(raw[:2048]), "shard-0.tar")
    assert zlib.crc32(raw)  # sanity: file non-empty


def _v2_digest() -> Digest:
    return Digest.from_arrays("file:///x", "tar", bytes(64), [1, 2], [512, 1536], [0, 0], ["s.tar"],
                              targets=[0, 1], classes=["a", "b"], names=["k.jpg", "k.cls"])


def test_v2_round_trip_and_checks() -> None:
    d = Digest.from_bytes(_v2_digest().to_bytes())
    assert (d.version, d.classes, d.name(1), d.target(1)) == (2, ["a", "b"], "k.cls", 1)
    assert pickle.loads(pickle.dumps(d)).name(0) == "k.jpg"
    with pytest.raises(DigestError, match="a target is not a class index"):
        Digest.from_arrays("file:///x", "files", bytes(32), [1], [0], [0], ["f"], targets=[2], classes=["a"])
    with pytest.raises(LookupError, match="records no targets"):
        sample_digest().target(0)
    with pytest.raises(LookupError, match="records no item names"):
        sample_digest().name(0)


def test_v2_flags_checked() -> None:
    raw = bytearray(sample_digest().to_bytes())  # version 1
    raw[11] = 1  # a flag in a version 1 file
    raw[60:64] = struct.pack("<I", zlib.crc32(bytes(raw[:60])))
    with pytest.raises(DigestError, match="inconsistent header"):
        Digest.from_bytes(bytes(raw))
    raw = bytearray(_v2_digest().to_bytes())
    raw[11] = 8  # an unknown flag
    raw[60:64] = struct.pack("<I", zlib.crc32(bytes(raw[:60])))
    with pytest.raises(DigestError, match="inconsistent header"):
        Digest.from_bytes(bytes(raw))
