"""Servers at one address, and heartbeat ages across a wall-clock step (manager/membership.py,
manager/model.py, service.build_status).

1. A server registering under a new id at an address another record holds replaced that
   record silently (Registry.join): operators saw a server vanish from Status with no line
   in the manager's log saying why. The join now notes the replaced server (id, address).
2. Two live servers advertising one address took the address from each other at every
   heartbeat. Liveness.live_holder names the live server a registration would replace
   (RegisterServer refuses it with membership.address_taken).
3. Liveness.server() did not follow wall-clock steps: a Status right after a step reported
   heartbeat ages off by the step."""
from __future__ import annotations

import os

from manager.effects import Note
from manager.manager_client import ManagerClient
from manager.membership import Liveness, Registry, address_taken
from manager.model import ManagerConfig, ManagerModel
from manager.service import build_status
from procs import cachemanager, cacheserver, wait_until


def _join(m: ManagerModel, sid: str, addr: str, cap: int, now: float) -> list:
    return m.apply({"type": "server_join", "server_id": sid, "address": addr, "capacity": cap, "now": now})


def _replaced(effects: list) -> list[dict]:
    return [dict(e.fields) for e in effects if isinstance(e, Note) and e.message.startswith("server replaced")]


def test_a_join_that_replaces_a_record_notes_the_replaced_server():
    m = ManagerModel(ManagerConfig(budget=None))
    assert _replaced(_join(m, "a", "h:1", 100, 1.0)) == []
    assert _replaced(_join(m, "a", "h:1", 100, 2.0)) == []  # the same server again: nothing replaced
    got = _replaced(_join(m, "b", "h:1", 50, 3.0))
    assert got == [{"server_id": "a", "address": "h:1", "by": "b", "was_in_ring": True}]
    assert sorted(m.registry.servers) == ["b"]
    m.apply({"type": "server_leave", "server_id": "b", "reason": "test", "now": 4.0})
    got = _replaced(_join(m, "c", "h:1", 70, 5.0))  # one out of the ring is replaced too: noted as such
    assert got == [{"server_id": "b", "address": "h:1", "by": "c", "was_in_ring": False}]


def test_live_holder_names_a_live_server_at_the_address_only():
    mono = [0.0]
    reg, live = Registry(), Liveness(1000.0, restart_grace=0.0, mono=lambda: mono[0])
    reg.join("a", "h:1", 100, 1000.0)
    reg.join("x", "h:2", 100, 1000.0)
    live.beat("a", 1000.0)
    live.beat("x", 1000.0)
    mono[0] += 1.0
    assert live.live_holder(reg, "b", "h:1", 1001.0, 3.0) == "a"
    assert live.live_holder(reg, "a", "h:1", 1001.0, 3.0) is None   # its own address
    assert live.live_holder(reg, "b", "h:3", 1001.0, 3.0) is None   # nobody there
    assert live.live_holder(reg, "b", "h:1", 1001.0 + 600.0, 3.0) == "a", "a wall-clock step made a late"
    mono[0] += 5.0
    assert live.live_holder(reg, "b", "h:1", 1606.0, 3.0) is None   # 6 s silent: a stopped server's place
    live.beat("a", 1606.0)
    reg.leave("a", 1606.0)
    assert live.live_holder(reg, "b", "h:1", 1606.0, 3.0) is None   # out of the ring: replaceable


def test_the_refusal_names_both_servers_and_the_address():
    msg = address_taken("h:1", "a1", "b2", 15.0)
    assert "h:1" in msg and "a1" in msg and "b2" in msg and "--listen" in msg and "15 s" in msg


def test_status_heartbeat_ages_follow_a_wall_clock_step():
    mono = [100.0]
    live = Liveness(1000.0, restart_grace=0.0, mono=lambda: mono[0])
    m = ManagerModel(ManagerConfig(budget=None))
    _join(m, "s1", "h:1", 100, 1000.0)
    live.beat("s1", 1000.0)
    mono[0] += 1.0  # 1 s really passed; the wall clock stepped 2 minutes forward meanwhile
    r = build_status(m, live, 1121.0, seq=0, heartbeat_s=1.0, decision_s=1.0)
    assert abs(r.servers[0].last_heartbeat_age - 1.0) < 1e-6, r.servers[0].last_heartbeat_age
    mono[0] += 2.0  # and back by an hour: still the true age
    r = build_status(m, live, 1123.0 - 3600.0, seq=0, heartbeat_s=1.0, decision_s=1.0)
    assert abs(r.servers[0].last_heartbeat_age - 3.0) < 1e-6, r.servers[0].last_heartbeat_age


def test_the_manager_logs_the_server_a_new_id_replaced(tmp_path):
    """Real processes: a server is killed; another, on its port with an empty data dir,
    registers under a new id. The manager's log names the first server and the address."""
    mgr = cachemanager(str(tmp_path / "m")).start()
    first = cacheserver(str(tmp_path / "a"), "64MB", 0, "--manager", mgr.address).start()
    second = None
    try:
        with ManagerClient(mgr.address) as mc:
            old_id = wait_until(lambda: [s.server_id for s in mc.status().servers if s.alive], "the first server")[0]
            first.kill()
            port = int(first.address.rsplit(":", 1)[1])
            second = cacheserver(str(tmp_path / "b"), "32MB", port, "--manager", mgr.address).start()
            wait_until(lambda: [s for s in mc.status().servers if s.server_id != old_id], "the second server", 20)
        log_path = os.path.join(str(tmp_path / "m"), "manager.log")
        line = wait_until(lambda: [x for x in open(log_path).read().splitlines() if "server replaced" in x],
                          "the replacement in the manager's log", 5)[0]
        assert f"server_id={old_id}" in line and f"address={first.address}" in line, line
    finally:
        first.kill()
        if second is not None:
            second.kill()
        mgr.kill()
