"""Issue 12 item 7: only a job acts as itself (its token, issued at registration); real daemons."""
import base64
import json
import os
import time

import grpc
import pytest

from cacheserver.client.server_client import ServerClient
from cacheserver.proto import manager_pb2 as mpb
from cacheserver.vocab import CacheMode
from manager import jobtokens
from manager.manager_client import ManagerClient, ManagerError
from procs import cachemanager, cacheserver, wait_ring

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
def token_file(tmp_path):
    path = tmp_path / "cluster.token"
    path.write_bytes(base64.b64encode(os.urandom(32)))
    path.chmod(0o600)
    return path


@pytest.fixture
def cluster(tmp_path, lone_process, token_file):
    path = token_file
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


def test_only_servers_with_the_cluster_token_join_the_ring(cluster, token_file):
    """The manager sends the cluster token to every server of its ring: a caller without it
    cannot add an address (to be sent the token) or re-register a server's (to void its
    capacity and so the budget)."""
    m, s = cluster
    wait_ring(m.address, 1)  # the real server, with the token, joins
    with ManagerClient(m.address, timeout=5) as plain:
        assert list(plain.get_ring().addresses) == [s.address]
        stub = plain.stub
        join = mpb.RegisterServerRequest(server_id="intruder", address="127.0.0.1:1", capacity=10**12)
        why = _refused(lambda: stub.RegisterServer(join, timeout=5))
        assert why.startswith("RegisterServer is for cache servers: it needs the cluster token")
        _refused(lambda: stub.Heartbeat(mpb.HeartbeatRequest(server_id="intruder", address="127.0.0.1:1"), timeout=5))
        assert list(plain.get_ring().addresses) == [s.address]
    with ManagerClient(m.address, timeout=5, cluster_token=token_file.read_bytes().strip()) as manager:
        assert manager.stub.RegisterServer(join, timeout=5, metadata=manager._role_md).addresses


