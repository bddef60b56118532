"""Steps that change their input in place (`x -= x.mean()`, common in numpy code): the
trace keeps every intermediate, and AutoOrder and the determinism check run steps on
them again, so each step runs on its own copy there."""
import numpy as np

from preprocess import Pipeline
from preprocess.autoorder import choose_order
from preprocess.determinism import check_declared
from preprocess.pipeline import ItemContext
from preprocess.profile import trace


def decode(b):
    rng = np.random.default_rng(int.from_bytes(b[:4], "little"))
    return rng.random((32, 32)) * np.linspace(0, 4, 32)[None, :]  # columns differ: a crop's mean differs


def center(x):  # in place
    x -= x.mean()
    return x


def crop(x):  # deflating: AutoOrder would move it first if it commuted
    return x[:8, :8]


def double(x):  # in place
    x *= 2
    return x


ITEMS = [bytes([k, 1, 2, 3]) for k in range(8)]
CTXS = [ItemContext(0, -1, bytes(32)) for _ in ITEMS]


def test_autoorder_does_not_swap_in_place_steps_that_do_not_commute():
    p = Pipeline([decode, center, crop], auto_order=True)
    report = choose_order(p, trace(p, ITEMS, CTXS))
    assert p.order == (0, 1, 2), report
    assert np.allclose(p.apply(ITEMS[0]), Pipeline([decode, center, crop]).apply(ITEMS[0]))


def test_the_trace_keeps_each_steps_output_as_it_was_made():
    p = Pipeline([decode, double, double])
    tr = trace(p, ITEMS, CTXS)
    for pos in range(1, 4):
        assert all(np.allclose(x, decode(b) * 2 ** (pos - 1)) for x, b in zip(tr.inputs[pos], ITEMS))
    assert check_declared(p, tr) == {}  # deterministic, though each run changes what it is given
    assert all(np.allclose(x, decode(b)) for x, b in zip(tr.inputs[1], ITEMS))
