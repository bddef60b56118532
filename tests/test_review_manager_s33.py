"""Review of the manager (s33), with real cachemanager and cacheserver processes.

1. A manager restored from an older copy of its state directory (the journal written after it
   lost) answered the snapshot's plans under the versions they had then, below those the lost
   events handed out. A job keeps the newer of two plans it holds (ManagerClient._remember), so
   it kept the lost plan for as long as the restored one did not change: here a chunk loading
   that the restored state no longer loads, so the job reported the wrong chunk loaded and the
   dataset's chunks never moved on. The client now sends the version it holds with its plan
   calls; a manager below it lifts the dataset's version above it (journaled).
2. The actuator logs the stack of a worker thread whose server call is stuck past its limit
   (10x the call timeout by default), once per call: a CI stall shows where it hangs."""
from __future__ import annotations

import logging
import os
import shutil
import signal
import time

from cacheserver.client.server_client import ServerClient
from cacheserver.vocab import CacheMode
from manager.actuator import Actuator, Desired
from manager.effects import SetMode
from manager.manager_client import ManagerClient
from procs import cachemanager, free_port, sigstop, wait_until

DS = "5e" * 32
CHUNKED = ("--chunks", "--budget", "30MB", "--chunk-size", "10MB")


def _backup(state: str, to: str) -> None:
    """A copy of the state directory as an operator's backup takes it (no lock, no log)."""
    os.makedirs(to)
    for name in ("snapshot.json", "journal.jsonl"):
        if os.path.exists(os.path.join(state, name)):
            shutil.copy2(os.path.join(state, name), os.path.join(to, name))


# ---- 1. a state restored from an older backup ------------------------------------------------
def test_a_job_drops_a_plan_the_restored_manager_lost(tmp_path):
    port = free_port()
    m = cachemanager(str(tmp_path / "m1"), port, *CHUNKED).start()
    try:
        with ManagerClient(f"127.0.0.1:{port}", timeout=5) as mc:  # one client throughout, as a job's
            first = mc.register_job("job", DS, 100_000_000, 1000).plan  # chunked, k = 10: chunk 0 loads
            assert (first.option, first.loading, first.active) == ("chunked", 0, None)
            _backup(str(tmp_path / "m1"), str(tmp_path / "m2"))
            lost = mc.report_loaded(DS, 0, 1.0)  # chunk 0 active, chunk 1 loads: a new version
            assert (lost.active, lost.loading) == (0, 1) and lost.version > first.version
            m.kill()  # kill -9; the state dir is lost, its backup restored
            m = cachemanager(str(tmp_path / "m2"), port, *CHUNKED).start()
            reply = mc.report_batches("job", [(time.time(), 0.05, None)])
            assert reply.plan_version != lost.version  # the job asks for the plan (coordination._report)
            plan = mc.get_plan(DS, "job")
            assert (plan.active, plan.loading) == (None, 0), \
                f"the job kept the plan the restored manager lost: {plan}"
            assert plan.version > lost.version
            # and the job's work on it counts: its report of chunk 0 moves the dataset on
            assert (mc.report_loaded(DS, plan.loading, 1.0).active, mc.get_plan(DS, "job").loading) == (0, 1)
            digest, version = mc.status().state_digest, mc.get_plan(DS, "job").version
            m.kill()  # the lift is journaled: replay gives the same state
            m = cachemanager(str(tmp_path / "m2"), port, *CHUNKED).start()
            assert (mc.status(wait=True).state_digest, mc.get_plan(DS, "job").version) == (digest, version)
    finally:
        m.kill()


def test_a_bad_held_plan_version_is_refused_naming_it(tmp_path):
    import grpc

    from cacheserver.proto import manager_pb2 as mpb
    from manager.modelrecords import PLAN_VERSION_HEADER

    m = cachemanager(str(tmp_path / "m"), 0, *CHUNKED).start()
    try:
        with ManagerClient(m.address, timeout=5) as mc:
            mc.register_job("job", DS, 100_000_000, 1000)
            md = (("x-mlcache-job-token", mc.job_token("job")), (PLAN_VERSION_HEADER, "-1"))
            try:
                mc.stub.GetPlan(mpb.GetPlanRequest(dataset=DS, job="job"), timeout=5, metadata=md)
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and PLAN_VERSION_HEADER in e.details()
            else:
                raise AssertionError("a held version of -1 was taken")
    finally:
        m.kill()


# ---- 2. where a stuck server call hangs ------------------------------------------------------
def test_a_stuck_server_call_logs_its_threads_stack_once(server, caplog):
    want = Desired(bypass={"j"})  # what the SetMode below decides: reconcile keeps it
    act = Actuator(lambda: want, lambda: [server.address], timeout=5.0, stuck_after_s=0.5)
    sigstop(server.pid)  # it answers nothing: the worker's call waits out its 5 s deadline
    try:
        with caplog.at_level(logging.WARNING, logger="manager.actuator"):
            act.submit([SetMode("j", "bypass", "probe")])  # the worker's first reconcile, then the call

            def stuck() -> list[logging.LogRecord]:
                act.reconcile()
                return [r for r in caplog.records if "stuck for" in r.getMessage()]
            first = wait_until(stuck, "the stuck call logged", 4.0)
            t_end = time.monotonic() + 1.0
            while time.monotonic() < t_end:  # the same call, still stuck: logged once
                assert len(stuck()) == 1
                time.sleep(0.1)
        msg = first[0].getMessage()
        assert server.address in msg and "reconcile stuck for" in msg, msg
        assert "server_client.py" in msg and "in _reconcile" in msg, msg  # where it hangs
        assert act.counters.snapshot()["server_calls_stuck"] == 1
    finally:
        os.kill(server.pid, signal.SIGCONT)
    try:
        assert act.drain(15)
        with ServerClient(server.address, use_dataplane=False) as sc:
            wait_until(lambda: sc.stats().job_modes.get("j") == CacheMode.BYPASS.code,
                       "the call carried out once the server answers")
    finally:
        act.stop()
