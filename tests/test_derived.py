"""Transformed-item keys (clients/derived.py) and their payload format (preprocess/codec.py)."""
import hashlib

import numpy as np
import pytest
import torch
from PIL import Image

from clients.capability import PoisonedValue, item_id
from clients.derived import derived_id, derived_key, open_derived, seal_derived
from preprocess.codec import CodecError, decode, encode
from preprocess.fingerprint import Uncacheable

K = hashlib.sha256(b"source item").digest()


def test_keys_depend_on_source_fingerprint_and_seed():
    base = derived_key(K, "fp-a")
    assert derived_key(K, "fp-a") == base
    others = {derived_key(K, "fp-b"), derived_key(hashlib.sha256(b"x").digest(), "fp-a"),
              derived_key(K, "fp-a", 0), derived_key(K, "fp-a", 1)}
    assert base not in others and len(others) == 4
    assert derived_id(base) != item_id(base)  # never collides with a source id of the same bytes


def test_bad_key_inputs_are_refused():
    with pytest.raises(ValueError, match="32-byte"):
        derived_key(K[:31], "fp")
    with pytest.raises(ValueError, match="fingerprint"):
        derived_key(K, "")
    with pytest.raises(ValueError, match="64 bits"):
        derived_key(K, "fp", 1 << 64)


def test_seal_open_round_trip_and_tamper():
    Kt = derived_key(K, "fp")
    s = seal_derived(Kt, b"payload")
    assert s.id == derived_id(Kt) and b"payload" not in s.value
    assert open_derived(Kt, s.value) == b"payload"
    bad = bytearray(s.value)
    bad[-1] ^= 1
    with pytest.raises(PoisonedValue, match="authentication"):
        open_derived(Kt, bytes(bad))
    with pytest.raises(PoisonedValue, match="authentication"):
        open_derived(derived_key(K, "other"), s.value)  # a different transform's key
    with pytest.raises(PoisonedValue, match="bytes"):
        open_derived(Kt, s.value[:-1])
    with pytest.raises(PoisonedValue):
        open_derived(Kt, s.value, max_size=3)


def test_codec_round_trips_supported_types():
    item = {"x": np.arange(12, dtype=np.float32).reshape(3, 4), "t": torch.ones(2, 3, dtype=torch.int16),
            "meta": [1, -2, 3.5, "s", b"b", None, True, (np.int64(7),)], 3: Image.new("RGB", (4, 2), (1, 2, 3))}
    out = decode(encode(item))
    assert np.array_equal(out["x"], item["x"]) and out["x"].flags.writeable
    assert isinstance(out["t"], torch.Tensor) and torch.equal(out["t"], item["t"])
    assert out["meta"][:7] == [1, -2, 3.5, "s", b"b", None, True] and out["meta"][7] == (7,)
    assert out[3].tobytes() == item[3].tobytes() and out[3].mode == "RGB"


def test_codec_refuses_what_it_cannot_store():
    for bad in (object(), np.array([object()]), {(1, 2): 3}, 1 << 70):
        with pytest.raises(Uncacheable):
            encode(bad)


def test_codec_refuses_malformed_payloads():
    good = encode([np.zeros(4), "x"])
    for bad in (b"", b"XXXX" + good[4:], good[:-1], good + b"\0", good[:4] + b"?"):
        with pytest.raises(CodecError):
            decode(bad)
    import struct
    forged = b"MLT1" + b"d" + struct.pack("<I", 1) + b"l" + struct.pack("<I", 0) + b"N"
    with pytest.raises(CodecError, match="dict key"):
        decode(forged)