def test_batch_reports_with_values_out_of_range_are_refused(cluster):
    m, _ = cluster
    with ManagerClient(m.address, timeout=5) as c:
        c.register_job("nan", DS_CH, 1_000_000, 100)
        now = time.time()
        for bad, says in (((now, 0.05, float("nan")), "batches\\[0\\].hit_ratio must be in \\[0, 1\\], got nan"),
                          ((now, 0.05, 1.5), "hit_ratio must be in \\[0, 1\\], got 1.5"),
                          ((now, float("inf")), "end and duration must be finite"),
                          ((now, -1.0), "the duration >= 0")):
            with pytest.raises(ManagerError, match=says) as e:
                c.report_batches("nan", [bad])
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        c.report_batches("nan", [(now, 0.05, 0.5)])


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
    # torchrun restarting the ranks may move the master (another node, another port): one run, one token
    run = {"TORCHELASTIC_RUN_ID": "r1", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    assert jobtokens.job_token("j", run) == jobtokens.job_token("j", {**run, "MASTER_ADDR": "g", "MASTER_PORT": "2"})
    assert jobtokens.job_token("j", run) != jobtokens.job_token("j", {**run, "TORCHELASTIC_RUN_ID": "r2"})
    assert jobtokens.job_token("j", {**run, "TORCHELASTIC_RUN_ID": "none"}) != \
        jobtokens.job_token("j", {**run, "TORCHELASTIC_RUN_ID": "none", "MASTER_PORT": "2"})
    assert jobtokens.matches("t", jobtokens.token_hash("t")) and not jobtokens.matches("u", jobtokens.token_hash("t"))
    assert not jobtokens.matches(None, jobtokens.token_hash("t")) and jobtokens.matches(None, "")


def test_plans_and_load_reports_need_the_jobs_token(cluster, token_file):
    m, _ = cluster
    with ManagerClient(m.address, timeout=5) as owner, ManagerClient(m.address, timeout=5) as intruder, \
            ManagerClient(m.address, timeout=5, cluster_token=token_file.read_bytes().strip()) as admin:
        owner.register_job("victim", DS_CH, 1_000_000, 100)
        intruder.register_job("other", DS, 50_000, 10)
        # A job's plan and load reports are the job's: GetPlan names it, ReportLoaded moves
        # its dataset's chunks on (a false 1.0 would activate a chunk not loaded).
        assert "token this caller did not send" in _refused(lambda: intruder.get_plan(DS_CH, "victim"))
        _refused(lambda: intruder.report_loaded(DS_CH, 0, 1.0, job="victim"))
        why = _refused(lambda: intruder.report_loaded(DS_CH, 0, 1.0, job=""))
        assert "needs the job registered on it" in why, why
        _refused(lambda: intruder.report_loaded(DS_CH, 0, 1.0, job="other"))  # its job is on another dataset
        assert intruder.get_plan(DS_CH).option  # the dataset-wide plan: its fingerprint is the key
        # The job itself, and the manager's role, may.
        assert owner.report_loaded(DS_CH, 0, 0.5).dataset == DS_CH
        assert owner.get_plan(DS_CH, "victim").dataset == DS_CH
        assert admin.report_loaded(DS_CH, 0, 1.0, job="").dataset == DS_CH
        assert owner.get_plan(DS_CH, "victim").chunks == (0,)


def test_status_shows_a_caller_only_its_own_jobs(cluster, token_file):
    m, _ = cluster
    with ManagerClient(m.address, timeout=5) as owner, ManagerClient(m.address, timeout=5) as other, \
            ManagerClient(m.address, timeout=5) as anonymous, \
            ManagerClient(m.address, timeout=5, cluster_token=token_file.read_bytes().strip()) as admin:
        owner.register_job("victim", DS_CH, 1_000_000, 100)
        other.register_job("other", DS, 50_000, 10)
        mine = other.status_dict()
        assert [j["job"] for j in mine["jobs"]] == ["other"]
        assert [d["dataset"] for d in mine["datasets"]] == [DS]
        assert (mine["other_jobs"], mine["other_datasets"]) == (1, 1)
        assert "victim" not in str(other.status()) and DS_CH not in str(other.status())
        assert mine["budget"] and mine["servers"]  # the aggregates stay
        none = anonymous.status_dict()
        assert (none["jobs"], none["datasets"], none["decisions"]) == ([], [], [])
        assert (none["other_jobs"], none["other_datasets"]) == (2, 2)
        everything = admin.status_dict()
        assert sorted(j["job"] for j in everything["jobs"]) == ["other", "victim"]
        assert everything["other_jobs"] == 0


def test_a_job_from_a_state_before_tokens_is_bound_by_its_next_registration(tmp_path, lone_process, token_file):
    state = tmp_path / "m"
    state.mkdir()
    ev = {"type": "job_register", "job": "old", "dataset": DS, "dataset_bytes": 50_000, "n_items": 10,
          "n_gpus": 1, "now": time.time()}  # as a manager before job tokens journaled it
    (state / "journal.jsonl").write_text(json.dumps({"seq": 1, "ev": ev}) + "\n")
    m = cachemanager(str(state), 0, "--cluster-token-file", str(token_file)).start()
    try:
        with ManagerClient(m.address, timeout=5) as first, ManagerClient(m.address, timeout=5) as later:
            assert later.status_dict()["other_jobs"] == 1  # no token: only the manager's role sees it
            token = first.register_job("old", DS, 50_000, 10).token  # the first caller binds it
            assert len(token) == 64
            _refused(lambda: later.register_job("old", DS, 50_000, 10))
            _refused(lambda: later.report_batches("old", _batches()))
            first.report_batches("old", _batches())
            assert [j["job"] for j in first.status_dict()["jobs"]] == ["old"]
        log = (state / "manager.log").read_text()
        assert "job old, from a state written before job tokens, now takes the token" in log
    finally:
        m.kill()
    # The binding is journaled: a restarted manager keeps it.
    m = cachemanager(str(state), 0, "--cluster-token-file", str(token_file)).start()
    try:
        with ManagerClient(m.address, timeout=5) as later:
            _refused(lambda: later.unregister_job("old"))
    finally:
        m.kill()


def test_a_pre_token_job_re_registered_under_the_first_token_release_is_still_bound_by_a_client(
        tmp_path, lone_process, token_file):
    # The release before this one journaled a re-registration of a job from a state before
    # tokens with the hash of an empty token (it kept none then): replayed now, that must
    # not bind the job to a token no client can send.
    state = tmp_path / "m"
    state.mkdir()
    ev = {"type": "job_register", "job": "old", "dataset": DS, "dataset_bytes": 50_000, "n_items": 10,
          "n_gpus": 1, "now": time.time()}
    again = dict(ev, token_hash=jobtokens.token_hash(""), now=time.time() + 1)
    (state / "journal.jsonl").write_text(json.dumps({"seq": 1, "ev": ev}) + "\n" +
                                         json.dumps({"seq": 2, "ev": again}) + "\n")
    m = cachemanager(str(state), 0, "--cluster-token-file", str(token_file)).start()
    try:
        with ManagerClient(m.address, timeout=5) as first, ManagerClient(m.address, timeout=5) as later:
            assert len(first.register_job("old", DS, 50_000, 10).token) == 64  # the first caller binds it
            first.report_batches("old", _batches())
            _refused(lambda: later.report_batches("old", _batches()))
    finally:
        m.kill()


def test_a_tenant_sees_only_its_own_jobs_on_a_shared_pipeline():
    """Two tenants' jobs on one (dataset, pipeline): the status a tenant is shown names
    neither the other's jobs nor which of them are fixed at transformed."""
    from cacheserver.proto import manager_pb2 as mpb
    from manager.statusview import restrict

    r = mpb.StatusResponse()
    r.pipelines.add(decision=mpb.AutocacheDecision(dataset=DS, jobs=["mine", "theirs"], fixed=["mine", "theirs"]))
    r.pipelines.add(decision=mpb.AutocacheDecision(dataset=DS_CH, jobs=["theirs"], fixed=["theirs"]))
    shown = restrict(r, {"mine"}, {DS})
    assert [(list(p.decision.jobs), list(p.decision.fixed)) for p in shown.pipelines] == [(["mine"], ["mine"])]
