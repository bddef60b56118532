"""Review of the command-line tools under tools/: errors on bad input, and what a run
leaves behind."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from procs import is_zombie, procs_naming, wait_until

REPO = Path(__file__).resolve().parents[1]
DIGEST = REPO / "tools" / "digest"


def _unprivileged() -> list[str]:
    """A command prefix under which file permissions apply: root without the capabilities
    that bypass them (setpriv), or nothing for another user."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("root without setpriv: permissions cannot be made to apply")
    caps = "-dac_override,-dac_read_search"
    return ["setpriv", f"--bounding-set={caps}", f"--inh-caps={caps}"]


@pytest.fixture
def locked(tmp_path: Path) -> Iterator[Path]:
    """d/a, d/sub/b with d/sub unreadable; permissions restored for the cleanup."""
    d = tmp_path / "d"
    (d / "sub").mkdir(parents=True)
    (d / "a").write_bytes(b"a")
    (d / "sub" / "b").write_bytes(b"b")
    (d / "sub").chmod(0)
    try:
        yield d
    finally:
        (d / "sub").chmod(0o755)
        d.chmod(0o755)


def _digest(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*_unprivileged(), sys.executable, str(DIGEST), *args],
                          capture_output=True, text=True, timeout=60, cwd=REPO)


def test_digest_refuses_an_unreadable_subdirectory(locked: Path, tmp_path: Path) -> None:
    # Was: exit 0 and a digest without d/sub/b, no word of it.
    out = tmp_path / "o.dig"
    r = _digest(str(locked), "-o", str(out))
    assert r.returncode == 1, r.stderr
    assert "cannot list sub/" in r.stderr and "--exclude 'sub/*'" in r.stderr
    assert "Traceback" not in r.stderr and not out.exists()
    r = _digest(str(locked), "-o", str(out), "--exclude", "sub/*")  # the way out it names
    assert r.returncode == 0, r.stderr


def test_digest_names_an_unreadable_source(locked: Path, tmp_path: Path) -> None:
    # Was: "empty dataset: no files under d".
    locked.chmod(0)
    r = _digest(str(locked), "-o", str(tmp_path / "o.dig"))
    assert r.returncode == 1, r.stderr
    assert f"cannot list {locked}: Permission denied" in r.stderr, r.stderr


# -- tools/accuracy, tools/example_data.py -----------------------------------------

ACCURACY = REPO / "tools" / "accuracy"
EXAMPLE_DATA = REPO / "tools" / "example_data.py"


