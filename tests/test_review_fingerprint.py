"""Review of what decides whether a cached transformed item may be served: breaks of the
key (a step changed whose key stayed), of the random-step check (a random step cached)
and of per-item seeds (items of other content drawing alike). Real pipelines through
CachedDataset's loader with an embedded cache (cache_dir=), in this process."""
import functools
import hashlib
import importlib
import io
import os
import random
import subprocess
import sys
import tarfile

import numpy as np
import pytest

pytest.importorskip("torch")
sys.path.insert(0, os.path.dirname(__file__))

from clients.dataset import CachedDataset  # noqa: E402
from filedigest import write_files_digest  # noqa: E402
from preprocess import Pipeline, step  # noqa: E402
from preprocess.fingerprint import fingerprint, library_version  # noqa: E402
from test_autocache import wait_kept  # noqa: E402

pytestmark = pytest.mark.timeout(240)
N, B = 24, 8
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def as_array(data: bytes) -> np.ndarray:
    return np.frombuffer(data, np.uint8).astype(np.float32)


def sometimes_invert(x: np.ndarray) -> np.ndarray:
    """torchvision's RandomInvert(p=0.2), written without random=True."""
    return 255 - x if random.random() < 0.2 else x


def head(x: np.ndarray) -> float:
    return float(x[0])


def draw(sample: dict) -> tuple:
    return sample["__key__"], random.random()


def _items(root) -> str:
    blobs = (hashlib.sha256(b"fp" + i.to_bytes(4, "little")).digest() * 4 for i in range(N))
    return write_files_digest(root, blobs)


def _epoch(loader) -> list:
    return sorted(x for batch in loader for x in batch)


def _job(path, cache_dir, transform, opened: list) -> tuple[list, dict]:
    """One epoch in transformed mode, its puts waited for; the dataset stays open (in
    `opened`) so that the next job shares its embedded cache."""
    ds = CachedDataset(path, cache_dir=cache_dir, transform=transform)
    opened.append(ds)
    loader = ds.loader(B, num_workers=0, seed=1, autocache="transformed", cost_dir=False)
    try:
        out = _epoch(loader)
        wait_kept(ds, loader, N)
        return out, dict(loader.epoch_stats[-1].transformed)
    finally:
        loader.close()


def _module(tmp_path, monkeypatch, name: str, source: str, where=None):
    """Write (or rewrite) module `name` and import (or reload) it from its source."""
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # a rewrite in the same second: no stale .pyc
    d = where or tmp_path
    (d / f"{name}.py").write_text(source)
    importlib.invalidate_caches()
    if name in sys.modules:
        return importlib.reload(sys.modules[name])
    monkeypatch.syspath_prepend(str(d))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return importlib.import_module(name)


# ---- a random step the determinism check missed was cached ---------------------------------

def test_a_coin_flip_not_declared_random_is_caught_and_not_served_in_later_epochs(tmp_path):
    """Both runs of the check start from a freshly seeded generator, the same two seeds for
    every item: a coin flip with p=0.2 (0.51 and 0.38 drawn under the two seeds) came out
    alike on every sample item. Before: not caught, the whole pipeline cached, and every
    later epoch was served the first epoch's flips."""
    ds = CachedDataset(_items(tmp_path / "ds"), cache_dir=str(tmp_path / "emb"),
                       transform=Pipeline([as_array, sometimes_invert, head]))
    with pytest.warns(UserWarning, match="sometimes_invert"):
        loader = ds.loader(B, num_workers=0, seed=3, autocache="transformed", cost_dir=False)
    try:
        assert 1 in loader.preprocess.pipeline.caught_random
        assert loader.autocache.cut == 1  # kept: as_array's output only
        epochs = [_epoch(loader) for _ in range(3)]
        assert loader.epoch_stats[-1].transformed["hits"] == N
        assert epochs[0] != epochs[1] or epochs[1] != epochs[2]  # drawn anew per epoch
    finally:
        loader.close()
        ds.close()


# ---- items of other content drew alike -------------------------------------------------------

def test_webdataset_samples_sharing_their_first_member_draw_apart(tmp_path):
    """A WebDataset sample was seeded by its first member's digest: with the label first
    (`000001.cls` sorts before `000001.jpg`) every sample of a class drew the same numbers,
    the same crop and flip for all of its images in an epoch."""
    (tmp_path / "shards").mkdir()
    with tarfile.open(tmp_path / "shards" / "s-0.tar", "w") as t:
        for i in range(12):
            for ext, data in (("cls", str(i % 2).encode()), ("bin", hashlib.sha256(bytes([i])).digest())):
                info = tarfile.TarInfo(f"{i:06d}.{ext}")
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))
    r = subprocess.run([sys.executable, os.path.join(REPO, "tools", "digest"), str(tmp_path / "shards"), "-o",
                        str(tmp_path / "s.dig"), "-f", "tar", "-q"], capture_output=True, text=True, timeout=60,
                       cwd=REPO)
    assert r.returncode == 0, r.stderr
    ds = CachedDataset(str(tmp_path / "s.dig"), cache_dir=str(tmp_path / "emb"),
                       transform=Pipeline([step(draw, random=True)]))
    loader = ds.loader(4, num_workers=0, seed=0, cost_dir=False)
    try:
        out = _epoch(loader)
    finally:
        loader.close()
        ds.close()
    assert len(out) == 12
    assert len({x for _, x in out}) == 12, out  # before: two values, one per class


# ---- a step changed whose key stayed: served another step's outputs --------------------------

V1 = "def scale(x, a=1.0, b=2.0):\n    return x * a + b\n"
V2 = "def scale(x, b=1.0, a=2.0):\n    return x * b + a\n"  # the same bytecode and defaults


