"""A journal write that fails is answered UNAVAILABLE ("nothing was decided", docs/manager.md,
*Durability*): the event must then be gone from memory and from the disk. Before, a line
written whole whose fsync failed (EIO, a delayed ENOSPC), or a short write that lost only
the newline, stayed in journal.jsonl, and the reload that follows the failure replayed it:
the job was registered although its caller was told it was not, its effects (a re-plan's
EvictDatasets) were never handed to the actuator, and the caller's retry applied it again."""
from __future__ import annotations

import errno
import os

import pytest

from manager.model import ManagerConfig
from manager.state import StateStore

DS = "ab" * 16


def register(store: StateStore, job: str, now: float) -> list:
    return store.submit({"type": "job_register", "job": job, "dataset": DS, "dataset_bytes": 10**6,
                         "n_items": 100, "n_gpus": 1, "token_hash": "", "now": now})


def open_store(path, effects: list) -> StateStore:
    return StateStore(str(path), ManagerConfig(budget=10**7), fsync=True, on_effects=effects.extend).open()


def reopened_jobs(path) -> set[str]:
    """The jobs a manager restarted on ``path`` (after kill -9) finds."""
    again = StateStore(str(path), ManagerConfig(budget=10**7), fsync=False).open()
    try:
        return set(again.model.jobs)
    finally:
        again.close(snapshot=False)


def failing_fsync_of(store: StateStore, monkeypatch) -> list:
    """os.fsync of the store's journal fails with EIO (once); other fsyncs go through."""
    real, calls = os.fsync, []

    def fsync(fd: int) -> None:
        if fd == store._journal_fd and not calls:
            calls.append(fd)
            raise OSError(errno.EIO, "Input/output error")
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return calls


def test_an_event_whose_fsync_failed_is_not_applied_nor_replayed(tmp_path, monkeypatch):
    effects: list = []
    store = open_store(tmp_path, effects)
    register(store, "j1", 1000.0)
    seq, digest, n_effects = store.seq, store.model.digest(), len(effects)
    calls = failing_fsync_of(store, monkeypatch)
    with pytest.raises(OSError):
        register(store, "j2", 1001.0)
    assert calls, "the journal's fsync was not reached"
    assert "j2" not in store.model.jobs and store.seq == seq and store.model.digest() == digest
    assert len(effects) == n_effects  # none of a refused event's effects
    register(store, "j2", 1002.0)      # the caller's retry: applied once, at its own time
    assert store.model.jobs["j2"].registered_at == 1002.0 and store.seq == seq + 1
    os.close(store._lock_fd)           # kill -9
    os.close(store._journal_fd)
    assert reopened_jobs(tmp_path) == {"j1", "j2"}


def test_a_short_write_that_lost_only_the_newline_is_not_applied(tmp_path, monkeypatch):
    effects: list = []
    store = open_store(tmp_path, effects)
    register(store, "j1", 1000.0)
    seq = store.seq
    real = os.write

    def short(fd: int, data: bytes) -> int:
        if fd == store._journal_fd:
            return real(fd, data[:-1])  # a complete record, less its newline
        return real(fd, data)

    monkeypatch.setattr(os, "write", short)
    with pytest.raises(OSError, match="short journal write"):
        register(store, "j2", 1001.0)
    monkeypatch.undo()
    assert "j2" not in store.model.jobs and store.seq == seq
    register(store, "j3", 1002.0)      # the journal goes on, one record per line
    assert store.seq == seq + 1
    store.close(snapshot=False)
    assert reopened_jobs(tmp_path) == {"j1", "j3"}


def test_a_journal_that_cannot_be_cut_back_takes_no_further_change(tmp_path, monkeypatch):
    """Where the failed record cannot be cut off either, the disk may hold it or not: the
    store takes no change (as after a failed reload) instead of answering from a state it
    cannot know is the durable one; a restart reads what the disk holds."""
    effects: list = []
    store = open_store(tmp_path, effects)
    register(store, "j1", 1000.0)
    failing_fsync_of(store, monkeypatch)

    def no_truncate(fd: int, length: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "ftruncate", no_truncate)
    with pytest.raises(OSError):
        register(store, "j2", 1001.0)
    monkeypatch.undo()
    with pytest.raises(Exception, match="takes no change"):
        register(store, "j3", 1002.0)
    store.close()
    assert reopened_jobs(tmp_path) == {"j1", "j2"}  # the line reached the file: a restart has it
