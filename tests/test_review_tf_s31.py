"""tf_dataset review (s31): resuming an epoch from a saved state with map_fn= run in real
preprocessing worker processes, and what a state saved with the defaults (read ahead of
the training loop) does to a resume. Real cacheserver processes, real TFRecords, real tf.data."""
import contextlib
import os
import time
import warnings
from collections import Counter

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
tf = pytest.importorskip("tensorflow", reason="TensorFlow is not installed (the 'tf' extra)")

from clients import tf_dataset  # noqa: E402
from clients.tf_source import InexactStateWarning  # noqa: E402
from tfexamples import digested_shards, parse  # noqa: E402

pytestmark = pytest.mark.timeout(400)
N = 160
RB = 16  # read_batch
CUT = 48  # items the training loop took before the state is saved: 3 batches of RB


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    digest, _, records = digested_shards(str(tmp_path_factory.mktemp("tfs31")), N)
    return digest, records


def ragged(record):
    """Outputs whose shape varies per item: not stackable, handed over one item per call."""
    return tf.io.decode_raw(parse(record)["image"], tf.uint8)


def ident(x) -> bytes:
    if isinstance(x, dict):
        return bytes(x["image"])
    return x.tobytes() if hasattr(x, "tobytes") else bytes(x)


def reference(fn, records) -> Counter:
    return Counter(ident(fn(r).numpy() if fn is ragged else {"image": fn(r)["image"].numpy()})
                   for r in records)


def take_and_save(ds, n: int) -> tuple[dict, list[bytes]]:
    it = ds.as_numpy_iterator()
    first = [ident(next(it)) for _ in range(n)]
    time.sleep(0.5)  # time for anything reading ahead of the loop to be counted
    return ds.mlcache.state_dict(), first


@pytest.mark.parametrize("fn", [parse, ragged], ids=["stacked", "single"])
def test_resume_with_map_fn_workers_yields_each_item_once(shards, module_server, tmp_path, fn):
    """An epoch read CUT items in, saved, resumed by a new tf_dataset(state=) whose map_fn runs in
    two worker processes: every item of the epoch exactly once across the two parts."""
    digest, records = shards
    kw = dict(cache=module_server.address, seed=3, read_batch=RB, read_ahead=0, map_fn=fn, num_workers=2,
              cost_dir=str(tmp_path / "costs"))
    ds = tf_dataset(digest, **kw)
    try:
        assert len(ds.mlcache.preprocess.pool.procs) == 2
        state, first = take_and_save(ds, CUT)
    finally:
        ds.mlcache.close()
    assert (state["sampler"]["epoch"], state["sampler"]["items_delivered"]) == (0, CUT), state["sampler"]
    again = tf_dataset(digest, state=state, **kw)
    try:
        rest = [ident(x) for x in again.as_numpy_iterator()]
        everything = reference(fn, records)
        assert len(everything) == N
        assert Counter(first + rest) == everything, (len(first), len(rest))
        st = again.mlcache.epoch_stats[-1]
        assert (st.epoch, st.items, st.complete) == (0, N - CUT, True), st.line()
    finally:
        again.mlcache.close()


def chain(ds):
    return ds.map(parse)


# tf_dataset arguments of each path: Feed (plain), Starter (autocache chain, map_fn in this process)
PATHS = {
    "plain": {},
    "chain": {"transform": chain, "autocache": "transformed"},
    "map_fn": {"map_fn": parse, "num_workers": 0, "cost_dir": False},
}
RB_ODD = 24  # 160 = 6 * 24 + 16: the epoch ends with a partial batch


