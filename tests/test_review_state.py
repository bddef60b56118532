"""A state directory the manager cannot use (damaged, or written by a newer version) stops a
real `cachemanager` with an error naming the file, never a traceback or a silent loss."""
import hashlib
import json
import os
import shutil

import pytest

from manager.manager_client import ManagerClient
from manager.model import ManagerConfig, canonical
from manager.state import StateError, StateStore
from procs import cachemanager, manager_once

DS = "ab" * 16


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory):
    """A state directory a real manager wrote: a snapshot (from a clean stop) holding a job,
    then a journal holding a second job (the manager was killed)."""
    root = str(tmp_path_factory.mktemp("state") / "mgr")
    m = cachemanager(root).start()
    try:
        with ManagerClient(m.address, timeout=5) as mc:
            mc.register_job("j1", DS, 10**6, 100, 1)
    finally:
        assert m.stop() == 0
    m = cachemanager(root).start()
    try:
        with ManagerClient(m.address, timeout=5) as mc:
            mc.register_job("j2", DS, 10**6, 100, 1)
    finally:
        m.kill()
    return root


def _rewrite_state(path: str, change) -> None:
    """Change a snapshot's state and give it a matching digest (what a newer manager writes)."""
    with open(path) as f:
        doc = json.load(f)
    change(doc["state"])
    doc["digest"] = hashlib.sha256(canonical(doc["state"])).hexdigest()
    with open(path, "w") as f:
        json.dump(doc, f)


def _truncate(path: str, n: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(n)


def _newer_job_field(state: dict) -> None:
    state["jobs"]["j1"]["quota"] = 5


def _newer_part(state: dict) -> None:
    state["quotas"] = {"tenant": 10**9}


SNAPSHOT_DAMAGE = {
    "empty": lambda p: _truncate(p, 0),
    "truncated": lambda p: _truncate(p, 200),
    "no state": lambda p: open(p, "w").write('{"seq": 3}'),
    "newer field": lambda p: _rewrite_state(p, _newer_job_field),
    "newer part": lambda p: _rewrite_state(p, _newer_part),  # was dropped silently
}


@pytest.fixture
def state(state_dir, tmp_path):
    """A copy of state_dir, for a test to damage."""
    copy = str(tmp_path / "s")
    shutil.copytree(state_dir, copy)
    return copy


@pytest.mark.parametrize("damage", sorted(SNAPSHOT_DAMAGE))
def test_an_unreadable_snapshot_stops_the_manager_naming_the_file(state, damage):
    snap = os.path.join(state, "snapshot.json")
    SNAPSHOT_DAMAGE[damage](snap)
    r = manager_once(state)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and f"cachemanager: error: {snap}: " in r.stderr, r.stderr[-2000:]


def test_a_journal_event_missing_its_fields_stops_the_manager_naming_the_file(state):
    journal = os.path.join(state, "journal.jsonl")
    with open(journal, "rb") as f:
        lines = f.read().splitlines(keepends=True)
    assert len(lines) == 1 and b'"job":"j2"' in lines[0]
    with open(journal, "wb") as f:  # a flipped byte that keeps the JSON valid: the key "job" is gone
        f.write(lines[0].replace(b'"job":"j2"', b'"jnb":"j2"'))
    r = manager_once(state)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and f"{journal}: event " in r.stderr, r.stderr[-2000:]


def test_the_undamaged_state_is_back(state):
    """The copies above were damaged, not the original: both jobs come back."""
    m = cachemanager(state).start()
    try:
        with ManagerClient(m.address, timeout=5) as mc:
            assert sorted(j["job"] for j in mc.status_dict()["jobs"]) == ["j1", "j2"]
    finally:
        assert m.stop() == 0


def test_a_failed_open_lets_go_of_the_state_dir(tmp_path):
    """A store that could not open closes its files and its lock: once the damage is repaired,
    the same process opens the directory (it used to say another cachemanager had it)."""
    StateStore(str(tmp_path), ManagerConfig(), fsync=False).open().close()
    snap = tmp_path / "snapshot.json"
    good = snap.read_bytes()
    snap.write_bytes(b"")
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(StateError, match="not a readable snapshot"):
        StateStore(str(tmp_path), ManagerConfig(), fsync=False).open()
    assert len(os.listdir("/proc/self/fd")) == fds
    snap.write_bytes(good)
    StateStore(str(tmp_path), ManagerConfig(), fsync=False).open().close()


def test_a_reload_that_fails_stops_the_store_and_never_snapshots_an_empty_state(tmp_path):
    """An event that fails half-way reloads the durable state; when that reload failed too
    (the journal damaged meanwhile), the store went on from an empty model at sequence 0:
    later events were journaled under numbers already used, and close() wrote the empty
    model over the snapshot. Now the store refuses every change, naming why, and keeps
    the files as they were."""
    store = StateStore(str(tmp_path), ManagerConfig(), fsync=False, snapshot_every=1000).open()
    store.submit({"type": "server_join", "server_id": "s1", "address": "h:1", "capacity": 100, "now": 1000.0})
    snap = (tmp_path / "snapshot.json").read_bytes()
    journal = tmp_path / "journal.jsonl"
    journal.write_bytes(journal.read_bytes().replace(b'"s1"', b'"s2"'))  # its CRC no longer matches
    with pytest.raises(StateError, match="journal"):
        store.submit({"type": "server_join", "now": 1001.0})  # fails in apply (no server_id): reloads
    with pytest.raises(StateError, match="reload of the durable state failed"):
        store.submit({"type": "server_join", "server_id": "s3", "address": "h:3", "capacity": 100, "now": 1002.0})
    store.close()
    assert (tmp_path / "snapshot.json").read_bytes() == snap
    assert b"s3" not in journal.read_bytes()
