"""Targets (ImageFolder classes, user labels) and WebDataset samples, end to end:
real files written with PIL and webdataset's ShardWriter, digested by tools/digest,
read through CachedDataset and compared with webdataset's own reader."""
import io
import json
import subprocess
import sys
import tarfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
Image = pytest.importorskip("PIL.Image")
wds = pytest.importorskip("webdataset")

from clients.dataset import CachedDataset  # noqa: E402
from clients.digest import Digest, DigestBuilder  # noqa: E402
from clients.samples import SampleError  # noqa: E402
from procs import cacheserver  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CLASSES = ["cat", "dog", "zebra"]


def digest(*args: str) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([sys.executable, str(REPO / "tools" / "digest"), *args, "-q"], capture_output=True,
                       text=True, timeout=60, cwd=REPO)
    return r


def png(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def image_folder(root: Path, per_class: int = 4) -> dict[str, str]:
    """ROOT/CLASS/N.png as torchvision's ImageFolder reads it; {relpath: class}."""
    out = {}
    for k, c in enumerate(reversed(CLASSES)):  # written out of order: classes are sorted by name
        (root / c).mkdir(parents=True)
        for j in range(per_class):
            (root / c / f"{j}.png").write_bytes(png(100 * k + j))
            out[f"{c}/{j}.png"] = c
    return out


def decode_png(data: bytes, entry) -> tuple:
    return np.asarray(Image.open(io.BytesIO(data))).shape, entry.path, entry.class_name


def test_image_folder_targets(tmp_path):
    labels = image_folder(tmp_path / "train")
    r = digest(str(tmp_path / "train"), "-o", str(tmp_path / "t.dig"), "--targets", "dir")
    assert r.returncode == 0, r.stderr
    ds = CachedDataset(tmp_path / "t.dig", cache=False, decode=decode_png, target="class")
    assert ds.classes == CLASSES and ds.class_to_idx == {"cat": 0, "dog": 1, "zebra": 2}
    seen = []
    for batch in ds.loader(batch_size=5):
        for (shape, path, cname), target in batch:
            assert shape == (8, 8, 3) and cname == labels[path] and target == CLASSES.index(labels[path])
            seen.append(path)
    assert sorted(seen) == sorted(labels)
    assert Digest.load(tmp_path / "t.dig").version == 3  # targets (2) and BLAKE3 (3)
    info = subprocess.run([sys.executable, str(REPO / "tools" / "digest"), "info", str(tmp_path / "t.dig")],
                          capture_output=True, text=True, cwd=REPO)
    assert "3 classes" in info.stdout


def test_user_labels_and_callable_target(tmp_path):
    image_folder(tmp_path / "d", per_class=2)
    paths = sorted(p.relative_to(tmp_path / "d").as_posix() for p in (tmp_path / "d").rglob("*.png"))
    (tmp_path / "l.csv").write_text("path,label\n" + "".join(f"{p},{7 * k}\n" for k, p in enumerate(paths)))
    assert digest(str(tmp_path / "d"), "-o", str(tmp_path / "l.dig"), "--targets", str(tmp_path / "l.csv")
                  ).returncode == 0
    ds = CachedDataset(tmp_path / "l.dig", cache=False, target="class")
    assert ds.classes == [] and [ds[i][1] for i in range(len(ds))] == [7 * k for k in range(len(paths))]
    (tmp_path / "l.json").write_text(json.dumps({p: p.split("/")[0].upper() for p in paths}))
    assert digest(str(tmp_path / "d"), "-o", str(tmp_path / "j.dig"), "--targets", str(tmp_path / "l.json")
                  ).returncode == 0
    ds = CachedDataset(tmp_path / "j.dig", cache=False, target=lambda e: (e.class_name, e.path))
    assert [ds[i][1] for i in range(len(ds))] == [(p.split("/")[0].upper(), p) for p in paths]


def test_target_errors(tmp_path):
    image_folder(tmp_path / "d", per_class=1)
    (tmp_path / "d" / "stray.png").write_bytes(png(9))
    r = digest(str(tmp_path / "d"), "-o", str(tmp_path / "x.dig"), "--targets", "dir")
    assert r.returncode == 1 and "'stray.png' is not inside a class directory" in r.stderr
    (tmp_path / "l.json").write_text(json.dumps({"cat/0.png": 1}))
    r = digest(str(tmp_path / "d"), "-o", str(tmp_path / "x.dig"), "--targets", str(tmp_path / "l.json"))
    assert r.returncode == 1 and "has no label for" in r.stderr and "'dog/0.png'" in r.stderr
    assert not (tmp_path / "x.dig").exists()
    assert digest(str(tmp_path / "d"), "-o", str(tmp_path / "plain.dig")).returncode == 0
    with pytest.raises(ValueError, match="records no targets; make it with tools/digest"):
        CachedDataset(tmp_path / "plain.dig", cache=False, target="class")
    with pytest.raises(ValueError, match="expected 'class'"):
        CachedDataset(tmp_path / "plain.dig", cache=False, target="label")


def test_old_digests_still_load(tmp_path):
    """A digest without targets or names is written as version 1, byte for byte as before."""
    b = DigestBuilder("file:///x", "files")
    b.add(bytes(32), 3, "a")
    raw = b.build().to_bytes()
    assert raw[8:10] == b"\x01\x00" and Digest.from_bytes(raw).version == 1
    d2 = Digest.from_arrays("file:///x", "files", bytes(32), [3], [0], [0], ["a"], targets=[1], classes=["a", "b"])
    back = Digest.from_bytes(d2.to_bytes())
    assert back.version == 2 and back.target(0) == 1 and back.classes == ["a", "b"]
    assert back.fingerprint == Digest.from_bytes(raw).fingerprint  # identity is content only


# -- WebDataset ---------------------------------------------------------------------


def write_shards(root: Path, n: int = 23, per_shard: int = 8) -> None:
    root.mkdir()
    rng = np.random.default_rng(3)
    with wds.ShardWriter(str(root / "shard-%04d.tar"), maxcount=per_shard, verbose=0) as w:
        for i in range(n):
            sample = {"__key__": f"s{i:05d}", "jpg": rng.bytes(int(rng.integers(10, 3000))), "cls": i % 5,
                      "json": {"i": i}}
            if i % 4 == 0:
                sample["txt"] = f"caption {i}"  # samples need not share a layout
            w.write(sample)


def reference(root: Path) -> dict[str, dict]:
    """webdataset's own reader over the same shards."""
    urls = [str(p) for p in sorted(root.glob("*.tar"))]
    return {s["__key__"]: {k: v for k, v in s.items() if not k.startswith("__")}
            for s in wds.WebDataset(urls, shardshuffle=False)}


def test_webdataset_samples_equal_webdatasets_reader(tmp_path):
    write_shards(tmp_path / "shards")
    r = digest(str(tmp_path / "shards"), "-o", str(tmp_path / "w.dig"), "--format", "tar")
    assert r.returncode == 0, r.stderr
    ref = reference(tmp_path / "shards")
    server = cacheserver(str(tmp_path / "srv"), "64MB").start()
    try:
        ds = CachedDataset(tmp_path / "w.dig", cache=server.address)
        assert len(ds) == len(ref) == 23
        for epoch in range(2):
            got = {}
            loader = ds.loader(batch_size=4, seed=epoch, num_workers=epoch)  # epoch 1: in a worker
            for batch in loader:
                for s in batch:
                    assert s["__url__"].endswith(".tar") and s["__key__"] not in got
                    got[s["__key__"]] = {k: v for k, v in s.items() if not k.startswith("__")}
            assert got == ref
        # the second epoch's samples came from the cache (a sample is cached when all members are)
        assert loader.epoch_stats[-1].hits == sum(len(v) for v in ref.values())
        assert ds.entry(0).name == "s00000"
        ds.close()
    finally:
        server.kill()


def tar_digest(where: Path, shard: str, names: list[str]) -> Path:
    """A tar shard of one-byte members with these names, digested; the digest's path."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name in names:
            ti = tarfile.TarInfo(name)
            ti.size = 1
            tf.addfile(ti, io.BytesIO(b"x"))
    where.mkdir()
    (where / shard).write_bytes(buf.getvalue())
    out = where.parent / f"{where.name}.dig"
    assert digest(str(where), "-o", str(out), "--format", "tar").returncode == 0
    return out


def test_webdataset_errors(tmp_path):
    write_shards(tmp_path / "shards", n=3)
    assert digest(str(tmp_path / "shards"), "-o", str(tmp_path / "w.dig"), "--format", "tar").returncode == 0
    d = Digest.load(tmp_path / "w.dig")
    v1 = Digest.from_arrays(d.root, d.kind, d.hashes, d.sizes, d.offsets, d.path_index, d.paths)
    assert v1.version == 1  # as an older tools/digest wrote it: no member names
    ds = CachedDataset(v1, cache=False)
    assert ds.samples is None and len(ds) == len(d)  # one item per member, as before
    with pytest.raises(SampleError, match="records no member names .* re-create it with tools/digest"):
        CachedDataset(v1, cache=False, samples=True)
    tar_digest(tmp_path / "dup", "d.tar", ["a.jpg", "a.JPG"])  # extensions lower-cased: twice jpg
    with pytest.raises(SampleError, match="d.tar: member 'a.JPG' repeats extension 'jpg' in sample 'a': "
                                          "not WebDataset shards\\? pass samples=False for one item per member"):
        CachedDataset(tmp_path / "dup.dig", cache=False)
    counts = Counter(type(x) for x in CachedDataset(tmp_path / "dup.dig", cache=False, samples=False)
                     .__getitems__([0, 1]))
    assert counts == {bytes: 2}
    tar_digest(tmp_path / "plain", "p.tar", ["data/0001", "data/0002"])  # plain files: no KEY.EXT names
    with pytest.raises(SampleError, match="has a WebDataset name .*pass samples=False for one item per member"):
        CachedDataset(tmp_path / "plain.dig", cache=False)
    assert len(CachedDataset(tmp_path / "plain.dig", cache=False, samples=False)) == 2


def test_labels_file_errors(tmp_path):
    from clients.targets import TargetError, derive

    paths = ["a/1.png", "b/2.png"]
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(TargetError, match="bad.json is not valid JSON"):
        derive(str(tmp_path / "bad.json"), paths)
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(TargetError, match="expected a JSON object"):
        derive(str(tmp_path / "list.json"), paths)
    (tmp_path / "f.json").write_text(json.dumps({"a/1.png": 1.5, "b/2.png": 2}))
    with pytest.raises(TargetError, match="label of 'a/1.png' must be a string or an integer, got 1.5"):
        derive(str(tmp_path / "f.json"), paths)
    (tmp_path / "x.csv").write_text("a/1.png,cat,extra\n")
    with pytest.raises(TargetError, match="x.csv, line 1: expected 'path,label'"):
        derive(str(tmp_path / "x.csv"), paths)
    with pytest.raises(TargetError, match="cannot read labels file .*missing.csv"):
        derive(str(tmp_path / "missing.csv"), paths)
    (tmp_path / "ok.csv").write_text("a/1.png,dog\nb/2.png,cat\n")
    assert derive(str(tmp_path / "ok.csv"), paths) == ([1, 0], ["cat", "dog"])


def test_samples_on_other_kinds_refused(tmp_path):
    image_folder(tmp_path / "d", per_class=1)
    assert digest(str(tmp_path / "d"), "-o", str(tmp_path / "f.dig")).returncode == 0
    with pytest.raises(ValueError, match="samples=True groups tar members .* is of kind files"):
        CachedDataset(tmp_path / "f.dig", cache=False, samples=True)


def test_plain_decode_builds_no_entries(tmp_path, monkeypatch):
    """The hit path: a decode(data) and no target= pay nothing per item for metadata;
    an Entry is built only for a decode that takes it, a target=, or an error's note."""
    from clients import itemview

    image_folder(tmp_path / "d", per_class=2)
    assert digest(str(tmp_path / "d"), "-o", str(tmp_path / "t.dig"), "--targets", "dir").returncode == 0
    built = []
    real = itemview.entry
    monkeypatch.setattr(itemview, "entry", lambda *a, **k: built.append(a[1]) or real(*a, **k))
    ds = CachedDataset(tmp_path / "t.dig", cache=False, decode=len)
    assert [x > 0 for x in ds.__getitems__(list(range(6)))] == [True] * 6 and built == []
    ds = CachedDataset(tmp_path / "t.dig", cache=False, decode=decode_png, target="class")
    assert ds[4][0][2] == CLASSES[ds[4][1]] and built == [4, 4]  # one Entry per item and call

    def bad(data):
        raise KeyError("nope")

    ds = CachedDataset(tmp_path / "t.dig", cache=False, decode=bad)
    with pytest.raises(KeyError) as e:
        ds[5]
    assert any("while decoding item 5 of" in n and ".png @ 0+" in n for n in e.value.__notes__)


def _decode_sized(data: bytes, size: int = 3) -> tuple:
    return len(data), size


def _decode_entry_default(data: bytes, entry=None) -> str:
    return entry.class_name


def test_decode_with_an_optional_second_parameter_keeps_it(tmp_path):
    """`def decode(data, size=224)` is a decode with an option, not one that asks for the
    Entry: it gets its default; a second parameter without a default, or named entry, or
    *args, gets the Entry."""
    from clients.itemview import takes_entry

    image_folder(tmp_path / "d", per_class=1)
    assert digest(str(tmp_path / "d"), "-o", str(tmp_path / "t.dig"), "--targets", "dir").returncode == 0
    ds = CachedDataset(tmp_path / "t.dig", cache=False, decode=_decode_sized)
    assert ds[0][1] == 3
    assert CachedDataset(tmp_path / "t.dig", cache=False, decode=_decode_entry_default)[0] == "cat"
    assert takes_entry(decode_png) and takes_entry(lambda *a: a) and not takes_entry(len)


def test_targets_checked_before_hashing(tmp_path):
    """A wrong --targets is named in seconds, before the (possibly hours long) scan: here the
    scan would stop first on a corrupt TFRecord file; and a labels file that is not text is
    named, not a traceback."""
    from clients.tfrecord import encode_record

    (tmp_path / "d" / "cat").mkdir(parents=True)
    (tmp_path / "d" / "cat" / "a.tfrecord").write_bytes(encode_record(b"x" * 9))
    (tmp_path / "d" / "junk.tfrecord").write_bytes(b"not a tfrecord file at all")
    r = digest(str(tmp_path / "d"), "-o", str(tmp_path / "x.dig"), "--format", "tfrecord", "--targets", "dir")
    assert r.returncode == 1 and "'junk.tfrecord' is not inside a class directory" in r.stderr, r.stderr
    (tmp_path / "l.csv").write_text("cat/a.tfrecord,1\n")
    r = digest(str(tmp_path / "d"), "-o", str(tmp_path / "x.dig"), "--format", "tfrecord",
               "--targets", str(tmp_path / "l.csv"))
    assert r.returncode == 1 and "has no label for 'junk.tfrecord'" in r.stderr, r.stderr
    (tmp_path / "bin.csv").write_bytes(b"\x90\xff\x00")
    r = digest(str(tmp_path / "d"), "-o", str(tmp_path / "x.dig"), "--targets", str(tmp_path / "bin.csv"))
    assert r.returncode == 1 and "bin.csv is not UTF-8 text" in r.stderr and "Traceback" not in r.stderr
    r = digest(str(tmp_path / "d"), "-o", str(tmp_path / "x.dig"), "--targets", "dirs")
    assert r.returncode == 1 and "cannot read labels file dirs" in r.stderr and "--targets takes 'dir'" in r.stderr
    assert not (tmp_path / "x.dig").exists()


def test_targets_of_shards_and_records(tmp_path):
    """--targets dir on tar shards and TFRecord files in class directories: each WebDataset
    sample (and each record) gets its file's class."""
    from clients.tfrecord import encode_record

    for c in ("cat", "dog"):
        (tmp_path / "w" / c).mkdir(parents=True)
        with wds.ShardWriter(str(tmp_path / "w" / c / "s-%03d.tar"), maxcount=3, verbose=0) as w:
            for i in range(4):
                w.write({"__key__": f"{c}{i}", "jpg": c.encode() * (i + 1), "txt": str(i)})
        (tmp_path / "r" / c).mkdir(parents=True)
        (tmp_path / "r" / c / "x.tfrecord").write_bytes(b"".join(encode_record(c.encode() * k) for k in (1, 2)))
    assert digest(str(tmp_path / "w"), "-o", str(tmp_path / "w.dig"), "--format", "tar", "--targets", "dir"
                  ).returncode == 0
    ds = CachedDataset(tmp_path / "w.dig", cache=False, target="class")
    got = {s["__key__"]: (s["jpg"], t) for b in ds.loader(batch_size=3) for s, t in b}
    assert got == {f"{c}{i}": (c.encode() * (i + 1), k) for k, c in enumerate(("cat", "dog")) for i in range(4)}
    assert digest(str(tmp_path / "r"), "-o", str(tmp_path / "r.dig"), "--format", "tfrecord", "--targets", "dir"
                  ).returncode == 0
    ds = CachedDataset(tmp_path / "r.dig", cache=False, target="class")
    assert sorted(ds[i] for i in range(len(ds))) == [(b"cat", 0), (b"catcat", 0), (b"dog", 1), (b"dogdog", 1)]