@pytest.mark.parametrize("path", list(PATHS))
def test_exact_recipe_holds_through_the_last_partial_batch(shards, module_server, path):
    """What docs/client.md promises for read_ahead=0, read_parallel=1, a cut at a multiple of
    read_batch: every item once across the cut, with the epoch's last batch partial; a state
    saved once the loop took every item (the iterator not yet at its end) starts the next
    epoch whole; neither state is marked inexact nor warns."""
    digest, records = shards
    kw = dict(cache=module_server.address, seed=5, read_batch=RB_ODD, read_ahead=0, **PATHS[path])
    everything = reference(parse, records) if path != "plain" else Counter(records)
    with warnings_recorded() as seen:
        ds = tf_dataset(digest, **kw)
        try:
            state, first = take_and_save(ds, 5 * RB_ODD)
            it = ds.as_numpy_iterator()
            whole = [ident(next(it)) for _ in range(N)]  # a new pass: epoch 1, every item, iterator not ended
            end_state = ds.mlcache.state_dict()
        finally:
            ds.mlcache.close()
        assert "reads_ahead" not in state and Counter(whole) == everything
        assert (state["sampler"]["epoch"], state["sampler"]["items_delivered"]) == (0, 5 * RB_ODD)
        assert (end_state["sampler"]["epoch"], end_state["sampler"]["items_delivered"]) == (2, 0)
        again = tf_dataset(digest, state=state, **kw)
        try:
            rest = [ident(x) for x in again.as_numpy_iterator()]
            assert len(rest) == N - 5 * RB_ODD and Counter(first + rest) == everything
        finally:
            again.mlcache.close()
        after = tf_dataset(digest, state=end_state, **kw)
        try:
            assert int(after.cardinality()) == N  # a whole epoch: declared
            assert Counter(ident(x) for x in after.as_numpy_iterator()) == everything
            assert after.mlcache.epoch_stats[-1].epoch == 2
        finally:
            after.mlcache.close()
    assert not [w for w in seen if issubclass(w.category, InexactStateWarning)]


@contextlib.contextmanager
def warnings_recorded():
    """The warnings given inside, every one (not once per place, as by default)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        yield seen


# what reads ahead of the loop on each path: read_ahead's prefetch (or tf.data's injected one), read_parallel
AHEAD = {
    "plain-defaults": ({}, {"read_ahead": 4, "read_parallel": 1}),
    "plain-parallel": ({"read_ahead": 0, "read_parallel": 2}, {"read_ahead": 0, "read_parallel": 2}),
    "chain-defaults": (PATHS["chain"], {"read_ahead": 4, "read_parallel": 1}),
    "map_fn-defaults": ({**PATHS["map_fn"], "read_parallel": 2}, {"read_ahead": 4, "read_parallel": 1}),
}


@pytest.mark.parametrize("case", list(AHEAD))
def test_a_state_saved_reading_ahead_says_so_and_its_resume_warns(shards, module_server, case):
    """Before: with the defaults (read_ahead=4) a state saved CUT items in counted the batches
    read ahead as taken (128 of 48 on the plain path; read_parallel=2: 80; the injected prefetch
    of the chain and map_fn paths: 64), and a resume left those items out without a word. Now
    the state records what read ahead ("reads_ahead"), the save warns once and the resume warns,
    naming read_ahead=0; the items it leaves out are exactly those the state counted untaken."""
    digest, records = shards
    args, ahead = AHEAD[case]
    kw = dict(cache=module_server.address, seed=7, read_batch=RB, **args)
    ds = tf_dataset(digest, **kw)
    try:
        with pytest.warns(InexactStateWarning, match=r"read_ahead=\d, read_parallel=\d\).*save it with read_ahead=0"):
            state, first = take_and_save(ds, CUT)
        with warnings_recorded() as seen:
            assert ds.mlcache.state_dict() == state  # warned once per dataset: states are saved often
        assert not seen
    finally:
        ds.mlcache.close()
    assert state["reads_ahead"] == ahead
    counted = state["sampler"]["items_delivered"]
    assert counted > CUT, state["sampler"]  # the read-ahead this warns of is real
    with pytest.warns(InexactStateWarning, match=rf"saved {counted} items into epoch 0 .* leaves them out"):
        again = tf_dataset(digest, state=state, **kw)
    try:
        rest = [ident(x) for x in again.as_numpy_iterator()]
    finally:
        again.mlcache.close()
    everything = Counter(records) if "plain" in case else reference(parse, records)
    assert len(rest) == N - counted and not (Counter(first) & Counter(rest))
    assert sum((everything - Counter(first + rest)).values()) == counted - CUT  # lost: those read ahead


def test_a_damaged_reads_ahead_is_refused_naming_it(shards, module_server):
    digest, _ = shards
    kw = dict(cache=module_server.address, seed=7, read_batch=RB)
    ds = tf_dataset(digest, **kw)
    try:
        with pytest.warns(InexactStateWarning):
            state, _ = take_and_save(ds, CUT)
    finally:
        ds.mlcache.close()
    with pytest.raises(ValueError, match=r"the state's 'reads_ahead' must be a dict of integers"):
        tf_dataset(digest, state={**state, "reads_ahead": "4"}, **kw)


def test_a_mid_epoch_state_loaded_where_none_is_declared_warns_too(shards, module_server):
    """map_fn with on_error="skip" declares no cardinality, so ds.mlcache.load_state_dict takes a
    mid-epoch state (no tf_dataset(state=) needed): a state saved reading ahead warns there too."""
    digest, _ = shards
    kw = dict(cache=module_server.address, seed=9, read_batch=RB, map_fn=parse, num_workers=0, cost_dir=False,
              on_error="skip")
    ds = tf_dataset(digest, **kw)
    try:
        with pytest.warns(InexactStateWarning):
            state, _ = take_and_save(ds, CUT)
    finally:
        ds.mlcache.close()
    other = tf_dataset(digest, **kw)
    try:
        assert int(other.cardinality()) == tf.data.UNKNOWN_CARDINALITY
        with pytest.warns(InexactStateWarning, match=r"this resumed epoch was saved \d+ items into epoch 0"):
            other.mlcache.load_state_dict(state)
        with pytest.warns(InexactStateWarning, match=r"this state is saved"):  # loaded, not run: still inexact
            assert other.mlcache.state_dict() == state
    finally:
        other.mlcache.close()


def test_a_resumed_state_is_saved_as_exact_as_it_was_loaded(shards, module_server):
    """A resumed dataset saves, before its epoch starts, the state it loaded: an exact one
    (read_ahead=0) stays unmarked though this dataset reads ahead, an inexact one stays marked
    with what read ahead then; once this dataset has read, its own read-ahead marks it."""
    digest, _ = shards
    kw = dict(cache=module_server.address, seed=11, read_batch=RB)
    ds = tf_dataset(digest, read_ahead=0, **kw)
    try:
        exact, _ = take_and_save(ds, CUT)
    finally:
        ds.mlcache.close()
    assert "reads_ahead" not in exact
    with warnings_recorded() as seen:
        again = tf_dataset(digest, state=exact, **kw)  # read_ahead=4
        try:
            assert again.mlcache.state_dict() == exact
            assert not [w for w in seen if issubclass(w.category, InexactStateWarning)]
            with pytest.warns(InexactStateWarning, match=r"read_ahead=4, read_parallel=1"):
                later, _ = take_and_save(again, RB)
            assert later["reads_ahead"] == {"read_ahead": 4, "read_parallel": 1}
        finally:
            again.mlcache.close()
    inexact = {**exact, "reads_ahead": {"read_ahead": 0, "read_parallel": 2}}
    with pytest.warns(InexactStateWarning, match=r"this resumed epoch was saved 48 items into epoch 0"):
        third = tf_dataset(digest, state=inexact, read_ahead=0, **kw)
    try:
        assert third.mlcache.reads_ahead() is None
        with pytest.warns(InexactStateWarning, match=r"read_ahead=0, read_parallel=2"):
            assert third.mlcache.state_dict() == inexact
    finally:
        third.mlcache.close()


def test_drop_last_is_refused_naming_what_to_do(shards, module_server):
    """Before: CachedDataset.__init__'s "unexpected keyword argument 'drop_last'"."""
    with pytest.raises(TypeError, match=r"tf_dataset does not take drop_last=.*drop_remainder=True"):
        tf_dataset(shards[0], cache=module_server.address, drop_last=True)


