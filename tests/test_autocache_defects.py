"""Autocache defects found in review: real cache server, real files."""
import math
import os
import struct
import sys

import pytest

pytest.importorskip("torch")
sys.path.insert(0, os.path.dirname(__file__))

from autocache_steps import Slow, as_array, blow_up, head, noise, shrink, total  # noqa: E402
from clients.dataset import CachedDataset  # noqa: E402
from filedigest import write_files_digest  # noqa: E402
from preprocess import Pipeline, autocache, step  # noqa: E402
from test_autocache import collect, make_items  # noqa: E402

pytestmark = pytest.mark.timeout(240)


def index_of(data: bytes) -> int:
    return struct.unpack_from("<q", data)[0]


def fail_on_3(i: int) -> int:
    if i == 3:
        raise ValueError("bad item 3")
    return i


def times10(i: int) -> int:
    return i * 10


def plus1(i: int) -> int:
    return i + 1


def test_the_probes_own_puts_do_not_make_a_rerun_found(tmp_path, server):
    # the probe puts the sample's outputs whatever is decided; the same job run again (same
    # seed, same sample) found them and took "transformed" as if another job had made the set
    path = make_items(tmp_path / "ds", n=96, size=4096)
    p = Pipeline([as_array, blow_up, autocache, head])  # 2 MiB outputs: transformed is dearer
    first = CachedDataset(path, cache=server.address, transform=p)
    lo = first.loader(8, num_workers=0, seed=3, autocache="auto", epochs=3, cost_dir=False)
    sample = list(lo.preprocess.sample_indices)
    assert lo.autocache.mode != "transformed", lo.autocache.reason
    lo.close()
    again = CachedDataset(path, cache=server.address, transform=p)
    lo = again.loader(8, num_workers=0, seed=3, autocache="auto", epochs=3, cost_dir=False)
    try:
        assert lo.preprocess.sample_indices == sample
        t = lo.autocache.transformed()
        assert all(t.lookup([again.digest.hashes[i].tobytes() for i in sample]))  # the probe's puts
        assert lo.autocache.state != "found", lo.autocache.reason
    finally:
        lo.close()


def test_an_epoch_shorter_than_a_batch_is_decided(tmp_path, server, monkeypatch):
    import manager.policy.autocache as policy

    monkeypatch.setattr(policy, "CLEAR", math.inf)  # measured, not decided on the estimate
    path = make_items(tmp_path / "ds", n=6, size=4096)
    p = Pipeline([as_array, Slow(0.005), shrink, autocache, step(noise, random=True), total])
    ds = CachedDataset(path, cache=server.address, transform=p)
    lo = ds.loader(8, num_workers=0, seed=3, autocache="auto", epochs=3, cost_dir=False)
    try:
        assert lo.autocache.state == "measuring"
        (_, s1), = collect(lo, 1)  # 6 items, fewer than a batch: measured whole, then decided
        assert s1.items == 6 and lo.autocache.state == "decided", lo.autocache.reason
        assert not lo.autocache.shared.keep()  # no longer putting speculatively
        assert lo.autocache.threshold(6, 8) == 6 and lo.autocache.threshold(1000, 8) == 100
    finally:
        lo.close()


def test_probe_puts_each_sample_output_under_its_own_source(tmp_path, server):
    """Before: _profile re-traced AutoOrder's order with every sample item's context where
    only the items that got through the first trace came in: outputs went under other
    items' keys (item 3 held item 8's output) and transformed mode would serve them."""
    n = 16  # all in the sample; item 3 fails a step there, so the trace leaves it out
    path = write_files_digest(tmp_path / "ds", (struct.pack("<q", i) + bytes(56) for i in range(n)))
    p = Pipeline([index_of, fail_on_3, times10, plus1], auto_order=True)
    ds = CachedDataset(path, cache=server.address, transform=p)
    lo = ds.loader(4, num_workers=0, seed=3, autocache="auto", epochs=3, cost_dir=False, on_error="skip")
    try:
        got = lo.autocache.transformed().get([ds.digest.hashes[i].tobytes() for i in range(n)])
        wrong = {i: v for i, v in enumerate(got) if v is not None and v != 10 * i + 1}
        assert not wrong  # a transformed item made from another item would be served as this one's
    finally:
        lo.close()


def test_closing_a_putter_whose_put_thread_is_stuck_returns(monkeypatch):
    """Before: close() waited the flush limit, then put its stop marker into a full queue
    with no time limit: a put stuck on its server held the loader's close for ever."""
    import threading
    import time

    from clients import autofeed
    from clients.stats import SharedCounters

    monkeypatch.setattr(autofeed, "FLUSH_LIMIT", 0.2)
    release = threading.Event()

    class Stuck:  # a transformed set whose put never returns until released
        def encode(self, x):
            return b"x"

        def put_payloads(self, Ks, payloads, chunk, replace):
            release.wait(30)
            return len(Ks)

    p = autofeed.Putter(SharedCounters())
    t = Stuck()
    filler = threading.Thread(target=lambda: [p.add((t, bytes([k % 256]) * 32, 0, False), k)
                                              for k in range(autofeed.PUT_QUEUE + autofeed.PUT_BATCH + 8)],
                              daemon=True)
    filler.start()
    deadline = time.monotonic() + 10
    while p.q.qsize() < autofeed.PUT_QUEUE and time.monotonic() < deadline:
        time.sleep(0.01)
    assert p.q.full()
    t0 = time.monotonic()
    closer = threading.Thread(target=p.close, daemon=True)
    closer.start()
    closer.join(5)
    stuck = closer.is_alive()
    release.set()
    assert not stuck and time.monotonic() - t0 < 5