def test_renamed_parameters_change_the_key(tmp_path, monkeypatch):
    """A function's argument names were not in its key: with partial(scale, a=5.0) the
    edited function (a and b renamed) computes x+5 where the first made x*5+2, from the
    same bytecode and defaults. Before: the second job was served the first's outputs."""
    path, emb, opened = _items(tmp_path / "ds"), str(tmp_path / "emb"), []
    try:
        m = _module(tmp_path, monkeypatch, "review_fp_scale", V1)
        first, _ = _job(path, emb, Pipeline([as_array, functools.partial(m.scale, a=5.0), head]), opened)
        m = _module(tmp_path, monkeypatch, "review_fp_scale", V2)
        p2 = Pipeline([as_array, functools.partial(m.scale, a=5.0), head])
        second, stats = _job(path, emb, p2, opened)
        assert stats["hits"] == 0
        assert second == sorted(p2.apply(ds_item) for ds_item in _raw(path))
        assert second == sorted((x - 2) / 5 + 5 for x in first)
    finally:
        for ds in opened:
            ds.close()


def _raw(path) -> list[bytes]:
    ds = CachedDataset(path, cache=False)
    try:
        return [ds[i] for i in range(len(ds))]
    finally:
        ds.close()


def test_positional_only_parameters_and_try_ranges_are_in_the_key():
    def compile_(src: str):
        g = {"__name__": "review_fp_user"}
        exec(src, g)
        return g["f"]

    # a partial's keyword binds to **kw when the parameter is positional-only: 1 against 5
    p, q = (functools.partial(compile_(f"def f(x, a=1{sep}**kw):\n    return a\n"), a=5) for sep in (", /, ", ", "))
    assert (p(0), q(0)) == (1, 5)
    assert fingerprint(p) != fingerprint(q)
    # the same bytecode, other exception tables: -1 against TypeError for an int
    wide = compile_("def f(x):\n    try: a = x[0]; b = a[1]\n    except TypeError: b = -1\n    return b\n")
    narrow = compile_("def f(x):\n    a = x[0]\n    try: b = a[1]\n    except TypeError: b = -1\n    return b\n")
    assert wide.__code__.co_code == narrow.__code__.co_code
    assert wide(5) == -1
    with pytest.raises(TypeError):
        narrow(5)
    assert fingerprint(wide) != fingerprint(narrow)


def scaled(x):
    return x * scaled.factor


def test_function_attributes_are_in_the_key():
    """`scaled.factor = 2` is read by the code (a function's flags are attributes too)."""
    scaled.factor = 2
    try:
        two = fingerprint(scaled)
        scaled.factor = 3
        assert fingerprint(scaled) != two
    finally:
        del scaled.factor


def test_ellipsis_and_slices_are_keyed_not_refused():
    """x[..., ::-1] put Ellipsis among the code's constants, which was Uncacheable (and a
    slice parameter too): such steps were never cached."""
    def flip(x):
        return x[..., ::-1]

    def keep(x):
        return x[..., :]

    assert fingerprint(flip) != fingerprint(keep)
    assert fingerprint(slice(0, 224)) != fingerprint(slice(0, 256))
    assert fingerprint(slice(0, 2)) != fingerprint((0, 2, None))


EDITABLE_V1 = "class Scale:\n    def __call__(self, x):\n        return x * 2\n"
EDITABLE_V2 = "class Scale:\n    def __call__(self, x):\n        return x * 3\n"


def _distribution(site, name: str) -> None:
    info = site / f"{name}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "top_level.txt").write_text(name + "\n")


def test_a_class_of_an_editable_install_is_keyed_by_its_code(tmp_path, monkeypatch):
    """A user's own project installed with pip install -e: its classes were keyed by name
    and version, which do not change as the code is edited. Before: the edited step was
    served the old one's outputs."""
    site, proj = tmp_path / "site", tmp_path / "proj"
    proj.mkdir()
    _distribution(site, "review_fp_editable")
    monkeypatch.syspath_prepend(str(site))  # the metadata in site-packages, the code in the project
    library_version.cache_clear()
    path, emb, opened = _items(tmp_path / "ds"), str(tmp_path / "emb"), []
    try:
        m = _module(tmp_path, monkeypatch, "review_fp_editable", EDITABLE_V1, where=proj)
        assert library_version("review_fp_editable") == ""
        first, _ = _job(path, emb, Pipeline([as_array, m.Scale(), head]), opened)
        m = _module(tmp_path, monkeypatch, "review_fp_editable", EDITABLE_V2, where=proj)
        second, stats = _job(path, emb, Pipeline([as_array, m.Scale(), head]), opened)
        assert stats["hits"] == 0
        assert second == [x * 1.5 for x in first]
    finally:
        for ds in opened:
            ds.close()
        library_version.cache_clear()


def test_an_installed_copy_is_still_keyed_by_its_version(tmp_path, monkeypatch):
    site = tmp_path / "site"
    _distribution(site, "review_fp_installed")
    monkeypatch.syspath_prepend(str(site))
    library_version.cache_clear()
    try:
        _module(tmp_path, monkeypatch, "review_fp_installed", EDITABLE_V1, where=site)
        assert library_version("review_fp_installed") == "review_fp_installed-1.0"
    finally:
        library_version.cache_clear()


def test_a_source_of_non_deterministic_ints_makes_a_chain_random():
    tf = pytest.importorskip("tensorflow")
    from preprocess.tf_fingerprint import chain_fingerprint

    def fresh_seed(x):
        seed = tf.raw_ops.NonDeterministicInts(shape=[2], dtype=tf.int64)
        return tf.random.stateless_uniform([], seed=seed)

    assert chain_fingerprint(lambda ds: ds.map(fresh_seed)).random
