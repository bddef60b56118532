"""The Ray cluster gone mid-epoch (its head's processes killed with SIGKILL): one
warning, every item still comes exactly once (the trainer side makes the rest), the
local workers are set to the fallback count. And a cluster never reached: local only."""
import os
import sys
import warnings
from collections import Counter

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install '.[ray]')")

from clients.dataset import CachedDataset  # noqa: E402
from preprocess import Pipeline  # noqa: E402
from preprocess.remote import start  # noqa: E402
from procs import cacheserver, free_port  # noqa: E402
from rayhead import RayHead, disconnect, leave  # noqa: E402
from remote_steps import Jitter, Slow, decode, decode_entry  # noqa: E402
from test_preprocess_loader import indexed_items  # noqa: E402
from test_remote_workers import expected, trainer_epoch  # noqa: E402

pytestmark = [pytest.mark.timeout(240), pytest.mark.xdist_group("ray")]  # one Ray cluster at a time (conftest)


@pytest.fixture
def server(tmp_path):
    d = cacheserver(str(tmp_path / "srv")).start()
    yield d
    d.kill()


def test_cluster_gone_mid_epoch_falls_back_to_local_workers(server, tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_CLIENT_RECONNECT_GRACE_PERIOD", "3")  # how long calls stall before the loss shows
    n, B = 64, 8
    path = indexed_items(tmp_path / "ds", n)
    pipe = Pipeline([decode, Slow(0.02), Jitter()])
    ds = CachedDataset(path, cache=server.address, job="remote-gone", transform=pipe)
    head = RayHead(cpus=2)
    rw = None
    try:
        head.connect()
        local = []
        rw = start(ds, pipe, 0, head.address, set_local=local.append, wait_limit=60.0, task_items=4,
                   fallback_local=3)
        assert rw is not None and local == [0] and rw.pool.size == 1

        def feed(sampler, epoch):
            for k, batch in enumerate(rw.batches(sampler, epoch)):
                if k == 1:
                    head.kill()  # every process of the cluster, at once
                yield batch

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            seen, out, counts, computed = trainer_epoch(ds, pipe, rw, feed, n, B, seed=3)
        assert Counter(seen) == Counter(range(n))              # training went on, nothing lost or doubled
        want = expected(ds, pipe, n)
        assert all(np.array_equal(out[i], want[i]) for i in range(n))
        lost = [w for w in caught if "remote preprocessing workers lost" in str(w.message)]
        assert len(lost) == 1, [str(w.message) for w in caught]  # one warning
        assert rw.pool.broken and computed > 0 and rw.controller.fell_back
        assert local[-1] == 3 and rw.feeder.local_share == 1.0  # everything local from then on
        assert rw.feeder.stats.local_items > 0
    finally:
        if rw is not None:
            rw.close()
        disconnect(ray)  # also after a lost cluster, when Ray no longer counts itself initialized
        head.close()
        ds.close()


def test_cluster_never_reached_runs_local_only(server, tmp_path):
    path = indexed_items(tmp_path / "ds", 8)
    pipe = Pipeline([decode, Jitter()])
    ds = CachedDataset(path, cache=server.address, transform=pipe)
    with pytest.warns(RuntimeWarning, match="cannot be reached.*local workers only"):
        assert start(ds, pipe, 0, f"ray://127.0.0.1:{free_port()}") is None
    with pytest.warns(RuntimeWarning, match="no cacheable prefix"):
        assert start(ds, Pipeline([Jitter(), decode]), 0, "ray://127.0.0.1:1") is None
    entry = CachedDataset(path, cache=server.address, decode=decode_entry, transform=pipe)
    with pytest.warns(RuntimeWarning, match="decode takes the entry.*local workers only"):  # no key for its items
        assert start(entry, pipe, 0, "ray://127.0.0.1:1") is None
    entry.close()
    with pytest.raises(ValueError, match="not the embedded cache"):
        start(CachedDataset(path, cache=False, transform=pipe), pipe, 0, "ray://127.0.0.1:1")
    ds.close()


FAIL_ONCE = '''import os
import ray_proxy_spawn  # the head's own sitecustomize's (tests/raysite), which this one shadows

ray_proxy_spawn.apply()
_marker = os.environ.get("RAYHEAD_FAIL_CLIENT_SERVER", "")
if _marker:
    with open("/proc/self/cmdline", "rb") as _f:
        _cmd = _f.read()
    if b"--mode=specific-server" in _cmd and os.path.exists(_marker):
        os._exit(3)  # a client server that dies starting
    if b"--mode=proxy" in _cmd:  # the proxy sees it die before it counts it started, as in CI
        import ray.util.client.server.proxier as _p

        _match, _start = _p._match_running_client_server, _p.ProxyManager.start_specific_server
        _p._match_running_client_server = lambda cmd: _match(cmd) and not os.path.exists(_marker)

        def _once(self, *a, **kw):
            try:
                return _start(self, *a, **kw)
            finally:
                if os.path.exists(_marker):
                    os.rename(_marker, _marker + ".used")
        _p.ProxyManager.start_specific_server = _once
'''


def test_a_client_server_that_dies_starting_is_tried_again(tmp_path):
    """The head's proxy starts a client server per Ray Client connection; the first one
    dies starting (a sitecustomize on the head's path exits it before the proxy counts it
    started). Before: connect() gave up ("Starting Ray client server failed", seen in CI on a
    loaded host; "Proxy failed to Connect to backend" where it dies later) and the job ran
    local workers only; now it connects on the second try."""
    from preprocess.remote.cluster import connect

    fault = tmp_path / "fault"
    fault.mkdir()
    (fault / "sitecustomize.py").write_text(FAIL_ONCE)
    marker = tmp_path / "fail-once"
    # Ray's client hears of the dead server only after the head's wait for it (Ray's
    # RAY_CLIENT_SERVER_CHECK_CHANNEL_TIMEOUT_S, 30 s by default: its log stream waits for that
    # server's channel); 15 s here, still far above a live client server's start on a loaded host
    head = RayHead(cpus=1, env={"RAYHEAD_FAIL_CLIENT_SERVER": str(marker),
                                "RAY_CLIENT_SERVER_CHECK_CHANNEL_TIMEOUT_S": "15"}, path=(str(fault),))
    try:
        head.connect()  # up, through a client server of its own; the fault armed afterwards
        disconnect(ray)
        marker.write_text("")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            joined, share = connect(head.address)
        assert not marker.exists() and os.path.exists(str(marker) + ".used")  # the first one did die
        assert share is not None and joined.is_initialized()
        assert joined.get(joined.put(7)) == 7
    finally:
        leave(ray)
        head.close()
