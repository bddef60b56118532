"""Review of the manager's batch reports and size flags, with real cachemanager processes.

1. A batch report whose call failed after the manager may have applied it (a deadline, a reply
   lost, a kill -9 between the journal write and the reply) could not be sent again without
   being counted twice, so the client dropped it. Reports are numbered now (a random stream per
   client + a counter); the manager applies a number of a job's stream once (journaled: a
   restart keeps it), and the client sends a failed report again under its number.
2. `cachemanager --budget 10XB` said "invalid parse_size value: '10XB'", naming a function;
   both daemons now say what is wrong with the size, after the flag's name."""
from __future__ import annotations

import os
import time

import pytest

from cacheserver.sizes import size_flag
from manager.manager_client import ManagerClient, NumberedBatches, new_report_stream
from manager.model import ManagerModel, Rejected
from manager.state import StateStore
from procs import batches_counted, cachemanager, free_port, manager_once, sigstop, wait_until
from test_manager_state import CFG, random_events, run
from test_review_evictions import PausableProxy

DS = "c0ffee" * 8


def _batches(n: int) -> list[tuple[float, float, float]]:
    now = time.time()
    return [(now - (n - i) * 0.05, 0.05, 0.5) for i in range(n)]


# ---- 1. the manager applies a numbered report once ---------------------------------------
def test_a_numbered_report_sent_again_is_counted_once_also_after_a_kill_9(tmp_path):
    """The same number of one stream is applied once, before and after a kill -9 (the job's
    record keeps each stream's last number in the journal); another stream's numbers are its own."""
    port = free_port()
    m = cachemanager(str(tmp_path / "m"), port).start()
    try:
        with ManagerClient(m.address, timeout=5) as mc:
            mc.register_job("job", DS, 1000, 10)
            a, b = new_report_stream(), new_report_stream()
            first = NumberedBatches(a, 1, tuple(_batches(5)))
            assert [mc.report_batches("job", first).report_seq for _ in range(2)] == [1, 1]
            assert batches_counted(m.address, "job") == 5
            second = NumberedBatches(a, 2, tuple(_batches(3)))
            mc.report_batches("job", second)
            m.kill()  # SIGKILL: the reports were journaled (not fsynced: the page cache keeps them)
            m = cachemanager(str(tmp_path / "m"), port).start()
            assert mc.report_batches("job", second).report_seq == 2  # its reply "lost": sent again
            assert mc.report_batches("job", first).report_seq == 2   # an older one is not applied either
            assert batches_counted(m.address, "job") == 8
            assert mc.report_batches("job", NumberedBatches(b, 1, tuple(_batches(4)))).report_seq == 1
            assert mc.report_batches("job", _batches(2)).report_seq == 0  # unnumbered: applied every time
            assert batches_counted(m.address, "job") == 14
    finally:
        m.kill()


def test_journals_without_report_numbers_replay_to_the_state_they_had(tmp_path):
    """Events of a journal from before numbering leave no trace of it in the state (its digest
    is that of the state they built then); numbered ones replay to the state they built."""
    store = StateStore(str(tmp_path / "old"), CFG, snapshot_every=7, fsync=False).open()
    assert run(store, random_events(1, model=store.model)) > 100
    assert store.model.jobs and all(set(j) == {"job", "dataset", "n_gpus", "registered_at", "batches",
                                               "token_hash"} for j in store.model.to_dict()["jobs"].values())
    store.close()

    store = StateStore(str(tmp_path / "new"), CFG, snapshot_every=3, fsync=False).open()
    store.submit({"type": "job_register", "job": "j", "dataset": "d", "dataset_bytes": 10, "n_items": 1,
                  "n_gpus": 1, "now": 1000.0})
    for seq in (1, 2, 2, 1, 3):  # as the service journals them, repeats included
        store.submit({"type": "batches", "job": "j", "batches": [[1000.0, 0.5, 1.0]], "now": 1001.0,
                      "stream": "00000000000000ab", "seq": seq})
    assert store.model.jobs["j"].batches == 3 and store.model.jobs["j"].applied("00000000000000ab") == 3
    live = store.model.to_dict()
    for fd in (store._journal_fd, store._lock_fd):  # as kill -9: no final snapshot, no close
        os.close(fd)
    again = StateStore(str(tmp_path / "new"), CFG, fsync=False).open()
    assert again.model.to_dict() == live and again.model.digest() == ManagerModel.from_dict(live).digest()
    again.close()


