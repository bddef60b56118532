"""Fingerprint collisions (a cached item served for the wrong transform), the
transformed-item codec's lossy cases and long seed keys: one test per defect."""
import functools
import hashlib
import importlib
import re
import sys
import threading

import numpy as np
import pytest

from preprocess import Pipeline, Uncacheable
from preprocess.codec import CodecError, _U32, _U64, decode, encode
from preprocess.fingerprint import fingerprint
from preprocess.seeding import item_seed


def test_torch_modules_are_keyed_by_their_weights():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    m1 = torch.nn.Linear(4, 4)
    torch.manual_seed(1)
    m2 = torch.nn.Linear(4, 4)
    assert Pipeline([m1]).fingerprint() != Pipeline([m2]).fingerprint()
    m3 = torch.nn.Linear(4, 4)
    m3.load_state_dict(m1.state_dict())
    assert Pipeline([m1]).fingerprint() == Pipeline([m3]).fingerprint()  # equal weights, equal key


def test_bound_builtin_methods_are_keyed_by_their_object():
    assert fingerprint({"a": 1}.get) != fingerprint({"a": 2}.get)
    assert fingerprint({"a": 1}.get) == fingerprint({"a": 1}.get)
    sub_space = functools.partial(re.compile(r"\s+").sub, " ")
    sub_vowel = functools.partial(re.compile(r"[aeiou]").sub, " ")
    assert fingerprint(sub_space) != fingerprint(sub_vowel)
    assert fingerprint(re.compile("a", re.I).match) != fingerprint(re.compile("a").match)
    with pytest.raises(Uncacheable):  # an object that cannot be keyed: refused, not ignored
        fingerprint(threading.Lock().acquire)


def _scale_class(factor):
    class Scale:
        FACTOR = factor

        def __call__(self, x):
            return x * self.FACTOR
    return Scale


def test_class_attributes_are_parameters():
    two, three = _scale_class(2), _scale_class(3)
    assert two.__qualname__ == three.__qualname__
    assert fingerprint(two()) != fingerprint(three())
    assert fingerprint(two()) == fingerprint(_scale_class(2)())


def _write(path, text):
    path.write_text(text)
    importlib.invalidate_caches()


def test_edits_to_a_users_helper_module_change_the_key(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    (tmp_path / "fpc_pkg").mkdir()
    _write(tmp_path / "fpc_pkg" / "__init__.py", "")
    _write(tmp_path / "fpc_pkg" / "sub.py", "def scale(x):\n    return x * 2\n")
    _write(tmp_path / "fpc_helper.py", "def scale(x):\n    return x * 2\n")
    _write(tmp_path / "fpc_steps.py", "import fpc_helper\nimport fpc_pkg.sub\n\n\n"
           "def direct(x):\n    return fpc_helper.scale(x)\n\n\n"
           "def nested(x):\n    return fpc_pkg.sub.scale(x)\n")
    steps = importlib.import_module("fpc_steps")
    before = fingerprint(steps.direct), fingerprint(steps.nested)
    assert before == (fingerprint(steps.direct), fingerprint(steps.nested))  # stable while unchanged
    _write(tmp_path / "fpc_helper.py", "def scale(x):\n    return x * 30\n")
    _write(tmp_path / "fpc_pkg" / "sub.py", "def scale(x):\n    return x * 30\n")
    importlib.reload(sys.modules["fpc_helper"])
    importlib.reload(sys.modules["fpc_pkg.sub"])
    assert steps.direct(1) == steps.nested(1) == 30
    assert fingerprint(steps.direct) != before[0]
    assert fingerprint(steps.nested) != before[1]  # a submodule: its package's file did not change
    for name in ("fpc_steps", "fpc_helper", "fpc_pkg.sub", "fpc_pkg"):
        sys.modules.pop(name, None)


def test_object_arrays_are_keyed_by_their_elements_not_addresses():
    def table(*words):  # fresh str objects: other addresses each call
        return np.array(["".join(list(w)) for w in words], dtype=object)
    a, b = table("cat", "dog"), table("cat", "dog")
    assert a[0] is not b[0]
    assert fingerprint(functools.partial(np.take, a)) == fingerprint(functools.partial(np.take, b))
    assert fingerprint(a) != fingerprint(table("cat", "cow"))


class _BScale:
    def __init__(self, w):
        import torch
        self.w = torch.tensor(w, dtype=torch.bfloat16)

    def __call__(self, x):
        return x * self.w


def test_bfloat16_tensors_are_keyed_stored_and_odd_tensors_refused():
    torch = pytest.importorskip("torch")
    assert Pipeline([_BScale(2.0)]).fingerprint() != Pipeline([_BScale(3.0)]).fingerprint()
    t = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3) / 3
    back = decode(encode(t))
    assert back.dtype == torch.bfloat16 and torch.equal(back, t)
    assert decode(encode(torch.tensor(1.5, dtype=torch.bfloat16))).shape == ()
    with pytest.raises(Uncacheable, match="step 0"):  # not a TypeError out of loader creation
        Pipeline([functools.partial(torch.mul, torch.ones(2).to_sparse())]).fingerprint()


def test_palette_images_keep_their_palette():
    Image = pytest.importorskip("PIL.Image")
    img = Image.new("P", (2, 1))
    img.putpalette([255, 0, 0, 0, 255, 0])
    img.putpixel((1, 0), 1)
    img.info["transparency"] = 1
    back = decode(encode(img))
    assert back.convert("RGBA").tobytes() == img.convert("RGBA").tobytes()
    pa = Image.new("PA", (2, 1))
    pa.putpalette([9, 8, 7, 6] * 2, "RGBA")
    assert decode(encode(pa)).convert("RGBA").tobytes() == pa.convert("RGBA").tobytes()
    # a palette image in the old layout (no palette): recomputed, never served blank
    old = b"MLT1p\x01P" + _U32.pack(2) + _U32.pack(1) + _U64.pack(2) + b"\x00\x01"
    with pytest.raises(CodecError):
        decode(old)


def test_long_job_seeds_keep_epoch_and_step_in_the_item_seed():
    d = bytes(32)
    assert item_seed(10**70, 0, d, 1) != item_seed(10**70, 7, d, 3)
    assert item_seed(10**70, 0, d, 1) == item_seed(10**70, 0, d, 1)
    for seed, epoch, step in ((0, 0, 0), (12345, 3, 2), (10**40, 99, 7)):  # short keys: the seeds as before
        key = f"{seed}/{epoch}/{step}".encode()
        assert len(key) <= 64
        old = hashlib.blake2b(d, digest_size=8, key=key).digest()
        assert item_seed(seed, epoch, d, step) == int.from_bytes(old, "little")
