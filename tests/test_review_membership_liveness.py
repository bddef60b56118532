"""Membership liveness (manager/membership.py): what Liveness keeps about servers must follow
the registry, and time out of the ring must be measured like silences.

1. A server registering under a new id at the address of one that is down (a pod restarted
   on a new data dir) replaces the old record (Registry.join), but the old id's heartbeat
   entry stayed in Liveness for the manager's life: only forgetting, which needs a record,
   ever dropped one.
2. Forgetting servers compared wall times: a step of the wall clock (NTP, a resumed VM)
   forgot every server out of the ring at once, or, stepped back, put forgetting off by the
   step. Liveness.forgettable measures it on the clock liveness keeps; the decision loop's
   switch to it (manager/decisions.py) comes with tests/test_review_membership_forget_step.py."""
from __future__ import annotations

from manager.manager_client import ManagerClient
from manager.managerd import DaemonConfig, ManagerDaemon
from manager.membership import Liveness, Registry
from manager.model import ManagerConfig
from procs import cacheserver, wait_until


def test_a_replaced_servers_heartbeat_entry_goes_with_its_record():
    reg, live = Registry(), Liveness(100.0, restart_grace=0.0)
    reg.join("old", "h:1", 100, 100.0)
    live.beat("old", 100.0, used=7)
    reg.join("new", "h:1", 50, 101.0)  # same address, new id: the old record goes
    live.beat("new", 101.0)
    assert live.dead_servers(reg, 101.5, 3.0) == []
    assert live.server("old") is None, "the replaced server's heartbeat entry was kept"
    assert live.server("new") is not None and live.server("new").at == 101.0


def _daemon(state_dir: str) -> ManagerDaemon:
    return ManagerDaemon(DaemonConfig(listen="127.0.0.1:0", state_dir=state_dir, fsync=False,
                                      model=ManagerConfig(budget=None), heartbeat_s=0.2, decision_s=0.2,
                                      reconcile_s=0.2))


def test_a_pod_restarted_on_a_new_data_dir_at_the_same_address_is_one_server(tmp_path):
    """Real cache servers: the first is killed; the second, on its port with an empty data
    dir, registers under a new id. Status and the budget count the second only, and the
    first's heartbeat entry goes at the next decision round."""
    d = _daemon(str(tmp_path / "m"))
    d.start()
    first = cacheserver(str(tmp_path / "a"), "64MB", 0, "--manager", d.address).start()
    second = None
    try:
        with ManagerClient(d.address) as mc:
            rows = wait_until(lambda: [s for s in mc.status().servers if s.alive], "the first server in the ring")
            old_id = rows[0].server_id
            assert d.liveness.server(old_id) is not None
            first.kill()
            port = int(first.address.rsplit(":", 1)[1])
            second = cacheserver(str(tmp_path / "b"), "32MB", port, "--manager", d.address).start()
            new = wait_until(lambda: [s for s in mc.status().servers if s.server_id != old_id],
                             "the second server's record", 15)
            status = mc.status()
            assert [(s.server_id, s.address, s.alive) for s in status.servers] == [
                (new[0].server_id, first.address, True)]
            assert status.budget == new[0].capacity == 32_000_000  # not 64 MB + 32 MB
            wait_until(lambda: d.liveness.server(old_id) is None, "the first server's heartbeat entry dropped", 20)
            assert d.liveness.server(new[0].server_id) is not None
    finally:
        first.kill()
        if second is not None:
            second.kill()
        d.stop(grace=1.0)


def _down(reg: Registry, sid: str, address: str, joined: float, left: float) -> None:
    reg.join(sid, address, 100, joined)
    reg.leave(sid, left)


