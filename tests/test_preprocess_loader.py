"""preprocess/ through CachedDataset: real worker processes, real files."""
import hashlib
import io
import os
import random
import struct
import sys
from collections import Counter

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.dirname(__file__))

from clients.dataset import CachedDataset  # noqa: E402
from clients.digest import DigestBuilder  # noqa: E402
from filedigest import write_files_digest  # noqa: E402
from clients.sampler import SubstitutableBatchSampler  # noqa: E402
from preprocess import Pipeline, PipelineError  # noqa: E402
from preprocess.costs import CostMemory  # noqa: E402
from preprocess_steps import FailOn, HalveBut, SleepOn, first, index_mod3, index_of, pad  # noqa: E402
from preprocess_steps import scale_values, with_values  # noqa: E402

pytestmark = pytest.mark.timeout(180)


def indexed_items(root, n):
    """n files whose first 8 bytes are their index; returns the digest path."""
    return write_files_digest(root, (struct.pack("<q", i) + os.urandom(24) for i in range(n)))


def first_batch(n, batch, seed):
    return next(iter(SubstitutableBatchSampler(n, batch, None, seed=seed)))


def test_slow_item_never_holds_back_its_batch_and_everything_comes_once(tmp_path):
    n, B, seed = 96, 8, 3
    path = indexed_items(tmp_path / "ds", n)
    slow = first_batch(n, B, seed)[0]  # in the sampler's first batch
    pipe = Pipeline([index_of, SleepOn({slow}, 0.4), SleepOn({slow}, 0.4), pad, first])
    ds = CachedDataset(path, cache=False, transform=pipe)
    loader = ds.loader(B, num_workers=2, seed=seed, cost_dir=str(tmp_path / "costs"))
    try:
        for epoch in range(2):
            batches = list(loader)
            got = [i for b in batches for i in b]
            assert Counter(got) == Counter(range(n))                  # exactly once
            assert all(len(b) == B for b in batches[:-1])              # full but the last
            assert slow not in batches[0]                              # a later batch took it
            st = loader.epoch_stats[-1].preprocess
            assert st.items == n and st.skipped == 0 and st.moved >= 1
            assert [s.items for s in st.steps.values()] == [n] * 5     # every step timed, per item
            assert st.steps[3].bytes_out > st.steps[3].bytes_in        # pad inflates
            assert "preprocess:" in loader.epoch_stats[-1].line()
        assert loader.epoch_stats[-1].preprocess.known_slow_first >= 1  # remembered from epoch 0
        assert loader.preprocess.yielded() == set(range(n))
    finally:
        loader.close()
    # another job over the same files knows the slow item before it starts
    ds2 = CachedDataset(path, cache=False, transform=pipe)
    loader2 = ds2.loader(B, num_workers=1, seed=seed + 1, cost_dir=str(tmp_path / "costs"))
    try:
        assert sorted(i for b in loader2 for i in b) == list(range(n))
        assert loader2.epoch_stats[-1].preprocess.known_slow_first == 1
    finally:
        loader2.close()


def test_on_error_skip_counts_and_raise_names_item_and_step(tmp_path):
    n = 40
    path = indexed_items(tmp_path / "ds", n)
    pipe = Pipeline([index_of, FailOn(7)])
    loader = CachedDataset(path, cache=False, transform=pipe).loader(4, num_workers=2, on_error="skip",
                                                                    cost_dir=False)
    try:
        got = [i for b in loader for i in b]
        assert sorted(got) == [i for i in range(n) if i % 7]
        st = loader.epoch_stats[-1].preprocess
        assert st.skipped == len([i for i in range(n) if i % 7 == 0])
        assert "FailOn" in st.errors[0]
    finally:
        loader.close()
    loader = CachedDataset(path, cache=False, transform=pipe).loader(4, num_workers=1, cost_dir=False)
    try:
        with pytest.raises(PipelineError, match=r"item \d+ \(.*\): step 1 \(FailOn\) raised.*bad item"):
            list(loader)
    finally:
        loader.close()


def test_unpicklable_step_refused_before_workers_start(tmp_path):
    path = indexed_items(tmp_path / "ds", 8)
    ds = CachedDataset(path, cache=False, transform=[index_of, lambda i: i])
    with pytest.raises(TypeError, match=r"step 1 .*cannot be pickled.*workers are separate processes"):
        ds.loader(4, num_workers=2)


def test_adaptive_worker_count_and_torch_scheduler(tmp_path):
    n = 64
    path = indexed_items(tmp_path / "ds", n)
    ds = CachedDataset(path, cache=False, transform=[index_of, SleepOn(range(0, n, 2), 0.01)])
    loader = ds.loader(8, num_workers=None, cost_dir=False)
    try:
        assert sorted(i for b in loader for i in b) == list(range(n))
        workers = loader.epoch_stats[-1].preprocess.workers
        assert workers and all(1 <= w <= max(1, len(os.sched_getaffinity(0))) for w in workers)
    finally:
        loader.close()
    assert ds[5] == 5  # in-process: the transform applies to ds[i] too
    peer = ds.loader(8, num_workers=2, scheduler="torch")
    assert sorted(i for b in peer for i in b) == list(range(n))


