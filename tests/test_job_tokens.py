"""Issue 12 item 7: only a job acts as itself (its token, issued at registration); real daemons."""
import base64
import os
import time

import grpc
import pytest

from cacheserver.client.server_client import ServerClient
from cacheserver.proto import manager_pb2 as mpb
from cacheserver.vocab import CacheMode
from manager import jobtokens
from manager.manager_client import ManagerClient, ManagerError
from procs import cachemanager, cacheserver

DS = "e5" * 32
DS_CH = "f6" * 32
LAUNCH_ENV = (jobtokens.SECRET_ENV, "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def lone_process(monkeypatch):
    """No launcher secret in this process: a client holds only the tokens it was given."""
    for name in LAUNCH_ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture
def cluster(tmp_path, lone_process):
    token = base64.b64encode(os.urandom(32))
    path = tmp_path / "cluster.token"
    path.write_bytes(token)
    path.chmod(0o600)
    m = cachemanager(str(tmp_path / "m"), 0, "--chunks", "--budget", "300kB", "--chunk-size", "100kB",
                     "--cluster-token-file", str(path)).start()
    s = cacheserver(str(tmp_path / "s"), "64MB", 0, "--manager", m.address, "--cluster-token-file", str(path),
                    "--data-listen", "127.0.0.1:0").start()
    yield m, s
    s.kill()
    m.kill()


def _refused(call) -> str:
    with pytest.raises((ManagerError, grpc.RpcError)) as e:
        call()
    err = e.value
    code = err.code if isinstance(err, ManagerError) else err.code()
    assert code == grpc.StatusCode.PERMISSION_DENIED, err
    return str(err) if isinstance(err, ManagerError) else err.details()


def _batches(n=5):
    now = time.time()
    return [(now - (n - i) * 0.05, 0.05, None) for i in range(n)]


def test_only_the_job_with_its_token_acts_as_it(cluster):
    m, s = cluster
    with ManagerClient(m.address, timeout=5) as owner, ManagerClient(m.address, timeout=5) as intruder, \
            ServerClient(s.address) as plain:
        info = owner.register_job("victim", DS_CH, 1_000_000, 100)
        assert len(info.token) == 64 and owner.job_token("victim") == info.token
        owner.report_loaded(DS_CH, 0, 1.0)
        assert owner.get_plan(DS_CH, "victim").chunks == (0,)
        # Another client (no token, a wrong one) can neither take the job's name, report its
        # batches (which decide its bypass probes), drop its chunk reference, nor unregister it.
        why = _refused(lambda: intruder.register_job("victim", DS_CH, 1_000_000, 100))
        assert "job 'victim' is registered with a token this caller did not send" in why
        assert jobtokens.SECRET_ENV in why
        _refused(lambda: intruder.report_batches("victim", _batches()))
        _refused(lambda: intruder.release_chunk("victim", DS_CH, 0))
        _refused(lambda: intruder.unregister_job("victim"))
        intruder.set_job_token("victim", jobtokens.new_token())
        _refused(lambda: intruder.unregister_job("victim"))
        stub = intruder.stub
        _refused(lambda: stub.UnregisterJob(mpb.UnregisterJobRequest(job="victim"), timeout=5))
        # ... nor, on the servers, set its mode or drop its chunk references directly.
        _refused(lambda: plain.set_job_mode("victim", CacheMode.BYPASS.code))
        _refused(lambda: plain.unref_chunk(DS_CH, 0, "victim"))
        st = owner.status_dict()
        assert [j["job"] for j in st["jobs"]] == ["victim"]
        assert {c["chunk"]: c["jobs"] for c in st["datasets"][0]["chunks"]}[0] == ["victim"]
        # The job itself, with its token, can.
        assert owner.register_job("victim", DS_CH, 1_000_000, 100).token == info.token
        owner.report_batches("victim", _batches())
        owner.release_chunk("victim", DS_CH, 0)
        owner.unregister_job("victim")
        assert owner.status_dict()["jobs"] == []
        # Its name is free again: the next registrant gets a new token.
        assert intruder.register_job("victim", DS, 50_000, 10).token not in ("", info.token)


def test_ranks_of_one_job_share_the_launchers_secret(cluster, lone_process):
    m, _ = cluster
    lone_process.setenv(jobtokens.SECRET_ENV, "the launcher's secret")
    with ManagerClient(m.address, timeout=5) as rank0, ManagerClient(m.address, timeout=5) as rank1:
        t0 = rank0.register_job("ddp", DS, 50_000, 10, n_gpus=2).token
        assert rank1.register_job("ddp", DS, 50_000, 10, n_gpus=2).token == t0
        rank1.report_batches("ddp", _batches())
        lone_process.setenv(jobtokens.SECRET_ENV, "another launch")
        with ManagerClient(m.address, timeout=5) as other:
            _refused(lambda: other.register_job("ddp", DS, 50_000, 10, n_gpus=2))
        # torchrun's rendezvous, where no secret is set: one run's ranks agree, another run does not.
        lone_process.delenv(jobtokens.SECRET_ENV)
        run = {"TORCHELASTIC_RUN_ID": "run-1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
        for k, v in run.items():
            lone_process.setenv(k, v)
        with ManagerClient(m.address, timeout=5) as r0, ManagerClient(m.address, timeout=5) as r1:
            t = r0.register_job("ddp-torchrun", DS, 50_000, 10).token
            assert r1.register_job("ddp-torchrun", DS, 50_000, 10).token == t
            lone_process.setenv("TORCHELASTIC_RUN_ID", "run-2")
            with ManagerClient(m.address, timeout=5) as other:
                _refused(lambda: other.unregister_job("ddp-torchrun"))
            lone_process.setenv("TORCHELASTIC_RUN_ID", "run-1")
            r1.unregister_job("ddp-torchrun")


def test_job_token_derivation():
    assert jobtokens.job_token("j", {}) is None
    assert jobtokens.job_token("j", {"TORCHELASTIC_RUN_ID": "none"}) is None  # torchrun's default id alone
    a = jobtokens.job_token("j", {jobtokens.SECRET_ENV: "s"})
    assert a == jobtokens.job_token("j", {jobtokens.SECRET_ENV: "s", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    assert a != jobtokens.job_token("k", {jobtokens.SECRET_ENV: "s"})  # one secret, a token per job
    assert jobtokens.job_token("j", {"MASTER_ADDR": "h", "MASTER_PORT": "1"}) != \
        jobtokens.job_token("j", {"MASTER_ADDR": "h", "MASTER_PORT": "2"})
    assert jobtokens.matches("t", jobtokens.token_hash("t")) and not jobtokens.matches("u", jobtokens.token_hash("t"))
    assert not jobtokens.matches(None, jobtokens.token_hash("t")) and jobtokens.matches(None, "")