def test_a_forward_step_of_the_wall_clock_forgets_nobody():
    mono = [50.0]
    live, reg = Liveness(1000.0, restart_grace=0.0, mono=lambda: mono[0]), Registry()
    _down(reg, "a", "h:1", 1000.0, 1010.0)
    mono[0] += 10.0
    assert live.forgettable(reg, 1010.0, 100.0) == []  # seen out of the ring at 1010
    mono[0] += 1.0
    assert live.forgettable(reg, 1011.0 + 3600.0, 100.0) == [], "a step of the wall clock forgot a server"
    mono[0] += 100.0
    assert live.forgettable(reg, 1111.0 + 3600.0, 100.0) == ["a"]  # 101 s really out: forgotten


def test_a_backward_step_does_not_put_forgetting_off():
    """The state's time does not go back with the clock, so a server leaving after a step
    back is journaled as leaving at the state's (later) time."""
    mono = [50.0]
    live, reg = Liveness(1000.0, restart_grace=0.0, mono=lambda: mono[0]), Registry()
    _down(reg, "a", "h:1", 1000.0, 1000.0)  # left_at: the state's time, 1000
    mono[0] += 1.0
    assert live.forgettable(reg, 1001.0 - 3600.0, 100.0) == []  # the wall clock went back an hour
    mono[0] += 101.0
    assert live.forgettable(reg, 1102.0 - 3600.0, 100.0) == ["a"]


def test_out_of_the_ring_at_a_restart_counts_from_the_journal_and_again_after_a_rejoin():
    mono = [0.0]
    live, reg = Liveness(5000.0, restart_grace=0.0, mono=lambda: mono[0]), Registry()
    _down(reg, "a", "h:1", 1000.0, 4950.0)  # replayed: out since 4950, 50 s before the start
    _down(reg, "b", "h:2", 1000.0, 6000.0)  # journaled ahead of this clock (it was set back)
    assert live.forgettable(reg, 5000.0, 60.0) == []
    mono[0] += 11.0
    assert live.forgettable(reg, 5011.0, 60.0) == ["a"]
    reg.join("a", "h:1", 100, 5011.0)  # back in the ring, and out again later: counted anew
    mono[0] += 40.0
    reg.leave("a", 5051.0)
    assert live.forgettable(reg, 5051.0, 60.0) == []
    mono[0] += 30.0
    assert live.forgettable(reg, 5081.0, 60.0) == ["b"]  # b: counted from this clock's 5000
    mono[0] += 31.0
    assert live.forgettable(reg, 5112.0, 60.0) == ["a", "b"]
    reg.forget("a")
    reg.forget("b")
    assert live.forgettable(reg, 5112.0, 60.0) == [] and live._out == {}


def test_a_registering_servers_items_show_before_its_first_heartbeat(tmp_path):
    """A real cache server with 5 items restarts under a manager that asks for a heartbeat a
    minute apart. Before: RegisterServer carried no item count, so status said 0 items until
    the first heartbeat (its used bytes came through); now both come with the registration."""
    import hashlib

    from cacheserver.client.server_client import ServerClient

    data = str(tmp_path / "srv")
    srv = cacheserver(data, "64MB").start()
    try:
        with ServerClient(srv.address) as c:
            c.put([(hashlib.sha256(b"%d" % i).digest(), b"v" * 1000) for i in range(5)], "j")
    finally:
        srv.stop()
    d = ManagerDaemon(DaemonConfig(listen="127.0.0.1:0", state_dir=str(tmp_path / "m"), fsync=False,
                                   model=ManagerConfig(budget=None), heartbeat_s=60.0, decision_s=0.2,
                                   reconcile_s=0.2))
    d.start()
    srv = cacheserver(data, "64MB", 0, "--manager", d.address).start()
    try:
        with ManagerClient(d.address) as mc:
            rows = wait_until(lambda: [s for s in mc.status().servers if s.alive], "the server in the ring")
            assert rows[0].used > 0 and rows[0].last_heartbeat_age < 30  # its registration, no heartbeat yet
            assert rows[0].items == 5
    finally:
        srv.kill()
        d.stop(grace=1.0)