def test_a_jobs_record_keeps_the_streams_heard_from_last(monkeypatch):
    """Bounded per job: beyond MAX_REPORT_STREAMS the stream heard from least recently goes,
    the same one in a replay from a snapshot (whose JSON sorts the streams by name)."""
    from manager import modelrecords
    monkeypatch.setattr(modelrecords, "MAX_REPORT_STREAMS", 2)
    m = ManagerModel(config=CFG)
    m.apply({"type": "job_register", "job": "j", "dataset": "d", "dataset_bytes": 10, "n_items": 1,
             "n_gpus": 1, "now": 1.0})
    streams = ["f" * 16, "0" * 15 + "1", "a" * 16]
    for t, s in enumerate(streams):
        m.apply({"type": "batches", "job": "j", "batches": [[1.0, 0.5, None]], "now": 10.0 + t, "stream": s,
                 "seq": 1})
        m = ManagerModel.from_dict(m.to_dict())  # as a restart from a snapshot
    assert sorted(m.jobs["j"].reports) == sorted(streams[1:])


@pytest.mark.parametrize("number, says", [
    ({"stream": "AB" * 8, "seq": 1}, "16 lower-case hex digits"),
    ({"stream": "ab" * 8, "seq": 0}, "seq must be a whole number >= 1"),
    ({"stream": "ab" * 8, "seq": 1.5}, "seq must be a whole number >= 1"),
    ({"seq": 4}, "16 lower-case hex digits"),
])
def test_a_malformed_report_number_is_refused_before_anything_changes(number, says):
    m = ManagerModel(config=CFG)
    m.apply({"type": "job_register", "job": "j", "dataset": "d", "dataset_bytes": 10, "n_items": 1,
             "n_gpus": 1, "now": 1.0})
    before = m.digest()
    with pytest.raises(Rejected, match=says):
        m.apply({"type": "batches", "job": "j", "batches": [[1.0, 0.5, None]], "now": 2.0, **number})
    assert m.digest() == before


# ---- 1. the client sends a failed report again ------------------------------------------
class ReplyHoldingProxy(PausableProxy):
    """PausableProxy with the other direction held: calls reach the manager, which applies
    them, while its replies wait (a lost reply, as the client sees it)."""

    def _pump(self, src, dst, gated: bool) -> None:
        super()._pump(src, dst, not gated)


def _watch(coord) -> list:
    """(report number, "ok" or the failure's code name) of each of the coordinator's batch
    reports, as they happen (the real call runs: this only watches it)."""
    calls, real = [], coord.client.report_batches

    def watched(job, batches):
        seq = getattr(batches, "seq", None)
        try:
            reply = real(job, batches)
        except Exception as e:
            calls.append((seq, getattr(getattr(e, "code", None), "name", repr(e))))
            raise
        calls.append((seq, "ok"))
        return reply
    coord.client.report_batches = watched
    return calls


@pytest.fixture
def dataset(tmp_path, monkeypatch):
    """make(manager address) -> a dataset registered as job "lost" (no cache server), its
    coordinator reporting every 0.2 s once started; closed at the end."""
    pytest.importorskip("torch")
    from clients.dataset import CachedDataset
    from clients.jobtokenfile import DIR_ENV
    from test_dataset import make_dataset
    monkeypatch.setenv(DIR_ENV, str(tmp_path / "tokens"))
    path, _ = make_dataset(tmp_path / "ds", n=20, seed=5)
    made = []

    def make(address: str):
        ds = CachedDataset(path, cache=False, manager=address, job="lost")
        made.append(ds)
        ds.coordinator.report_seconds = ds.coordinator.quiet_report_seconds = 0.2
        return ds
    yield make
    for ds in made:
        ds.close()