def test_auto_order_through_the_loader(tmp_path):
    pytest.importorskip("PIL")
    import numpy as np
    from PIL import Image

    from preprocess import vision
    root = tmp_path / "img"
    os.makedirs(root)
    b = DigestBuilder(str(root), "files")
    rng = np.random.default_rng(0)
    for i in range(24):
        buf = io.BytesIO()
        Image.fromarray((rng.random((90, 120, 3)) * 255).astype(np.uint8)).save(buf, "JPEG")
        data = buf.getvalue()
        (root / f"{i}.jpg").write_bytes(data)
        b.add(hashlib.sha256(data).digest(), len(data), f"{i}.jpg")
    b.build().save(str(root) + ".digest")
    steps = [vision.decode_jpeg, vision.to_float, vision.RandomCrop(), vision.Resize(32), vision.RandomFlip(),
             vision.Normalize(), vision.Cast()]
    pipe = Pipeline(steps, auto_order=True)
    ds = CachedDataset(str(root) + ".digest", cache=False, transform=pipe)
    loader = ds.loader(8, num_workers=2, cost_dir=False)
    try:
        for _ in range(2):
            out = [x for b in loader for x in b]
            assert len(out) == 24 and all(x.shape == (32, 32, 3) and x.dtype == np.float16 for x in out)
        order = [pipe.steps[j].name for j in loader.preprocess.pipeline.order]
        assert order.index("Resize") < order.index("to_float")
        assert "AutoOrder" in loader.epoch_stats[-1].preprocess.order
        assert loader.preprocess.fingerprint and loader.preprocess.uncacheable is None
    finally:
        loader.close()


def test_through_the_embedded_cache_second_epoch_hits(tmp_path):
    n = 48
    path = indexed_items(tmp_path / "ds", n)
    ds = CachedDataset(path, cache_dir=str(tmp_path / "cache"), capacity="64MB", transform=[index_of, pad, first])
    loader = ds.loader(8, num_workers=2, seed=1, cost_dir=False)
    try:
        for _ in range(2):
            assert sorted(i for b in loader for i in b) == list(range(n))
        first_epoch, second = loader.epoch_stats
        # the sample profiled when the loader was made is read (and inserted) outside any epoch
        assert first_epoch.hits + first_epoch.misses == n and first_epoch.inserted == first_epoch.misses > 0
        assert second.hits == n and second.misses == 0
    finally:
        loader.close()
        ds.close()


def test_iteration_bounded_mode_drops_slow_stragglers_and_says_so(tmp_path):
    n, B, seed = 32, 8, 5
    path = indexed_items(tmp_path / "ds", n)
    slow = first_batch(n, B, seed)[-1]
    pipe = Pipeline([index_of, SleepOn({slow}, 1.0), SleepOn({slow}, 1.0)])
    loader = CachedDataset(path, cache=False, transform=pipe).loader(B, num_workers=1, seed=seed, cost_dir=False,
                                                                    exactly_once=False)
    try:
        got = [i for b in loader for i in b]
        st = loader.epoch_stats[-1].preprocess
        assert st.dropped == 1 and slow not in got and sorted(got + [slow]) == list(range(n))
        assert "1 dropped, " in st.line()
    finally:
        loader.close()


def test_a_killed_worker_is_replaced_and_its_items_rerun(tmp_path):
    import signal
    import time
    n, B = 64, 8
    path = indexed_items(tmp_path / "ds", n)
    pipe = Pipeline([index_of, SleepOn(range(n), 0.02)])
    loader = CachedDataset(path, cache=False, transform=pipe).loader(B, num_workers=2, cost_dir=False)
    try:
        got = []
        for k, batch in enumerate(loader):
            got.extend(batch)
            if k == 1:
                victim = next(iter(loader.preprocess.pool.procs.values()))
                os.kill(victim.pid, signal.SIGKILL)
                victim.join(5)
                time.sleep(0.2)
        assert Counter(got) == Counter(range(n))  # nothing lost, nothing twice
        st = loader.epoch_stats[-1].preprocess
        assert st.rerun >= 1 and st.items == n
        assert loader.preprocess.pool.size == 2
    finally:
        loader.close()


def test_a_slow_consumer_gets_the_last_items_too(tmp_path):
    """Regression: with the ready-batch queue full when the sampler ran dry, the items
    still waiting to be sent were dropped from the epoch's end."""
    import time
    n = 96
    path = indexed_items(tmp_path / "ds", n)
    loader = CachedDataset(path, cache=False, transform=[index_of]).loader(8, num_workers=2, cost_dir=False)
    try:
        for _ in range(2):
            got = []
            for batch in loader:
                got.extend(batch)
                time.sleep(0.05)
            assert sorted(got) == list(range(n))
    finally:
        loader.close()


