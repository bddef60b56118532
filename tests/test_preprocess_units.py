"""preprocess/: fingerprints, AutoOrder, the determinism check, seeds, the timeout,
the worker-count rule and the cost memory (pure logic, no worker processes)."""
import functools
import io
import threading

import numpy as np
import pytest

from preprocess import Pipeline, Uncacheable, step
from preprocess import vision
from preprocess.autoorder import choose_order, reorder, revise, sections
from preprocess.costs import CostMemory
from preprocess.determinism import check_declared
from preprocess.fingerprint import fingerprint
from preprocess.pipeline import ItemContext
from preprocess.profile import trace
from preprocess.timeout import SlowTimeout
from preprocess.workerctl import next_workers

SCALE = 2


def helper(x):
    return x * SCALE


def uses_helper(x):
    return helper(x) + 1


def add_one(x):
    return x + 1


def add_two(x):
    return x + 2


class Crop:
    def __init__(self, n):
        self.n = n

    def __call__(self, x):
        return x[:self.n]


def noisy(x):
    return x + np.random.random()


# ---- fingerprints ---------------------------------------------------------------
def test_fingerprint_follows_code_constants_defaults_closures_and_globals(monkeypatch):
    assert fingerprint(add_one) != fingerprint(add_two)          # a constant
    assert fingerprint(Crop(3)) == fingerprint(Crop(3))
    assert fingerprint(Crop(3)) != fingerprint(Crop(4))          # a parameter
    assert fingerprint(functools.partial(Crop, 3)) != fingerprint(functools.partial(Crop, 4))

    def make(k):
        return lambda x: x + k
    assert fingerprint(make(1)) == fingerprint(make(1))
    assert fingerprint(make(1)) != fingerprint(make(2))           # a closure

    def with_default(x, k=1):
        return x + k
    before = fingerprint(with_default)
    with_default.__defaults__ = (2,)
    assert fingerprint(with_default) != before                   # a default

    before = fingerprint(uses_helper)
    monkeypatch.setattr(__import__(__name__), "SCALE", 3)        # a global of a global function
    assert fingerprint(uses_helper) != before


def test_library_classes_are_keyed_by_version():
    assert "numpy-" in fingerprint.__globals__["library_version"]("numpy")
    assert fingerprint(np.float32) == fingerprint(np.float32)


def test_unfingerprintable_step_fails_closed_naming_it():
    lock = threading.Lock()

    def locked(x):
        with lock:
            return x
    p = Pipeline([add_one, locked])
    with pytest.raises(Uncacheable, match=r"step 1 \(.*locked\).*lock"):
        p.fingerprint()
    with pytest.raises(Uncacheable, match="open resource|no state"):
        fingerprint(io.BytesIO(b"x"))


def test_cacheable_prefix_ends_at_first_random_step_and_order_is_in_the_key():
    p = Pipeline([add_one, step(noisy, random=True), add_two])
    assert p.cacheable_prefix() == 1
    assert p.prefix_fingerprint() == Pipeline([add_one]).fingerprint(1)
    key = p.fingerprint()
    p.set_order([0, 2, 1])
    assert p.fingerprint() != key
    assert p.cacheable_prefix() == 2


# ---- seeds and the determinism check ------------------------------------------------
def test_random_steps_are_seeded_per_job_epoch_and_item():
    p = Pipeline([step(noisy, random=True)])
    a = p.apply(0.0, ItemContext(1, 0, b"item-a"))
    assert p.apply(0.0, ItemContext(1, 0, b"item-a")) == a
    assert p.apply(0.0, ItemContext(1, 1, b"item-a")) != a
    assert p.apply(0.0, ItemContext(2, 0, b"item-a")) != a
    assert p.apply(0.0, ItemContext(1, 0, b"item-b")) != a


def test_undeclared_random_step_is_caught_and_reported():
    p = Pipeline([add_one, noisy, add_two])
    tr = trace(p, [1.0, 2.0, 3.0], [ItemContext(0, 0, bytes([k])) for k in range(3)])
    with pytest.warns(UserWarning, match=r"step 1 \(noisy\) is not declared random"):
        caught = check_declared(p, tr)
    assert set(caught) == {1}
    assert p.is_random(1) and p.cacheable_prefix() == 1


# ---- AutoOrder ------------------------------------------------------------------
def test_reorder_moves_deflating_first_inflating_last_within_sections():
    factors = {0: 4.0, 1: 0.5, 2: 1.0, 3: 0.3, 4: 4.0, 5: 0.5}
    always = lambda prefix, a, b: True  # noqa: E731
    order, _ = reorder(range(6), set(), factors, always)
    assert order == (1, 3, 5, 2, 0, 4)  # stable within a class
    order, _ = reorder(range(6), {2}, factors, always)  # 2 is a barrier
    assert order == (1, 0, 2, 3, 5, 4)
    assert sections([0, 1, 2, 3], {0, 3}) == [(1, 3)]
    never = lambda prefix, a, b: False  # noqa: E731
    assert reorder(range(6), set(), factors, never)[0] == tuple(range(6))
    assert reorder([0, 1], set(), {0: 0.5, 1: 0.2}, always, last={0})[0] == (1, 0)