def _queue(coord, n: int) -> None:
    for end, duration, _ in _batches(n):
        coord.batch_time(end, duration)


def test_a_report_whose_reply_was_lost_is_sent_again_and_counted_once(tmp_path, dataset):
    """The manager applies the report; its reply never arrives (the call's deadline passes).
    Before, the client dropped it (it could not know); now it sends it again under its number
    once replies flow, and the manager counts it once."""
    m = cachemanager(str(tmp_path / "m")).start()
    proxy = ReplyHoldingProxy(m.address)
    try:
        coord = dataset(proxy.address).coordinator
        _queue(coord, 10)
        coord.start()
        wait_until(lambda: batches_counted(m.address, "lost") == 10, "the first report counted", 10)
        calls = _watch(coord)
        proxy.open.clear()  # replies held from here
        _queue(coord, 20)  # (the thread may report a part of them first: the rest waits behind it)
        wait_until(lambda: batches_counted(m.address, "lost") > 10, "the second report applied", 10)
        wait_until(lambda: any(c == "DEADLINE_EXCEEDED" for _, c in calls), "its call failed by its deadline", 10)
        lost = next(seq for seq, c in calls if c == "DEADLINE_EXCEEDED")
        proxy.open.set()
        wait_until(lambda: (lost, "ok") in calls, "the report sent again, under its number", 15)
        assert lost is not None
        wait_until(lambda: batches_counted(m.address, "lost") >= 30, "every batch counted", 10)
        time.sleep(1.0)  # five more report periods: nothing counted twice, nothing left over
        assert batches_counted(m.address, "lost") == 30 and not coord.reports.queued
    finally:
        proxy.close()
        m.kill()


def test_a_report_cut_off_by_its_deadline_before_the_manager_applied_it_is_counted(tmp_path, dataset):
    """The manager, stopped, never applied the report the client gave up on (DEADLINE_EXCEEDED),
    and dies: restarted on its state, it counts the report sent again. Before, it was dropped."""
    port = free_port()
    m = cachemanager(str(tmp_path / "m"), port).start()
    try:
        coord = dataset(m.address).coordinator
        _queue(coord, 10)
        coord.start()
        wait_until(lambda: batches_counted(m.address, "lost") == 10, "the first report counted", 10)
        calls = _watch(coord)
        sigstop(m.pid)
        _queue(coord, 15)
        wait_until(lambda: any(c == "DEADLINE_EXCEEDED" for _, c in calls), "a report given up on", 10)
        m.kill()  # never resumed: the report was not applied
        m = cachemanager(str(tmp_path / "m"), port).start()
        wait_until(lambda: batches_counted(m.address, "lost") == 25, "the report counted after the restart", 15)
        time.sleep(1.0)
        assert batches_counted(m.address, "lost") == 25
    finally:
        m.kill()


# ---- 2. size flags -------------------------------------------------------------------------
@pytest.mark.parametrize("flag, value", [("--budget", "10XB"), ("--chunk-size", "-5")])
def test_cachemanager_names_the_flag_and_what_is_wrong_with_the_size(tmp_path, flag, value):
    r = manager_once(str(tmp_path / "st"), flag, value)
    assert r.returncode == 2 and not r.stdout.startswith("READY"), r.stdout
    assert f"argument {flag}: not a size: '{value}' (expected e.g. 200GB" in r.stderr, r.stderr
    assert "parse_size" not in r.stderr, r.stderr


def test_both_daemons_take_sizes_through_one_flag_type(capsys):
    from cacheserver import serverd
    from manager import managerd
    sized = {a.option_strings[-1] for mod in (serverd, managerd) for a in mod.build_parser()._actions
             if a.type is size_flag}
    assert {"--capacity", "--max-item-size", "--budget", "--chunk-size"} <= sized
    with pytest.raises(SystemExit):
        serverd.build_parser().parse_args(["--listen", "x:1", "--data-dir", "d", "--capacity", "1.5.GB"])
    assert "argument --capacity: not a size: '1.5.GB'" in capsys.readouterr().err
    assert size_flag("1.5GiB") == 3 << 29
