"""cachectl refuses a --timeout (and local-cluster's --start-timeout / --stop-timeout) that
is not a finite number of seconds > 0, naming the flag, instead of failing each call with a
misleading "cannot reach ...: no answer in time", or (NaN) never timing out."""
from __future__ import annotations

import pytest

from procs import cacheserver
from test_cachectl import cachectl


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = cacheserver(str(tmp_path_factory.mktemp("srv")), "64MB").start()
    yield s
    s.kill()


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
@pytest.mark.parametrize("cmd", [["stats"], ["ring"], ["status", "--manager"]])
def test_a_bad_timeout_is_refused_naming_the_flag(server, cmd, value):
    r = cachectl(*cmd, server.address, "--timeout", value)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "argument --timeout: must be a finite number of seconds > 0" in r.stderr, r.stderr
    assert "cannot reach" not in r.stderr


@pytest.mark.parametrize("flag", ["--start-timeout", "--stop-timeout"])
def test_local_cluster_refuses_a_nan_timeout(tmp_path, flag):
    r = cachectl("local-cluster", "--servers", "1", "--data-dir", str(tmp_path), flag, "nan")
    assert r.returncode == 2 and f"argument {flag}: must be a finite number of seconds > 0" in r.stderr, r.stderr


def test_a_good_timeout_still_works(server):
    r = cachectl("stats", server.address, "--timeout", "2.5", "--json")
    assert r.returncode == 0, r.stderr
