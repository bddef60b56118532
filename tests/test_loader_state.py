"""The loader as PyTorch users drive it: drop_last, refused arguments with our
equivalents, resume from state_dict() (with and without workers), rank shares,
and DDP with real processes under the gloo backend on loopback."""
import hashlib
import json
import os
import random
import subprocess
import sys
from collections import Counter

import pytest

torch = pytest.importorskip("torch")

from clients.dataset import CachedDataset  # noqa: E402
from clients.sampler import SubstitutableBatchSampler  # noqa: E402
from procs import cacheserver, free_port  # noqa: E402
from test_dataset import make_dataset  # noqa: E402


@pytest.fixture
def data(tmp_path):
    return make_dataset(tmp_path / "ds", n=103, lo=50, hi=400)


def test_drop_last(data):
    path, items = data
    ds = CachedDataset(path, cache=False)
    loader = ds.loader(batch_size=10, drop_last=True)
    batches = list(loader)
    assert len(loader) == len(batches) == 10 and all(len(b) == 10 for b in batches)
    assert len(list(ds.loader(batch_size=10))) == 11


@pytest.mark.parametrize("kw, says", [
    (dict(shuffle=True), "does not take shuffle=: the loader shuffles every epoch itself \\(seed="),
    (dict(sampler=[0, 1]), "does not take sampler=: .*pass rank= and world_size="),
    (dict(batch_sampler=[[0]]), "does not take batch_sampler=: .*batch_size=, drop_last="),
])
def test_refused_arguments_name_ours(data, kw, says):
    ds = CachedDataset(data[0], cache=False)
    with pytest.raises(ValueError, match=says):
        ds.loader(batch_size=4, **kw)


def test_lambda_decode_explained_before_workers_start(data):
    ds = CachedDataset(data[0], cache=False, decode=lambda b: len(b))
    with pytest.raises(TypeError, match=r"decode=\S*<lambda> cannot be sent to DataLoader worker processes.*"
                                        r"define it with def at the top level of a module"):
        ds.loader(batch_size=4, num_workers=1)
    assert len(list(ds.loader(batch_size=50))) == 3  # in-process it is fine


def _run(loader, stop_after=None):
    out = []
    for k, batch in enumerate(loader):
        out.extend(batch)
        if stop_after is not None and k + 1 == stop_after:
            break
    return out