def test_near_an_epochs_end_read_ahead_makes_the_next_epochs_state_as_documented(shards, module_server):
    """The limit docs/client.md states: with read_ahead the reads of an epoch may end before the
    loop took its last batches; a state saved then is the next epoch's, whole (nothing marks it:
    an epoch-end checkpoint, the common one, looks the same), and the untaken items are lost."""
    digest, _ = shards
    ds = tf_dataset(digest, cache=module_server.address, seed=13, read_batch=RB)  # read_ahead=4
    try:
        state, _ = take_and_save(ds, N - 3 * RB)
    finally:
        ds.mlcache.close()
    assert (state["sampler"]["epoch"], state["sampler"]["items_delivered"]) == (1, 0), state["sampler"]


def test_a_prefetch_after_tf_dataset_is_not_seen_as_documented(shards, module_server):
    """docs/client.md: read_ahead=0 and a .batch(8).prefetch(2) after tf_dataset: the state
    counts what the prefetch took (more than the loop), and cannot know to mark it."""
    digest, _ = shards
    ds = tf_dataset(digest, cache=module_server.address, seed=13, read_batch=RB, read_ahead=0)
    try:
        it = iter(ds.batch(8).prefetch(2))
        for _ in range(CUT // 8):
            next(it)
        time.sleep(0.5)
        with warnings_recorded() as seen:
            state = ds.mlcache.state_dict()
        assert state["sampler"]["items_delivered"] > CUT and "reads_ahead" not in state and not seen
    finally:
        ds.mlcache.close()
