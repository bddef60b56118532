"""A lone training process restarted under its job name keeps acting as the job (its token
file, clients/jobtokenfile.py); another user is still refused, with what to do; real daemons."""
import os
import signal
import subprocess
import sys

import pytest

from clients.jobtokenfile import DIR_ENV, JobTokenFile, token_dir
from manager import jobtokens
from manager.manager_client import ManagerClient
from procs import cachemanager, cacheserver, wait_ring
from test_dataset import make_dataset

pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH_ENV = (jobtokens.SECRET_ENV, "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT")
# One training run (argv[5]: "torch", CachedDataset's loader, or "tf", tf_dataset): build the
# dataset on the manager's ring, read an epoch, then (argv[4] "hang") say so and wait to be
# killed, or close and exit.
TRAIN = """
import sys, time
if sys.argv[5] == "tf":
    from clients.tf_source import tf_dataset
    ds = tf_dataset(sys.argv[1], manager=sys.argv[2], job=sys.argv[3], epochs=1)
    n, close = sum(1 for _ in ds), ds.mlcache.close
else:
    from clients.dataset import CachedDataset
    ds = CachedDataset(sys.argv[1], manager=sys.argv[2], job=sys.argv[3])
    n, close = sum(len(b) for b in ds.loader(batch_size=10, seed=1)), ds.close
print("trained", n, flush=True)
if sys.argv[4] == "hang":
    time.sleep(120)
close()
"""


def _env(token_root):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    return dict(env, PYTHONPATH=ROOT, **{DIR_ENV: str(token_root)})


def _train(digest, manager, job, token_root, mode="exit", client="torch"):
    argv = [sys.executable, "-c", TRAIN, str(digest), manager, job, mode, client]
    return subprocess.Popen(argv, cwd=ROOT, env=_env(token_root), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.fixture
def cluster(tmp_path):
    m = cachemanager(str(tmp_path / "m")).start()
    s = cacheserver(str(tmp_path / "s"), "64MB", 0, "--manager", m.address).start()
    wait_ring(m.address, 1)
    yield m
    s.kill()
    m.kill()


@pytest.mark.parametrize("client", ["torch", "tf"])
def test_a_lone_job_killed_and_run_again_registers_and_trains(tmp_path, cluster, client):
    if client == "tf":
        pytest.importorskip("tensorflow")
    m = cluster
    digest, items = make_dataset(tmp_path / "ds", n=60)
    mine, theirs = tmp_path / "alice-tokens", tmp_path / "bob-tokens"
    first = _train(digest, m.address, "lone", mine, "hang", client)
    try:
        line = first.stdout.readline()  # bounded: the child sleeps at most 120 s after it
        assert line.split() == ["trained", str(len(items))], (line, first.stderr.read() if first.poll() else "")
    finally:
        os.kill(first.pid, signal.SIGKILL)  # a crash: no UnregisterJob, the manager keeps the job
        first.wait(30)
    kept = JobTokenFile(m.address, "lone", token_dir(m.address, {DIR_ENV: str(mine)})).path
    assert os.stat(kept).st_mode & 0o777 == 0o600
    assert os.stat(os.path.dirname(kept)).st_mode & 0o777 == 0o700
    # Another user (its own token dir) cannot take the job while the manager keeps it, and is
    # told what to do.
    other = _train(digest, m.address, "lone", theirs, client=client)
    out, err = other.communicate(timeout=120)
    assert other.returncode != 0 and "trained" not in out
    why = err.strip().splitlines()[-1]
    assert why.startswith("clients.coordination.JobRefused:"), err
    assert "job 'lone' is registered with a token this caller did not send" in why
    for hint in (jobtokens.SECRET_ENV, "another job name", "s until the manager drops the old registration",
                 f"This process sent the token kept in {theirs}"):
        assert hint in why, why
    # The same user runs it again under the same name: it registers with its kept token and trains.
    again = _train(digest, m.address, "lone", mine, client=client)
    out, err = again.communicate(timeout=120)
    assert again.returncode == 0, err
    assert out.split() == ["trained", str(len(items))]


def test_a_second_live_process_of_the_same_user_does_not_take_the_token(tmp_path):
    a = JobTokenFile("127.0.0.1:1", "j", str(tmp_path))
    b = JobTokenFile("127.0.0.1:1", "j", str(tmp_path))
    token = a.claim()
    assert token is not None and len(token) == 64
    assert b.claim() is None  # a's flock: the job's token stays with the process running it
    assert "another running process of this user holds" in b.why_none
    a.release()
    assert b.claim() == token  # a finished (or was killed): the next run takes it
    b.release()
    assert JobTokenFile("127.0.0.1:2", "j", token_dir("127.0.0.1:2", {DIR_ENV: str(tmp_path)})).path != \
        JobTokenFile("127.0.0.1:1", "j", token_dir("127.0.0.1:1", {DIR_ENV: str(tmp_path)})).path
    assert os.path.basename(JobTokenFile("m", "../x/y", str(tmp_path)).path) == "..%2Fx%2Fy.token"


@pytest.mark.parametrize("content,why", [(bytes(range(200, 240)), "printable ASCII"),
                                         (b"two words", "printable ASCII")])
def test_a_token_file_that_cannot_travel_as_metadata_is_refused_naming_it(tmp_path, content, why):
    f = JobTokenFile("m", "j", str(tmp_path))
    os.makedirs(tmp_path, exist_ok=True)
    with open(f.path, "wb") as out:
        out.write(content)
    os.chmod(f.path, 0o600)
    with pytest.raises(ValueError, match=why) as e:
        f.claim()
    assert f.path in str(e.value)
    os.chmod(f.path, 0o644)
    with pytest.raises(ValueError, match="readable by others"):
        f.claim()


def test_a_token_dir_that_cannot_be_written_leaves_registration_as_before(tmp_path, cluster, monkeypatch):
    from clients.dataset import CachedDataset
    for name in LAUNCH_ENV:
        monkeypatch.delenv(name, raising=False)
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv(DIR_ENV, str(blocker))  # e.g. a read-only home in a container
    digest, items = make_dataset(tmp_path / "ds", n=20)
    ds = CachedDataset(digest, manager=cluster.address, job="no-home")
    try:
        assert ds.coordinator.reached and "cannot be kept" in ds.coordinator._token_file.why_none
        assert sum(len(b) for b in ds.loader(batch_size=10)) == len(items)
    finally:
        ds.close()


def test_tokens_that_cannot_travel_as_metadata_are_refused_before_any_call():
    with ManagerClient("127.0.0.1:1", timeout=1) as mc:
        with pytest.raises(ValueError, match="job token for 'j': the token must be printable ASCII"):
            mc.set_job_token("j", "caf\u00e9 token")
    with pytest.raises(ValueError, match="cluster token: the token must be printable ASCII"):
        ManagerClient("127.0.0.1:1", cluster_token=bytes(range(200, 232)))
