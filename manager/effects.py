"""What the manager's state machine asks the outside world to do.

``ManagerModel.apply`` returns these; it never performs I/O itself, so replaying
the journal can rebuild the state without repeating side effects (the actuator
reconciles the servers with the replayed state instead, see actuator.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union


@dataclass(frozen=True)
class SetMode:
    """SetJobMode on every server (bypass while the job is probed)."""
    job: str
    mode: str            # "normal" | "bypass"
    reason: str


@dataclass(frozen=True)
class ActivateChunk:
    """ActiveChunk on every server: the chunk new jobs read."""
    dataset: str
    chunk: int


@dataclass(frozen=True)
class EvictChunk:
    """EvictChunk(force=True) on every server. ``forced`` records whether the
    policy cut off a straggler (the servers are always told to force: the
    manager is the authority on who still reads the chunk)."""
    dataset: str
    chunk: int
    forced: bool
    reason: str


@dataclass(frozen=True)
class EvictDataset:
    dataset: str
    reason: str


@dataclass(frozen=True)
class RingChanged:
    version: int
    addresses: tuple[str, ...]


@dataclass(frozen=True)
class ServerForgotten:
    """A server out of the ring for the retention period left the registry: the actuator
    drops the address from those owed EvictDatasets, keeping only ``known`` (every address
    the registry still holds)."""
    server_id: str
    address: str
    known: tuple[str, ...]


@dataclass(frozen=True)
class Note:
    """Something to log: a decision, an assignment, a chunk starting to load."""
    message: str
    fields: tuple[tuple[str, object], ...] = ()


Effect = Union[SetMode, ActivateChunk, EvictChunk, EvictDataset, RingChanged, ServerForgotten, Note]


def note(message: str, **fields: object) -> Note:
    return Note(message, tuple(sorted(fields.items())))


# Effects that call the cache servers (the rest are only logged / counted).
SERVER_EFFECTS = (SetMode, ActivateChunk, EvictChunk, EvictDataset)