@pytest.mark.parametrize("workers", [0, 1])
def test_resume_yields_exactly_the_rest(tmp_path, data, workers):
    path, items = data
    server = cacheserver(str(tmp_path / "srv"), "64MB").start()
    try:
        ds = CachedDataset(path, cache=server.address)
        loader = ds.loader(batch_size=8, num_workers=workers, seed=5)
        first = _run(loader, stop_after=4)  # workers have prefetched more than they delivered
        state = loader.state_dict()
        assert loader.epoch_stats[-1].complete is False and loader.epoch_stats[-1].items == 32
        assert "stopped early" in loader.epoch_stats[-1].line()
        ds.close()

        ds2 = CachedDataset(path, cache=server.address)  # a new process would do the same
        resumed = ds2.loader(batch_size=8, num_workers=workers, seed=5)
        resumed.load_state_dict(state)
        assert len(resumed) == -(-(103 - 32) // 8)
        rest = _run(resumed)
        assert Counter(first + rest) == Counter(items.values())  # each exactly once
        assert resumed.state_dict()["sampler"]["epoch"] == 1  # the epoch is done
        nxt = _run(resumed)  # then a whole new epoch
        assert Counter(nxt) == Counter(items.values())
        ds2.close()
    finally:
        server.kill()


def test_resume_state_checked(data):
    ds = CachedDataset(data[0], cache=False)
    loader = ds.loader(batch_size=8)
    _run(loader, stop_after=1)
    state = loader.state_dict()
    other = CachedDataset(make_dataset(os.path.dirname(data[0]) + "/other", n=50)[0], cache=False)
    with pytest.raises(ValueError, match="saved with n_items 103 \\(this loader: 50\\)"):
        other.loader(batch_size=8).load_state_dict(state)
    with pytest.raises(ValueError, match="world_size 1 \\(this loader: 2\\)"):
        ds.loader(batch_size=8, rank=0, world_size=2).load_state_dict(state)
    same_size = CachedDataset(make_dataset(os.path.dirname(data[0]) + "/same", n=103, seed=3)[0], cache=False)
    with pytest.raises(ValueError, match=f"saved with dataset '{ds.dataset_tag}' \\(this loader: "):
        same_size.loader(batch_size=8).load_state_dict(state)
    legacy = {k: v for k, v in state["sampler"].items() if k != "dataset"}  # saved before states named it
    same_size.loader(batch_size=8).load_state_dict({**state, "sampler": legacy})


def test_seed_repeats_the_order_without_a_cache(data):
    ds = CachedDataset(data[0], cache=False)
    assert [list(ds.loader(batch_size=8, seed=4)) for _ in range(2)] == [list(ds.loader(batch_size=8, seed=4))] * 2


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("walk", ["front", "plain"])
def test_rank_shares(drop_last, walk):
    n, W, B = 103, 4, 6
    cached = set(random.Random(1).sample(range(n), 40))
    lookup = (lambda idx: [int(i in cached) for i in idx]) if walk == "front" else None
    per_rank = []
    for epoch in range(2):
        shares = []
        for r in range(W):
            s = SubstitutableBatchSampler(n, B, lookup, seed=3, drop_last=drop_last, rank=r, world_size=W)
            s.set_epoch(epoch)
            batches = list(s)
            assert len(batches) == len(s)
            shares.append([i for b in batches for i in b])
        per_rank.append(shares)
        sizes = {len(x) for x in shares}
        assert sizes == ({(n // W) // B * B} if drop_last else {-(-n // W)})
        union = Counter(i for x in shares for i in x)
        if drop_last:
            assert all(c == 1 for c in union.values())
        else:  # padded as DistributedSampler: every item, W - n % W of them twice
            assert set(union) == set(range(n)) and sum(union.values()) == -(-n // W) * W
    assert per_rank[0] != per_rank[1]  # shares change with the epoch
    with pytest.raises(ValueError, match="fewer than world_size=4"):
        SubstitutableBatchSampler(3, 2, None, rank=0, world_size=4)
    with pytest.raises(ValueError, match="0 <= rank < world_size"):
        SubstitutableBatchSampler(10, 2, None, rank=4, world_size=4)


def _ddp_rank(rank: int, world: int, port: int, digest: str, cache: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=__import__("datetime").timedelta(seconds=60))
    try:
        ds = CachedDataset(digest, cache=cache)
        loader = ds.loader(batch_size=7, seed=11)  # rank and world size from torch.distributed
        epochs = []
        for _ in range(2):
            items = [hashlib.sha256(x).hexdigest() for b in loader for x in b]
            st = loader.epoch_stats[-1]
            epochs.append({"items": items, "batches": st.batches, "hits": st.hits})
            dist.barrier()  # the other rank's inserts are in before the next epoch
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(epochs, f)
        ds.close()
    finally:
        dist.destroy_process_group()


def test_ddp_gloo_ranks_split_each_epoch(tmp_path, data):
    path, items = data
    server = cacheserver(str(tmp_path / "srv"), "64MB").start()
    try:
        ctx = torch.multiprocessing.start_processes(
            _ddp_rank, args=(2, free_port(), path, server.address, str(tmp_path)), nprocs=2, join=False,
            start_method="spawn")
        try:
            for p in ctx.processes:
                p.join(120)
            assert all(p.exitcode == 0 for p in ctx.processes), [p.exitcode for p in ctx.processes]
        finally:
            for p in ctx.processes:
                if p.is_alive():  # a hung rank: stop it rather than leave it behind
                    p.kill()
                    p.join(10)
    finally:
        server.kill()
    ranks = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]
    want = Counter(hashlib.sha256(v).hexdigest() for v in items.values())
    for e in range(2):
        a, b = ranks[0][e], ranks[1][e]
        assert a["batches"] == b["batches"] == 8  # ceil(52 / 7) on both ranks
        union = Counter(a["items"]) + Counter(b["items"])
        assert set(union) == set(want) and sum(union.values()) == 104  # one item padded, as DistributedSampler
    # the second epoch finds the items both ranks inserted in the first: substitutable hits
    assert ranks[0][1]["hits"] + ranks[1][1]["hits"] == 104


def test_script_without_main_guard_is_told(tmp_path, data):
    """Pasted without `if __name__ == "__main__":`, a spawned worker re-imports the script;
    it stops there with the reason instead of a bare 'worker exited unexpectedly'."""
    script = tmp_path / "noguard.py"
    script.write_text(f"from clients.dataset import CachedDataset\n"
                      f"ds = CachedDataset({data[0]!r}, cache=False)\n"
                      f"for batch in ds.loader(batch_size=8, num_workers=1):\n    pass\n")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path, env=dict(os.environ, PYTHONPATH=repo))
    assert r.returncode != 0
    assert 'put the code that makes the dataset and iterates the loader under `if __name__ == "__main__":`' \
        in r.stderr


def test_rank_resume_keeps_the_share():
    n, W, B = 101, 3, 5
    lookup = lambda idx: [int(i % 3 == 0) for i in idx]  # noqa: E731
    for r in range(W):
        whole = SubstitutableBatchSampler(n, B, lookup, seed=9, rank=r, world_size=W)
        share = sorted(i for b in whole for i in b)
        s = SubstitutableBatchSampler(n, B, lookup, seed=9, rank=r, world_size=W)
        it = iter(s)
        first = [next(it), next(it), next(it)]  # issued three...
        s.delivered()
        s.delivered()  # ...of which the loop received two
        state = s.state_dict()
        again = SubstitutableBatchSampler(n, B, lookup, seed=9, rank=r, world_size=W)
        again.load_state_dict(state)
        assert len(again) == -(-(len(share) - 2 * B) // B)
        rest = [i for b in again for i in b]
        assert sorted(first[0] + first[1] + rest) == share
        with pytest.raises(ValueError, match="seed 9 \\(this loader: 8\\)"):
            SubstitutableBatchSampler(n, B, lookup, seed=8, rank=r, world_size=W).load_state_dict(state)


def test_more_loader_argument_errors(data):
    ds = CachedDataset(data[0], cache=False)
    with pytest.raises(ValueError, match="does not take in_order=: batches are delivered in order"):
        ds.loader(batch_size=4, in_order=False)
    with pytest.raises(ValueError, match="pass rank= and world_size= together"):
        ds.loader(batch_size=4, rank=1)
    state = ds.loader(batch_size=4).state_dict()
    with pytest.raises(ValueError, match="loader state of version 99"):
        ds.loader(batch_size=4).load_state_dict({"sampler": dict(state["sampler"], version=99)})


def test_rank_resume_refuses_another_drop_last():
    """Under DDP drop_last decides the shares (padded or cut): a state saved with one
    and resumed with the other would yield some items twice and others never."""
    n, W, B = 103, 4, 5
    s = SubstitutableBatchSampler(n, B, None, seed=2, rank=1, world_size=W)
    it = iter(s)
    next(it)
    s.delivered()
    state = s.state_dict()
    with pytest.raises(ValueError, match="drop_last False \\(this loader: True\\)"):
        SubstitutableBatchSampler(n, B, None, seed=2, rank=1, world_size=W, drop_last=True).load_state_dict(state)
    one = SubstitutableBatchSampler(n, B, None, seed=2)  # one rank: drop_last only cuts the last batch
    next(iter(one))
    one.delivered()
    SubstitutableBatchSampler(n, B, None, seed=2, drop_last=True).load_state_dict(one.state_dict())


def test_dataloader_defaults_passed_explicitly_are_accepted(data):
    """Code written for DataLoader often passes its defaults: `sampler=sampler if ddp else None`."""
    ds = CachedDataset(data[0], cache=False)
    loader = ds.loader(batch_size=50, sampler=None, batch_sampler=None, shuffle=None, in_order=True)
    assert sum(len(b) for b in loader) == 103
    assert sum(len(b) for b in ds.loader(batch_size=50, shuffle=False)) == 103
    with pytest.raises(ValueError, match="does not take shuffle=: "):
        ds.loader(batch_size=4, shuffle=1)


@pytest.mark.parametrize("workers", [0, 1])
@pytest.mark.parametrize("drop_last", [False, True])
def test_state_saved_at_an_epochs_last_batch_resumes_into_the_next(data, workers, drop_last):
    """Saved inside the loop at the epoch's last batch (a checkpoint every k steps), the
    state resumes into a whole next epoch, as torchdata's StatefulDataLoader does, with
    or without workers: never an empty epoch (a loop averaging over it would divide by 0)."""
    path, items = data
    ds = CachedDataset(path, cache=False)
    loader = ds.loader(batch_size=8, num_workers=workers, seed=1, drop_last=drop_last)
    for batch in loader:
        state = loader.state_dict()  # the last one is taken at the last batch
    assert state["sampler"]["epoch"] == 1 and not state["sampler"]["delivered"]
    resumed = ds.loader(batch_size=8, seed=1, drop_last=drop_last)
    resumed.load_state_dict(state)
    assert len(resumed) == (12 if drop_last else 13)
    got = [x for b in resumed for x in b]
    assert len(got) == (96 if drop_last else 103) and len(set(got)) == len(got)
    assert resumed.epoch_stats[-1].epoch == 1
    ds.close()
