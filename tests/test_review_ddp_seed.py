"""DDP ranks that pass different seeds split different permutations: items read twice or
never in an epoch, silently. Under torch.distributed the rank that makes its loader with
another seed than the first rank's raises, naming both (clients/ddpseed.py). Real spawned
ranks (gloo on loopback), real files."""
import datetime
import json
import os
import sys

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.dirname(__file__))

from clients.dataset import CachedDataset  # noqa: E402
from filedigest import write_files_digest  # noqa: E402
from procs import free_port, run_ranks as spawn_ranks  # noqa: E402

pytestmark = pytest.mark.timeout(240)
W = 2


def _make(ds, seed, given):
    """'ok', or the ValueError's message; `given`: rank and world size passed by hand."""
    try:
        ds.loader(4, seed=seed, **given)
        return "ok"
    except ValueError as e:
        return str(e)


def _seed_rank(rank, port, path, seeds, given, out):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=W,
                            timeout=datetime.timedelta(seconds=60))
    try:
        ds = CachedDataset(path, cache=False)
        got = []
        for seed in seeds[rank]:  # rank 0 makes each loader first: which rank raises is known
            if rank == 0:
                got.append(_make(ds, seed, given[rank]))
            dist.barrier()
            if rank == 1:
                got.append(_make(ds, seed, given[rank]))
            dist.barrier()
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(got, f)
        ds.close()
    finally:
        dist.destroy_process_group()


def run_ranks(tmp_path, seeds, given=({}, {})):
    path = write_files_digest(tmp_path / "ds", (os.urandom(64) for _ in range(20)))
    spawn_ranks(_seed_rank, (free_port(), path, seeds, given, str(tmp_path)), W)
    return [json.load(open(tmp_path / f"rank{r}.json")) for r in range(W)]


def test_a_rank_with_another_seed_is_told_both_seeds(tmp_path):
    # Per loader, in the order each rank makes them: the second differs, the first and third agree.
    r0, r1 = run_ranks(tmp_path, [[0, 5, 7], [0, 6, 7]])
    assert r0 == ["ok", "ok", "ok"]
    assert r1[0] == "ok" and r1[2] == "ok", r1
    assert "rank 1 seed=6, rank 0 seed=5" in r1[1] and "same seed" in r1[1], r1


def test_ranks_given_by_hand_as_a_sub_group_are_not_checked(tmp_path):
    # Each process alone (rank 0 of 1 and rank 0 of 2, as a sub-group's): not the default
    # group's split, so no claim about the other's seed.
    r0, r1 = run_ranks(tmp_path, [[1], [2]], given=({"rank": 0, "world_size": 1}, {"rank": 0, "world_size": W}))
    assert r0 == r1 == ["ok"]