def test_resume_targets_and_drop_last_with_a_transform(tmp_path):
    n, B = 60, 8
    path = indexed_items(tmp_path / "ds", n)
    pipe = Pipeline([index_of, SleepOn({3, 17, 42}, 0.2)])
    ds = CachedDataset(path, cache=False, transform=pipe, target=index_mod3)
    loader = ds.loader(B, num_workers=2, seed=7, cost_dir=False)
    try:
        seen = []
        for k, batch in enumerate(loader):  # (sample, target): the transform saw the sample only
            assert all(t == i % 3 for i, t in batch)
            seen.extend(i for i, _ in batch)
            if k == 2:
                break
        state = loader.state_dict()
    finally:
        loader.close()
    assert state["sampler"]["items_delivered"] == len(seen) == 3 * B
    resumed = CachedDataset(path, cache=False, transform=pipe, target=index_mod3).loader(
        B, num_workers=2, seed=7, cost_dir=False, drop_last=True)
    try:
        resumed.load_state_dict(state)
        rest = [i for b in resumed for i, _ in b]
        # the saved epoch's other items, exactly once, in full batches (drop_last: a short tail is cut)
        assert not set(rest) & set(seen) and len(rest) == (n - len(seen)) // B * B
        assert len(set(rest)) == len(rest)
    finally:
        resumed.close()


def test_num_workers_zero_runs_the_pipeline_in_process(tmp_path):
    n = 20
    path = indexed_items(tmp_path / "ds", n)
    loader = CachedDataset(path, cache=False, transform=[index_of, FailOn(9), pad, first]).loader(
        4, num_workers=0, on_error="skip", cost_dir=False)
    got = [i for b in loader for i in b]
    assert sorted(got) == [i for i in range(n) if i % 9]
    st = loader.epoch_stats[-1].preprocess
    assert st.skipped == 3 and st.items == n - 3 and st.workers == [0]
    assert loader.epoch_stats[-1].items == n - 3  # delivered, as the sampler was told
    with pytest.raises(ValueError, match="per-sample scheduler"):
        CachedDataset(path, cache=False).loader(4, auto_order=True)


@pytest.mark.parametrize("num_workers", [0, 1])
@pytest.mark.parametrize("drop_last", [False, True])
def test_skipped_items_leave_no_short_batch_mid_epoch(tmp_path, num_workers, drop_last):
    """Items skipped (on_error="skip") are made up from the next batches, in process as with
    workers: full batches but the last, and with drop_last not that one either. Before: with
    num_workers=0 every batch holding a skipped item came short, drop_last or not."""
    n, B = 30, 4
    path = indexed_items(tmp_path / "ds", n)
    loader = CachedDataset(path, cache=False, transform=[index_of, FailOn(7)]).loader(
        B, num_workers=num_workers, on_error="skip", drop_last=drop_last, cost_dir=False)
    try:
        sizes, got = [], []
        for b in loader:
            sizes.append(len(b))
            got += [int(i) for i in b]
        pulled = (n // B) * B if drop_last else n  # the sampler's cut (drop_last), before skips
        st = loader.epoch_stats[-1].preprocess
        assert st.skipped > 0 and st.skipped + st.items == pulled and st.items == len(got) + st.dropped
        assert len(got) == len(set(got)) and set(got) <= set(range(n)) and set(got).isdisjoint(range(0, n, 7))
        assert sizes[:-1] == [B] * (len(sizes) - 1) and 0 < sizes[-1] <= B
        if drop_last:
            assert sizes[-1] == B and 0 <= st.dropped < B
        else:
            assert st.dropped == 0
    finally:
        loader.close()


@pytest.mark.parametrize("num_workers", [0, 1])
def test_the_first_epoch_feeds_auto_order_and_the_cost_memory_in_process_too(tmp_path, num_workers):
    """HalveBut halves every item but the profiled sample's: the sample shows it neutral, the
    epoch deflating, so AutoOrder revises the order after it and the pipeline is rekeyed; each
    item's cost is remembered. Before: with num_workers=0 neither happened."""
    n, B, seed, sample = 40, 8, 5, 16  # sample: the scheduler's SAMPLE_ITEMS
    sampled = random.Random(f"{seed}/sample").sample(range(n), sample)  # as Scheduler._profile draws them
    pipe = Pipeline([index_of, with_values, scale_values, HalveBut(sampled)], auto_order=True)
    costs = str(tmp_path / "costs")
    loader = CachedDataset(indexed_items(tmp_path / "ds", n), cache=False, transform=pipe).loader(
        B, num_workers=num_workers, seed=seed, cost_dir=costs)
    try:
        engine = loader.preprocess
        assert sorted(engine.sample_indices) == sorted(sampled)
        first_key = engine.fingerprint
        assert engine.pipeline.order == (0, 1, 2, 3)  # the sample: nothing to move
        assert sorted(i for b in loader for i, _ in b) == list(range(n))
        assert engine.pipeline.order == (0, 1, 3, 2), engine.pipeline.order_report
        assert "HalveBut before scale_values" in engine.pipeline.order_report
        assert engine.fingerprint == engine.pipeline.fingerprint() != first_key
        assert len(CostMemory(costs, first_key).load()) == n and len(engine.known) == n
    finally:
        loader.close()