def _jpegs(n=6):
    from PIL import Image
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        a = (rng.random((120, 160, 3)) * 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(a).save(buf, "JPEG", quality=85)
        out.append(buf.getvalue())
    return out


def test_auto_order_on_the_resnet_chain_keeps_dependencies():
    pytest.importorskip("PIL")
    steps = [vision.decode_jpeg, vision.to_float, vision.Normalize(), vision.RandomCrop(), vision.Resize(64),
             vision.RandomFlip(), vision.Cast()]
    p = Pipeline(steps, auto_order=True)
    items = _jpegs()
    ctxs = [ItemContext(0, 0, bytes([k])) for k in range(len(items))]
    report = choose_order(p, trace(p, items, ctxs))
    names = [p.steps[j].name for j in p.order]
    assert names[0] == "decode_jpeg"                      # changes type: stays
    assert names.index("RandomCrop") < names.index("to_float")   # deflating before inflating
    assert names.index("Resize") < names.index("to_float")
    assert names.index("RandomCrop") < names.index("Resize")     # not commutable: kept
    assert names.index("to_float") < names.index("Normalize")    # not commutable: kept
    assert names[-1] == "Cast"                                   # half precision: last
    assert "AutoOrder" in report and "AutoOrder" in p.describe()
    written = Pipeline(steps)
    for x, c in zip(items, ctxs):  # same result as written, within rounding
        a, b = written.apply(x, c), p.apply(x, c)
        assert a.shape == b.shape == (64, 64, 3) and a.dtype == b.dtype
        assert np.abs(a.astype(np.float32) - b.astype(np.float32)).max() < 0.05


def scale2(x):
    return x * 2


def every_other(x):
    return x[::2]


def test_order_is_revised_after_the_first_epoch_when_a_class_changed():
    p = Pipeline([scale2, every_other], auto_order=True)
    tr = trace(p, [np.arange(8.0), np.arange(6.0)], [ItemContext(0, 0, b"a"), ItemContext(0, 0, b"b")])
    p.auto_factors = {0: 1.0, 1: 1.0}  # as if the sample had shown both neutral
    assert revise(p, {0: (100, 100), 1: (100, 100)}, tr) is None and p.order == (0, 1)
    report = revise(p, {0: (100, 100), 1: (100, 50)}, tr)  # the epoch: every_other deflates
    assert report is not None and p.order == (1, 0) and "every_other before scale2" in report


# ---- scheduling policies -----------------------------------------------------------
def test_worker_count_rule():
    assert next_workers(4, fill=0.0, cpu=0.2, max_workers=16) == 6     # starving, CPU free: +2 at most
    assert next_workers(4, fill=1.0, cpu=0.95, max_workers=16) == 2    # ahead and CPU busy: -2
    assert next_workers(4, fill=0.5, cpu=0.7, max_workers=16) == 4     # on target
    assert next_workers(2, fill=0.0, cpu=0.0, max_workers=2) == 2      # bounded by the cores
    assert next_workers(1, fill=1.0, cpu=1.0, max_workers=8) == 1      # at least one
    assert next_workers(4, fill=0.0, cpu=1.0, max_workers=16) <= 5     # CPU saturated: no big growth


def test_slow_timeout_is_the_75th_percentile():
    t = SlowTimeout()
    for k in range(7):
        t.add(0.01)
    assert t.seconds is None  # too few yet
    for k in range(45):
        t.add(0.01 if k % 4 else 0.5)
    assert t.seconds == pytest.approx(0.01)
    assert SlowTimeout([0.0001] * 20).seconds == pytest.approx(0.002)  # floor


def test_cost_memory_is_shared_across_jobs_and_smoothed(tmp_path):
    a = CostMemory(str(tmp_path), "pipe")
    a.update([(b"\x01" * 32, 1.0), (b"\x02" * 32, 0.1)])
    b = CostMemory(str(tmp_path), "pipe")  # another job
    assert b.load() == {b"\x01" * 16: 1.0, b"\x02" * 16: 0.1}
    b.update([(b"\x01" * 32, 0.0)])
    assert a.load()[b"\x01" * 16] == pytest.approx(0.5)
    assert CostMemory(str(tmp_path), "other").load() == {}  # per pipeline
    a.close()
    b.close()


def test_unpicklable_step_is_refused_naming_it():
    p = Pipeline([add_one, lambda x: x])
    with pytest.raises(TypeError, match=r"step 1 \(.*lambda.*\) cannot be pickled.*workers are separate processes"):
        p.check_picklable()


def test_torch_style_transform_objects_are_steps_with_keys():
    torch = pytest.importorskip("torch")
    p = Pipeline([torch.nn.Flatten(), torch.nn.Dropout(0.5)])
    q = Pipeline([torch.nn.Flatten(), torch.nn.Dropout(0.25)])
    assert p.fingerprint() != q.fingerprint()
    assert p.fingerprint() == Pipeline([torch.nn.Flatten(), torch.nn.Dropout(0.5)]).fingerprint()
    tr = trace(p, [torch.ones(4, 4)] * 2, [ItemContext(0, 0, b"a"), ItemContext(0, 0, b"b")])
    with pytest.warns(UserWarning, match="Dropout"):
        assert set(check_declared(p, tr)) == {1}  # dropout draws random numbers: caught
