"""Transformed-item keys (clients/derived.py) and their payload format (preprocess/codec.py)."""
import hashlib
import os
import time

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
    assert type(out["meta"][7][0]) is np.int64  # a numpy scalar stays one (not a 1-element array)
    zero_d = decode(encode(np.array(5.0)))
    assert zero_d.shape == () and zero_d == 5.0


def test_codec_keeps_shapes_of_scalars_and_zero_d_arrays():
    for x in (np.int64(3), np.float32(2.5), np.array(7, np.int16), np.zeros((2, 0, 3)), np.arange(6).reshape(2, 3).T):
        y = decode(encode(x))
        assert type(y) is type(x) and y.shape == x.shape and y.dtype == x.dtype and np.array_equal(y, x)
    t = decode(encode(torch.tensor(1.5)))
    assert isinstance(t, torch.Tensor) and t.shape == () and float(t) == 1.5


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


def test_transformed_items_on_a_real_server(server):
    """TransformedItems: what one job puts another finds; another transform or source misses;
    a tampered value is counted poisoned and read as a miss."""
    from cacheserver.client.ring_client import RingClient
    from clients.transformed import TransformedItems, transformed_tag

    Ks = [hashlib.sha256(bytes([i])).digest() for i in range(4)]
    items = [{"x": np.full((8, 8), i, np.uint8), "label": i} for i in range(4)]
    with RingClient([server.address]) as ring:
        a = TransformedItems(ring, "job-a", "ds", "fp1")
        assert a.get(Ks) == [None] * 4 and a.counts.misses == 4
        assert a.put(Ks, items) == 4 and a.tag == transformed_tag("ds", "fp1")
        b = TransformedItems(ring, "job-b", "ds", "fp1")  # another job, same pipeline: shares
        got = b.get(Ks)
        assert all(np.array_equal(g["x"], it["x"]) and g["label"] == it["label"] for g, it in zip(got, items))
        assert b.counts.hits == 4
        assert TransformedItems(ring, "job-b", "ds", "fp2").get(Ks) == [None] * 4  # changed transform
        other = [hashlib.sha256(b"other" + K).digest() for K in Ks]
        assert TransformedItems(ring, "job-c", "ds", "fp1").get(other) == [None] * 4
        # a value stored under a's id but made with another key fails authentication
        forged = seal_derived(derived_key(Ks[1], "fp1"), encode("forged"))
        ring.put([(b.ids(Ks[:1])[0], forged.value)], "evil", "ds", 0, replace=True)
        c = TransformedItems(ring, "job-c", "ds", "fp1")
        assert c.get(Ks[:1]) == [None] and c.counts.poisoned == 1
        assert c.put([Ks[0]], [object()]) == 0 and "cannot be cached" in c.counts.uncacheable[0]


def test_the_put_probe_is_not_moved_by_one_stalled_put(server):
    """clients.automeasure.put_seconds: the sample's outputs go in PUT_GROUPS puts and the
    median per item counts, so one put held up (as by the server's flush of the others)
    does not make the estimate; every output is stored, each once."""
    from cacheserver.client.ring_client import RingClient
    from clients.automeasure import PUT_GROUPS, put_seconds
    from clients.transformed import TransformedItems

    class Stalls:  # a real ring whose first put waits, as one held up by a flush
        def __init__(self, ring, stall_s):
            self.ring, self.stall_s, self.calls = ring, stall_s, 0

        def put(self, *a, **kw):
            self.calls += 1
            if self.calls == 1:
                time.sleep(self.stall_s)
            return self.ring.put(*a, **kw)

        def batch_limit(self):
            return self.ring.batch_limit()

    Ks = [hashlib.sha256(b"probe%d" % i).digest() for i in range(16)]
    with RingClient([server.address]) as ring:
        slow = Stalls(ring, 0.5)
        t = TransformedItems(slow, "job", "ds", "fp-put")
        pairs = [(K, t.encode(os.urandom(64 << 10))) for K in Ks]
        per = put_seconds(t, pairs, 0)
        assert slow.calls == PUT_GROUPS >= 3
        assert per < 0.5 / len(Ks), per  # one put in one go would cost at least the stall
        assert t.counts.inserted == len(Ks)
        assert all(v is not None for v in TransformedItems(ring, "job2", "ds", "fp-put").get(Ks))