@pytest.mark.parametrize("args,why", [
    (["--seeds", "0"], "--seeds must be at least 1"),  # was: StatisticsError after the dataset
    (["--epochs", "0"], "--epochs must be at least 1"),  # IndexError after training
    (["--batch-size", "0"], "--batch-size must be at least 1"),
    (["--cache-fraction", "1.5"], "--cache-fraction must be within 0..1"),  # random.sample's ValueError
    (["--test-size", "0"], "--test-size must be between 0 and 1"),
    (["--capacity", "10XB"], "--capacity: not a size: '10XB'"),
    (["--json", "/nonexistent-dir/out.json"], "--json: cannot write"),  # was: after the whole run
])
def test_accuracy_refuses_bad_arguments_first(tmp_path: Path, args: list[str], why: str) -> None:
    r = subprocess.run([sys.executable, str(ACCURACY), *args], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert r.returncode == 2 and why in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("where", ["file", "missing-parent"])
def test_example_data_names_an_unwritable_dir(tmp_path: Path, where: str) -> None:
    (tmp_path / "file").write_bytes(b"x")
    target = tmp_path / "file" if where == "file" else tmp_path / "no" / "such"
    if where == "missing-parent":  # a parent that cannot be made: a file in the way
        (tmp_path / "no").write_bytes(b"x")
    r = subprocess.run([sys.executable, str(EXAMPLE_DATA), str(target), "--per-class", "1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "example_data: error: cannot write" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr


# -- benchmarks ----------------------------------------------------------------------

BENCH = REPO / "tools" / "bench"


def _session_alive(pid: int) -> bool:
    """Whether any process is left in the session `pid` led (a bench started with
    start_new_session; what it spawned stays in it unless it moved)."""
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == pid and fields[0] != "Z":  # session id
            return True
    return False


def _left_behind(tmp: Path, within: float = 30.0) -> tuple[list[int], list[Path]]:
    """The live processes naming `tmp` and the entries of `tmp`, once both are none or `within` s
    passed: a tool's children (Ray's, its servers) end a moment after it, later on a loaded host."""
    deadline = time.monotonic() + within
    while True:
        left = [p for p in procs_naming(str(tmp)) if not is_zombie(p)]
        entries = list(tmp.iterdir())
        if (not left and not entries) or time.monotonic() > deadline:
            return left, entries
        time.sleep(0.2)


def _kill_session(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.mark.timeout(120)
@pytest.mark.skipif(shutil.which("memcached") is None, reason="memcached is not installed")
def test_bench_epoch_stops_memcached_when_loading_it_fails(tmp_path: Path) -> None:
    # An item over memcached's 16 MiB item limit fails the load; the memcached the bench
    # had just started ran on, orphaned.
    log = tmp_path.parent / f"{tmp_path.name}.log"  # a file: an orphan would hold a pipe open
    with open(log, "w") as out:
        p = subprocess.Popen([sys.executable, str(BENCH / "epoch"), "--items", "2", "--min-kb", "17000",
                              "--max-kb", "17000", "--configs", "memcached", "--rounds", "1", "--epochs", "1",
                              "--num-workers", "0"], stdout=out, stderr=subprocess.STDOUT,
                             env=dict(os.environ, TMPDIR=str(tmp_path)), start_new_session=True)
    try:
        p.wait(100)
        assert p.returncode != 0 and "too large" in log.read_text(), log.read_text()[-2000:]
        wait_until(lambda: not _session_alive(p.pid), "memcached to exit (else left running)", 15)
        assert list(tmp_path.iterdir()) == []
    finally:
        _kill_session(p.pid)


def _ctrl_c_after(cmd: list[str], tmp: Path, ready: str, delay: float, timeout: float = 90) -> tuple[int, str]:
    """Run cmd in a session of its own (TMPDIR=tmp, output to a file beside tmp), send SIGINT
    to its process group `delay` s after `ready` shows in its output, as Ctrl-C would;
    (exit status, output)."""
    log = tmp.parent / f"{tmp.name}.log"
    with open(log, "w") as out:
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ, TMPDIR=str(tmp)),
                             start_new_session=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + timeout
        while ready not in log.read_text() and time.monotonic() < deadline:
            assert p.poll() is None, log.read_text()[-2000:]
            time.sleep(0.1)
        time.sleep(delay)
        assert p.poll() is None, "it ended before the interrupt"
        os.killpg(p.pid, signal.SIGINT)
        return p.wait(60), log.read_text()
    except BaseException:
        _kill_session(p.pid)
        raise


@pytest.mark.xdist_group("ray")
@pytest.mark.timeout(180)
def test_bench_autoscale_on_ray_leaves_no_cluster_or_session_dir(short_tmp: Path) -> None:
    # Ray keeps its session dir (logs, sockets) after shutdown: the bench left one per run.
    # And after Ctrl-C its workers' thread, still calling Ray once the cluster was shut
    # down, started a second local cluster (in TMPDIR/ray) that outlived the bench.
    pytest.importorskip("ray")
    cmd = [sys.executable, str(BENCH / "autoscale"), "--workers", "ray", "--duration", "60", "--rounds", "1",
           "--peers", "fixed-16"]
    tmp_path = short_tmp  # Ray's socket paths
    try:
        rc, out = _ctrl_c_after(cmd, tmp_path, "ideal workers", 3.0)
        assert rc == -signal.SIGINT and "KeyboardInterrupt" in out, out[-2000:]
        left, entries = _left_behind(tmp_path)
        assert left == [] and entries == [], (left, list(tmp_path.rglob("*"))[:5])
    finally:
        for p in procs_naming(str(tmp_path)):  # Ray's processes that outlived the bench
            os.kill(p, signal.SIGKILL)




@pytest.mark.timeout(120)
def test_bench_soak_says_why_a_server_did_not_start(tmp_path: Path) -> None:
    # Was: "see <dir>/server.log", a file the bench had just deleted with its work dir.
    r = subprocess.run([sys.executable, str(BENCH / "soak"), "--capacity", "0", "--seconds", "2",
                        "--report-every", "1"], capture_output=True, text=True, timeout=100,
                       env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert r.returncode != 0 and "capacity must be positive" in r.stderr, r.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args,why", [
    (["--seconds", "3"], "--report-every must be below"),  # was: `ratio 1.000`, the end sample over itself
    (["--clients", "0"], "--clients must be at least 1"),  # was: a ratio from a run with no operation
    (["--items", "8"], "--items must be at least 16"),  # was: every operation a client error
    (["--capacity", "10XB"], "--capacity: not a size"),
])
def test_bench_soak_refuses_arguments_that_give_no_ratio(args: list[str], why: str) -> None:
    r = subprocess.run([sys.executable, str(BENCH / "soak"), *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and why in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


@pytest.mark.timeout(180)
def test_bench_managed_removes_its_datasets_and_servers_files(tmp_path: Path) -> None:
    # Its temp dir (two datasets, every round's server files: ~100 MB at the defaults) was
    # never removed, after a run or a Ctrl-C; and after a failed job the others trained on.
    cmd = [sys.executable, str(BENCH / "managed"), "--rounds", "1", "--seconds", "30", "--items", "20"]
    try:
        rc, out = _ctrl_c_after(cmd, tmp_path, "2 datasets x", 6.0)
        assert rc == -signal.SIGINT, out[-2000:]
        left, entries = _left_behind(tmp_path)
        assert entries == []
        assert left == []  # jobs, daemons
    finally:
        for p in procs_naming(str(tmp_path)):
            os.kill(p, signal.SIGKILL)


def test_bench_partial_leaves_no_temp_dir_on_a_usage_error(tmp_path: Path) -> None:
    # Its temp dir was made before the --stagger checks, whose ap.error left it behind.
    r = subprocess.run([sys.executable, str(BENCH / "partial"), "--stagger", "-1"], capture_output=True,
                       text=True, timeout=60, env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert r.returncode == 2 and "--stagger must be >= 0" in r.stderr, r.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A temp dir with a short path: Unix socket paths under it stay within 107 bytes."""
    d = Path(tempfile.mkdtemp(prefix="rv", dir="/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)
        (d.parent / f"{d.name}.log").unlink(missing_ok=True)


@pytest.mark.timeout(300)
def test_bench_tfdata_stops_its_cold_jobs_when_one_times_out(short_tmp: Path) -> None:
    # (b)'s jobs wait 15 s (for TensorFlow's import) before their epoch; a --timeout below that
    # failed the bench and left them running on, orphaned.
    pytest.importorskip("tensorflow")
    tmp_path = short_tmp
    log = tmp_path.parent / f"{tmp_path.name}.log"
    with open(log, "w") as out:
        p = subprocess.Popen([sys.executable, str(BENCH / "tfdata"), "--items", "40", "--shards", "2",
                              "--rounds", "1", "--cold-rounds", "1", "--jobs", "2", "--timeout", "2"],
                             stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ, TMPDIR=str(tmp_path)),
                             start_new_session=True)
    try:
        rc = p.wait(240)
        assert rc != 0 and "TimeoutExpired" in log.read_text(), log.read_text()[-2000:]
        left, entries = _left_behind(tmp_path)
        assert left == []
        assert entries == []
    finally:
        _kill_session(p.pid)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("bench,args,why", [
    ("samplersim", ["--seeds", "0"], "--seeds must be at least 1"),  # was: StatisticsError
    ("digest", ["--files", "0"], "--files must be at least 1"),  # ZeroDivisionError
    ("hitpath", ["--rounds", "0"], "--rounds must be at least 1"),  # StatisticsError after the fill
    ("hitpath", ["--items", "50"], "--batch 64 exceeds --items 50"),  # random.sample's ValueError
    ("allocation", ["--seeds", "0"], "--seeds must be at least 1"),
    ("grpccall", ["--calls", "0"], "--calls must be at least 1"),  # ZeroDivisionError
    ("scaleworkers", ["--rounds", "0"], "--rounds must be at least 1"),
    ("revpath", ["--rounds", "0"], "--rounds must be at least 1"),
    ("diskchurn", ["--item", "10XB"], "--item: not a size: '10XB'"),  # parse_size's traceback
    ("balancer", ["--items", "0"], "--items must be at least 1"),
    ("autoorder", ["--workers", "0"], "--workers must be at least 1"),
    ("placement", ["--window", "0"], "--window must be positive"),
    ("autoscale", ["--duration", "0"], "--duration must be positive"),
    ("epoch", ["--capacity", "10XB"], "--capacity: not a size"),  # after writing the dataset
    ("partial", ["--servers", "0"], "--servers must be at least 1"),  # ZeroDivisionError
    ("partial", ["--bandwidth", "0"], "--bandwidth must be a positive rate"),  # TypeError after calibrating
    ("tfdata", ["--bandwidth", "10XB"], "--bandwidth: not a size"),  # hidden: the store's stderr is not shown
    ("managed", ["--compute-bandwidth", "fast"], "--compute-bandwidth: not a size"),
    ("autocache", ["--latency", "soon"], "not a duration: 'soon'"),  # "objstore exited with 2"
    ("revpath", ["--against", "no-such-commit"], "is not a commit"),  # CalledProcessError, temp dir left
    ("diskchurn", ["--against", "no-such-commit"], "is not a commit"),  # the same
    ("scaleworkers", ["--against", "no-such-commit"], "is not a commit"),  # CalledProcessError
])
def test_benches_name_a_bad_argument_before_any_work(tmp_path: Path, bench: str, args: list[str], why: str) -> None:
    r = subprocess.run([sys.executable, str(BENCH / bench), *args], capture_output=True, text=True, timeout=100,
                       env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert r.returncode == 2 and why in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []


def test_digest_names_a_symlink_loop(tmp_path: Path) -> None:
    # Was: "a broken symlink", for links whose targets all exist.
    d = tmp_path / "d"
    d.mkdir()
    (d / "f").write_bytes(b"x")
    (d / "a1").symlink_to("a2")
    (d / "a2").symlink_to("a1")
    r = subprocess.run([sys.executable, str(DIGEST), str(d), "-o", str(tmp_path / "o.dig")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "cannot read a1: a symlink loop" in r.stderr, r.stderr


@pytest.mark.timeout(120)
def test_bench_misspath_small_run_reports_instead_of_dividing_by_zero(tmp_path: Path) -> None:
    # The store's and servers' CPU come in 10 ms ticks: a small run saw none, and a
    # ZeroDivisionError in an informational column lost the whole report and its ratio.
    r = subprocess.run([sys.executable, str(BENCH / "misspath"), "--items", "16", "--rounds", "1"],
                       capture_output=True, text=True, timeout=100, env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert r.returncode == 0 and r.stdout.splitlines()[-1].startswith("ratio "), (r.stdout + r.stderr)[-2000:]
    assert list(tmp_path.iterdir()) == []


def test_bench_epoch_refuses_a_dataset_of_one_batch() -> None:
    # Was: ZeroDivisionError after the dataset was written: the filling epoch's only batch
    # is left out of its CPU per GB.
    r = subprocess.run([sys.executable, str(BENCH / "epoch"), "--items", "50"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "--items must exceed a batch (64) for embedded" in r.stderr, r.stderr[-2000:]
