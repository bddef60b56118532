"""Two live servers registered under one advertised address (a misconfiguration: cloned
VMs with one host name, say) took the address from each other at every heartbeat: each was
told "not registered", registered again and replaced the other's record, the budget changing
each time. RegisterServer now refuses a new id at the address of a server that still
heartbeats, naming both ids and the address; once that server has stopped for
--heartbeat-seconds x --heartbeat-misses, a new id takes its place as before."""
from __future__ import annotations

import threading

import grpc
import pytest

from cacheserver.proto import manager_pb2 as mpb
from cacheserver.proto import manager_pb2_grpc as mpb_grpc
from manager.manager_client import ManagerClient
from procs import cachemanager, cacheserver, free_port, wait_until


def _register(stub, sid: str, address: str) -> mpb.RegisterServerResponse:
    return stub.RegisterServer(mpb.RegisterServerRequest(server_id=sid, address=address, capacity=10**6),
                               timeout=5)


def test_a_second_live_server_at_an_address_is_refused_naming_both(tmp_path):
    mgr = cachemanager(str(tmp_path / "m")).start()
    srv = cacheserver(str(tmp_path / "a"), "64MB", 0, "--manager", mgr.address).start()
    try:
        with ManagerClient(mgr.address) as mc, grpc.insecure_channel(mgr.address) as ch:
            rows = wait_until(lambda: [s for s in mc.status().servers if s.alive], "the server in the ring")
            holder, before = rows[0].server_id, mc.status()
            stub = mpb_grpc.ManagerStub(ch)
            with pytest.raises(grpc.RpcError) as e:
                _register(stub, "intruder", srv.address)
            assert e.value.code() is grpc.StatusCode.ALREADY_EXISTS
            msg = e.value.details()
            assert holder in msg and "intruder" in msg and srv.address in msg, msg
            after = mc.status()
            assert [(s.server_id, s.alive) for s in after.servers] == [(holder, True)]
            assert (after.ring_version, after.budget) == (before.ring_version, before.budget)
            srv.kill()  # stopped: after 3 x 0.2 s without a heartbeat its address is free again
            wait_until(lambda: _taken(stub, "successor", srv.address), "the successor's registration", 10)
            assert [s.server_id for s in mc.status().servers] == ["successor"]
    finally:
        srv.kill()
        mgr.kill()


def _taken(stub, sid: str, address: str) -> bool:
    try:
        _register(stub, sid, address)
        return True
    except grpc.RpcError as e:
        assert e.code() is grpc.StatusCode.ALREADY_EXISTS, e
        return False


def test_a_server_refused_its_address_logs_why(tmp_path):
    """The refused server's log said only `manager ... unreachable: StatusCode.ALREADY_EXISTS`:
    neither that it was refused nor the manager's reason (the other server's id)."""
    mgr = cachemanager(str(tmp_path / "m")).start()
    port = free_port()
    address = f"127.0.0.1:{port}"
    stop = threading.Event()
    srv = None
    try:
        with grpc.insecure_channel(mgr.address) as ch:
            stub = mpb_grpc.ManagerStub(ch)
            _register(stub, "holder", address)

            def beat() -> None:  # the holder stays alive for the manager
                while not stop.wait(0.1):
                    stub.Heartbeat(mpb.HeartbeatRequest(server_id="holder", address=address), timeout=5)
            t = threading.Thread(target=beat, daemon=True)
            t.start()
            srv = cacheserver(str(tmp_path / "a"), "64MB", port, "--manager", mgr.address).start()
            log = tmp_path / "a" / "server.log"
            said = wait_until(lambda: [ln for ln in log.read_text().splitlines() if "refused this server" in ln],
                              "the refusal in the server's log", 15)
            assert "holder" in said[0] and "ALREADY_EXISTS" in said[0] and "unreachable" not in said[0], said
            stop.set()
            t.join(5)
    finally:
        stop.set()
        if srv is not None:
            srv.kill()
        mgr.kill()
