"""Review of the DDP seed check (clients/ddpseed.py) with real spawned ranks, a real
TCPStore and gloo on loopback, real files. torchrun restarts a failed job's ranks
against its agent's store, which outlives them (the c10d rendezvous's shared store):
the keys the last attempt's samplers wrote are still there. The agent's store is
hosted here, and the ranks join it as torchrun's do (env://, TORCHELASTIC_USE_AGENT_STORE,
TORCHELASTIC_RESTART_COUNT). No collective runs (gloo connects lazily): a gloo restart
against stale keys of its own races in torch itself, which is not what is tested."""
import datetime
import json
import os
import sys

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.dirname(__file__))

from clients.dataset import CachedDataset  # noqa: E402
from filedigest import write_files_digest  # noqa: E402
from procs import run_ranks  # noqa: E402

pytestmark = pytest.mark.timeout(240)
W = 2


def _restarted_rank(rank, env, path, seeds, out):
    os.environ.update(env, RANK=str(rank), WORLD_SIZE=str(W), TORCH_GLOO_LAZY_INIT="1")
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=60))
    try:
        ds = CachedDataset(path, cache=False)
        try:
            ds.loader(4, seed=seeds[rank])
            got = "ok"
        except ValueError as e:
            got = str(e)
        ds.close()
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(got, f)
    finally:
        dist.destroy_process_group()


def test_ranks_restarted_by_torchrun_with_a_new_seed_are_not_told_their_seeds_differ(tmp_path):
    """Before: each restarted rank compared its seed with the first attempt's and raised
    ('rank 1 seed=101, rank 1 seed=100'), so a job whose seed changes per run (drawn by
    rank 0 and broadcast, or taken from a checkpoint) failed every restart. A mismatch
    within an attempt is still found."""
    from torch.distributed import TCPStore

    path = write_files_digest(tmp_path / "ds", (os.urandom(64) for _ in range(20)))
    agent = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # outlives the attempts
    base = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(agent.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}
    got = []
    for attempt, seeds in enumerate([(100, 100), (101, 101), (102, 103)]):
        out = tmp_path / f"attempt{attempt}"
        out.mkdir()
        env = dict(base, TORCHELASTIC_RESTART_COUNT=str(attempt))
        run_ranks(_restarted_rank, (env, path, seeds, str(out)), W)
        got.append([json.load(open(out / f"rank{r}.json")) for r in range(W)])
    assert got[:2] == [["ok", "ok"], ["ok", "ok"]], got
    # the third attempt's ranks differ: whichever comes second is told, naming both seeds
    told = [g for g in got[2] if g != "ok"]
    assert len(told) == 1 and "different seeds" in told[0], got[2]
    assert "seed=102" in told[0] and "seed=103" in told[0], got[2]
