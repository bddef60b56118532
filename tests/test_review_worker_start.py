"""Preprocessing workers start forked from a fork server that imported torch and the modules
the dataset and steps come from (preprocess/startctx.py), not spawned: a spawned worker imported
them itself (~2 s of CPU each, for every worker a loader starts). And a worker still runs
under the trainer's environment of when it starts, as a spawned one did. Run in a fresh
process: the fork server is one per process, its preload fixed by the first pool."""
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
from procs import ROOT  # noqa: E402

CHILD = r"""
import os, sys
sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
from collections import Counter
from clients.dataset import CachedDataset
from preprocess import Pipeline
from test_preprocess_loader import indexed_items
import start_steps

path = indexed_items(sys.argv[1], 24)
for mark, workers in (("first", 3), ("second", 2)):
    os.environ["START_STEPS_MARK"] = mark  # set after the fork server started, for the second
    ds = CachedDataset(path, cache=False, transform=Pipeline([start_steps.mark]))
    loader = ds.loader(4, num_workers=workers, seed=1, cost_dir=False)
    for epoch in range(2):
        got = Counter()
        for batch in loader:  # a list of the step's (index, mark) pairs
            got.update(batch)
        assert got == Counter({(i, mark): 1 for i in range(24)}), (mark, epoch, got)
    loader.close()
    ds.close()
print("DONE", flush=True)
"""


def test_workers_import_their_steps_module_once_and_see_the_trainers_environment(tmp_path):
    log = tmp_path / "imports"
    env = dict(os.environ, START_STEPS_LOG=str(log))
    r = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "ds")], cwd=ROOT, env=env,
                       capture_output=True, timeout=240)
    assert r.returncode == 0 and b"DONE" in r.stdout, r.stderr.decode(errors="replace")[-3000:]
    pids = log.read_text().split()
    # the trainer's own import, and the fork server's: none by the 5 workers of the two loaders
    assert len(pids) == 2 and len(set(pids)) == 2, pids
