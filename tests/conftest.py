import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from procs import cacheserver  # noqa: E402


def _free_disk_line() -> tuple[str, bool]:
    free = shutil.disk_usage(tempfile.gettempdir()).free
    low = free < (4 << 30)
    return (f"free disk under {tempfile.gettempdir()}: {free / (1 << 30):.1f} GiB"
            + ("  (LOW: the cacheserver tests need a few GB)" if low else "")), low


def pytest_report_header(config) -> str:
    """Free space where the tests' stores go: a run needs a few GB at its peak, and a
    full disk fails the cacheservers' start-up checks, not one clear test."""
    return _free_disk_line()[0]


def pytest_sessionstart(session) -> None:
    line, low = _free_disk_line()
    tr = session.config.pluginmanager.get_plugin("terminalreporter")
    if low and tr is not None and session.config.option.verbose < 0:  # -q hides the header
        tr.write_line(line, yellow=True)


_GROUP_MARK = re.compile(r"xdist_group\(\s*[\"']([^\"']+)[\"']")


def pytest_xdist_make_scheduler(config, log):
    """`make test` (`-n 2 --dist loadgroup`): each test module runs on one worker
    (its module fixtures start once), and the modules that mark tests xdist_group(G) all
    run on one worker per G: the Ray tests (xdist_group("ray")) share one, since two Ray
    clusters starting at once on 2 cores ran past Ray's 30 s raylet start-up wait.
    pytest-xdist's own loadgroup reads the marks by renaming each test's nodeid, which
    pytest 9.2 no longer lets it do (every test was its own group: Ray clusters and module
    fixtures started on both workers at once), so the grouping is done here, by module."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    root = config.rootpath

    class ModuleOrGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.rfind("@") > nodeid.rfind("]"):  # an xdist that could rename: its group
                return nodeid.rsplit("@", 1)[-1]
            path = nodeid.split("::", 1)[0]
            return _module_group(root / path) or path

    return ModuleOrGroup(config, log)


@functools.cache
def _module_group(path) -> str | None:
    """The xdist_group a test module names (one per module: its tests run together)."""
    try:
        with open(path, encoding="utf-8") as f:
            found = set(_GROUP_MARK.findall(f.read()))
    except OSError:
        return None
    if len(found) > 1:
        raise pytest.UsageError(f"{path} names xdist groups {sorted(found)}: one per module")
    return found.pop() if found else None


@pytest.fixture(autouse=True)
def _private_job_tokens(tmp_path_factory, monkeypatch):
    """Lone test processes keep their job tokens (clients/jobtokenfile.py) out of the user's home."""
    monkeypatch.setenv("MLCACHE_JOB_TOKEN_DIR", str(tmp_path_factory.mktemp("job-tokens")))


@pytest.fixture
def server(tmp_path):
    """One running cacheserver process; killed at teardown."""
    d = cacheserver(str(tmp_path / "srv")).start()
    yield d
    d.kill()


@pytest.fixture(scope="module")
def module_server(tmp_path_factory):
    """One cacheserver process shared by a module's tests (those around a Ray head)."""
    d = cacheserver(str(tmp_path_factory.mktemp("srv"))).start()
    yield d
    d.kill()


@pytest.fixture
def logged_server(tmp_path):
    """A cacheserver that logs every write (--durability process): its followers
    replay the values too, which the read-path tests are about."""
    d = cacheserver(str(tmp_path / "srv"), "1GB", 0, "--durability", "process").start()
    yield d
    d.kill()


@pytest.fixture
def roomy_logged_server(tmp_path):
    """A logged server whose memtables (64 MiB at 8 GB, diskbudget.lsm_sizes) hold a round
    of a test's writes: its followers replay them, not flushed into table files on the way."""
    d = cacheserver(str(tmp_path / "srv"), "8GB", 0, "--durability", "process").start()
    yield d
    d.kill()


@pytest.fixture
def small_fs(tmp_path):
    """A 64 MiB tmpfs of its own (needs root, as on the dev VM; skipped elsewhere)."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def shm(tmp_path, monkeypatch):
    """Same-host coalescing's directories (clients/coalesce.py) in a directory of the test's."""
    from clients import coalesce

    root = tmp_path / "shm"
    root.mkdir()
    monkeypatch.setattr(coalesce, "DEFAULT_DIR", str(root))
    monkeypatch.setattr(coalesce, "_swept", set())
    return str(root)


@pytest.fixture(scope="session")
def ray_heads():
    """The pytest process's shared Ray head (tests/rayhead.py SharedHead), for the Ray test
    modules that neither kill nor reconfigure theirs: started by the first test that asks
    for it, stopped at the session's end. Skipped without the `ray` extra."""
    pytest.importorskip("ray", reason="the ray extra is not installed (pip install '.[ray]')")
    from rayhead import SharedHead

    heads = _shared["ray"] = SharedHead()
    try:
        yield heads
    finally:
        heads.close()
        _shared.clear()


_shared: dict = {}  # the session's SharedHead, once a test asked for it


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After the last Ray test of a run of them (the "ray" group's modules run together on
    one worker), the shared head stops: idle, it held ~1 GB and some CPU through the rest
    of the worker's modules. A later test that asks for it starts it again."""
    result = yield
    heads = _shared.get("ray")
    if heads is not None and (nextitem is None or _module_group(nextitem.path) != "ray"):
        heads.close()
    return result


@pytest.fixture(scope="module")
def ray_module(ray_heads):
    """A module's turn on the shared Ray head: idle as its first test starts (no actor or
    task of another module on it), left by this process after its last."""
    with ray_heads.module():
        yield


@pytest.fixture
def shared_head(ray_heads, ray_module):
    """The shared Ray head (a rayhead.RayHead), live: started anew if an earlier test left it dead."""
    return ray_heads.live()
