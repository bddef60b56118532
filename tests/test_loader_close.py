"""loader.close() with DataLoader workers: the persistent workers stop with it, so that
ds.close() after it leaves nothing of the loader's reads behind on the host."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from clients.coalesce import DEFAULT_DIR, PREFIX  # noqa: E402
from clients.dataset import CachedDataset  # noqa: E402
from procs import pid_alive, wait_until  # noqa: E402
from test_dataset import make_dataset  # noqa: E402


def test_close_stops_persistent_workers_and_the_coalescing_dir_goes(tmp_path):
    path, items = make_dataset(tmp_path / "ds", n=40, lo=500, hi=2000)
    ds = CachedDataset(path, cache_dir=str(tmp_path / "emb"), capacity="100MB")
    shared = os.path.join(DEFAULT_DIR, PREFIX + ds.dataset_tag)
    loader = ds.loader(batch_size=8, num_workers=2)
    got = sorted(x for batch in loader for x in batch)
    assert got == sorted(items.values())
    pids = [w.pid for w in loader._iterator._workers]
    assert all(pid_alive(p) for p in pids) and os.path.isdir(shared)  # persistent: alive between epochs
    loader.close()
    wait_until(lambda: not any(pid_alive(p) for p in pids), "the loader's workers to stop")
    ds.close()
    assert not os.path.exists(shared)  # its last user left: removed, not left for a later sweep
    # closed is not broken: a new epoch starts workers afresh and reads every item
    ds = CachedDataset(path, cache_dir=str(tmp_path / "emb"), capacity="100MB")
    loader = ds.loader(batch_size=8, num_workers=2)
    assert sorted(x for batch in loader for x in batch) == sorted(items.values())
    loader.close()
    assert sorted(x for batch in loader for x in batch) == sorted(items.values())
    loader.close()
    ds.close()


def test_exit_without_close_leaves_no_coalescing_dir(tmp_path):
    """A script that ends without close(), its persistent workers still up: they are stopped
    before the main process lets go of the host's coalescing directory, which then goes."""
    path, items = make_dataset(tmp_path / "ds", n=40, lo=500, hi=2000)
    script = tmp_path / "train.py"
    script.write_text(f"from clients.dataset import CachedDataset\n"
                      f"if __name__ == '__main__':\n"
                      f"    ds = CachedDataset({path!r}, cache_dir={str(tmp_path / 'emb')!r}, capacity='100MB')\n"
                      f"    loader = ds.loader(batch_size=8, num_workers=2)\n"
                      f"    n = sum(len(batch) for batch in loader)\n"
                      f"    print(ds.dataset_tag, n, len(loader._iterator._workers))\n")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path, env=dict(os.environ, PYTHONPATH=repo))
    assert r.returncode == 0, r.stderr
    tag, n, workers = r.stdout.split()
    assert (int(n), int(workers)) == (len(items), 2)
    assert not os.path.exists(os.path.join(DEFAULT_DIR, PREFIX + tag))
