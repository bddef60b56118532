"""The manager state's plain parts: its configuration, the records of jobs and datasets,
the refusal every event handler raises, and the canonical JSON a state's digest is taken
of. model.py re-exports them: they are importable from there as before."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from typing import Any, Mapping

from .policy import AllocConfig, BufferConfig, ProbeConfig
from .policy.admission import AdmissionConfig

MAX_DECISIONS = 50  # decision history kept for `cachectl status`
# gRPC metadata of a job's plan calls: the version of the plan it holds. A manager whose state
# went back below it (restored from an older backup) lifts the dataset's version above it.
PLAN_VERSION_HEADER = "x-mlcache-plan-version"
MAX_PLAN_VERSION = 2 ** 62  # above any version handed out (ms since 1970, plus changes): refused


@lru_cache(maxsize=8)
def _config_dict(cfg: "ManagerConfig") -> dict[str, Any]:
    return cfg._dict()


class Rejected(Exception):
    """A request the state machine refuses; ``code`` names a gRPC status."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class ManagerConfig:
    budget: int | None = None          # bytes; None: the alive servers' total capacity
    dataset_grace_s: float = 300.0     # a dataset keeps its space this long after its last job left
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    alloc: AllocConfig = field(default_factory=AllocConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)

    def to_dict(self) -> dict[str, Any]:
        # Built once (frozen, flat fields) and copied out: the state's fingerprint,
        # taken twice per decision round, spent most of its time in asdict() here.
        return {k: dict(v) if isinstance(v, dict) else v for k, v in _config_dict(self).items()}

    def _dict(self) -> dict[str, Any]:
        alloc = asdict(self.alloc)
        if alloc["chunked"]:  # left out at its default: the state stays readable where the flag is unknown
            del alloc["chunked"]
        if alloc["mechanism"] == "shares":
            del alloc["mechanism"]
        return {"budget": self.budget, "dataset_grace_s": self.dataset_grace_s,
                "probe": asdict(self.probe), "alloc": alloc, "buffer": asdict(self.buffer),
                "admission": asdict(self.admission)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ManagerConfig":
        return cls(None if d.get("budget") is None else int(d["budget"]),
                   float(d.get("dataset_grace_s", 300.0)),
                   ProbeConfig(**d.get("probe", {})), AllocConfig(**d.get("alloc", {})),
                   BufferConfig(**d.get("buffer", {})), AdmissionConfig(**d.get("admission", {})))


MAX_REPORT_STREAMS = 1024  # report streams a job's record remembers (its processes, a DDP job's ranks)


@dataclass
class JobRecord:
    job: str
    dataset: str
    n_gpus: int
    registered_at: float
    batches: int = 0
    token_hash: str = ""  # SHA-256 of the job's token (jobtokens.py); "": from a state before tokens
    # Report stream (16 hex digits) -> [the last report number applied, when]: a batch report
    # sent again under its number (its reply was lost) is not counted twice. Left out of the
    # state while empty: states and journals from before numbering read (and digest) as before.
    reports: dict[str, list] = field(default_factory=dict)

    def applied(self, stream: str) -> int:
        """The highest report number of ``stream`` applied (0: none)."""
        got = self.reports.get(stream)
        return int(got[0]) if got else 0

    def note_report(self, stream: str, seq: int, now: float) -> None:
        """Report ``seq`` of ``stream`` applied. Beyond MAX_REPORT_STREAMS the stream heard
        from least recently goes (ties by name: the same in a replay, whatever the dict order)."""
        self.reports[stream] = [seq, now]
        if len(self.reports) > MAX_REPORT_STREAMS:
            del self.reports[min(self.reports, key=lambda s: (self.reports[s][1], s))]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if not d["reports"]:
            del d["reports"]
        return d


def report_number(ev: Mapping[str, Any]) -> tuple[str, int] | None:
    """A batches event's (stream, seq); None for an unnumbered one. Rejected for a malformed
    number: a journal line that parses is damage, not a report to count."""
    if "stream" not in ev and "seq" not in ev:
        return None
    stream, seq = ev.get("stream"), ev.get("seq")
    if not (isinstance(stream, str) and len(stream) == 16 and set(stream) <= set("0123456789abcdef")):
        raise Rejected("INVALID_ARGUMENT", f"report stream must be 16 lower-case hex digits, got {stream!r}")
    if type(seq) is not int or seq < 1:
        raise Rejected("INVALID_ARGUMENT", f"report seq must be a whole number >= 1, got {seq!r}")
    return stream, seq


@dataclass
class DatasetRecord:
    name: str
    bytes: int
    n_items: int
    idle_since: float | None = None   # when its last job left
    plan_base: int = 0                # plan versions stay monotonic across buffer rebuilds


def canonical(d: Any) -> bytes:
    return json.dumps(d, sort_keys=True, separators=(",", ":")).encode()
