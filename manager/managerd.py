"""`cachemanager`: the cache manager daemon (docs/manager.md).

Cache servers register and heartbeat; cache clients register jobs, report
mini-batch times and follow the chunk plan. State is journaled under
--state-dir and survives kill -9. Runs in the foreground; prints
`READY host:port` once serving; SIGTERM or SIGINT drain and exit 0.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import math
import signal
import sys
import time
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cacheserver import logs
from cacheserver.counters import Counters
from cacheserver.healthsvc import HealthServicer
from cacheserver.logs import event
from cacheserver.proto import manager_pb2_grpc as mpb_grpc
from cacheserver.runtime import bind_grpc, join_hostport, release_grpc, run_until_signal
from cacheserver.sizes import size_flag
from cacheserver.roles import Roles, read_token
from cacheserver.tls import TlsFiles, add_tls_flags, tls_from_args

from .actuator import Actuator, desired_from
from .decisions import DecisionLoop, steady_wall_clock
from .evictledger import StoreLedger
from .membership import Liveness
from .metrics import MANAGER_COUNTERS, gather, serve_metrics
from .model import ManagerConfig
from .policy import AllocConfig, BufferConfig, ProbeConfig
from .policy.admission import AdmissionConfig
from .policy.autoscale import AutoscaleConfig
from .policy.double_buffer import ConfigFieldError
from .policy.placement import PlacementConfig
from .service import ManagerService
from .state import StateError, StateStore
from .workers import WorkerScaling

log = logging.getLogger("manager")
SERVICE_NAME = "mlcache.v1.Manager"


@dataclass
class DaemonConfig:
    listen: str
    state_dir: str
    model: ManagerConfig = field(default_factory=ManagerConfig)
    metrics_port: int | None = None
    tls: TlsFiles | None = None
    heartbeat_s: float = 5.0
    heartbeat_misses: int = 3
    decision_s: float = 5.0
    reconcile_s: float = 5.0
    job_timeout_s: float = 900.0
    server_timeout_s: float = 2.0
    forget_servers_after_s: float = 86400.0  # a server out of the ring this long is forgotten
    snapshot_every: int = 1000
    fsync: bool = True
    cluster_token_file: str | None = None  # sent to the servers: the manager's role (cacheserver/roles.py)
    scaling: WorkerScaling = field(default_factory=WorkerScaling)  # --ray, remote workers' policies


class ManagerDaemon:
    def __init__(self, cfg: DaemonConfig) -> None:
        self.cfg = cfg
        self.counters = Counters(MANAGER_COUNTERS)
        self.clock = steady_wall_clock(time.time, time.monotonic)
        token = read_token(cfg.cluster_token_file) if cfg.cluster_token_file else None
        if token is None and cfg.tls is None:
            log.warning("no --cluster-token-file: every caller has the manager's role and sees every "
                        "tenant's jobs in Status (docs/security.md)")
        self.actuator = Actuator(lambda: self.store.read(desired_from),
                                 lambda: self.store.read(lambda m: m.registry.addresses()),
                                 tls=cfg.tls, timeout=cfg.server_timeout_s, counters=self.counters,
                                 token=token)
        self.store = StateStore(cfg.state_dir, cfg.model, snapshot_every=cfg.snapshot_every, fsync=cfg.fsync,
                                clock=self.clock, on_effects=self.actuator.submit)
        # EvictDatasets servers missed before a restart, and the servers the state knows: before
        # a re-plan by changed flags (a configure event as the state opens) is carried out
        self.store.open(on_loaded=lambda: self.actuator.restore(StoreLedger(self.store)))
        self.liveness = Liveness(self.clock(), mono=time.monotonic)
        self._grpc_pool = futures.ThreadPoolExecutor(32, thread_name_prefix="grpc")
        self.grpc = grpc.server(self._grpc_pool,
                                options=[("grpc.so_reuseport", 0)])
        self.service = ManagerService(self.store, self.liveness, heartbeat_s=cfg.heartbeat_s,
                                      decision_s=cfg.decision_s, counters=self.counters, scaling=cfg.scaling,
                                      roles=Roles(token, tls=cfg.tls is not None), job_timeout_s=cfg.job_timeout_s,
                                      server_timeout_s=cfg.heartbeat_s * cfg.heartbeat_misses,
                                      on_server_start=self.actuator.reconcile,
                                      on_unknown_with_entries=self.actuator.owe_chunked)
        mpb_grpc.add_ManagerServicer_to_server(self.service, self.grpc)
        self.health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        self.metrics_server = None
        try:
            self.host, self.port = bind_grpc(self.grpc, cfg.listen, cfg.tls)
            self._bind_metrics(cfg.metrics_port)  # a port in use fails here, before anything is served
        except (OSError, ValueError):
            release_grpc(self.grpc, self._grpc_pool)
            self.store.close(snapshot=False)
            raise
        self.loop = DecisionLoop(self.store, self.liveness, self.actuator, interval=cfg.decision_s,
                                 heartbeat_s=cfg.heartbeat_s, misses=cfg.heartbeat_misses,
                                 job_timeout_s=cfg.job_timeout_s, reconcile_s=cfg.reconcile_s,
                                 forget_after_s=cfg.forget_servers_after_s, clock=self.clock)

    def _bind_metrics(self, port: int | None) -> None:
        if port is None:
            return
        try:
            self.metrics_server = serve_metrics(port, self.host, lambda: gather(self.store, self.counters))
        except (OSError, OverflowError) as e:
            raise OSError(f"--metrics-port: cannot serve metrics on {join_hostport(self.host, port)}: {e}") from e

    @property
    def address(self) -> str:
        return join_hostport(self.host, self.port)

    @property
    def metrics_address(self) -> str | None:
        """HOST:PORT of the metrics endpoint: the bound port, which --metrics-port 0 leaves to the OS."""
        if self.metrics_server is None:
            return None
        return join_hostport(self.host, self.metrics_server[0].server_address[1])

    def start(self) -> None:
        self.grpc.start()
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self.loop.start()
        self.actuator.reconcile()  # after a restart: make the servers match the replayed state
        m = self.store.model
        event(log, "cachemanager started", listen=self.address, state_dir=self.cfg.state_dir,
              journal_seq=self.store.seq, replayed=self.store.replayed, servers=len(m.registry.servers),
              ring_version=m.registry.version, jobs=len(m.jobs), datasets=len(m.datasets),
              budget=m.budget(), tls=self.cfg.tls is not None, ray=self.cfg.scaling.ray_address or None,
              metrics=self.metrics_address)

    def stop(self, grace: float = 5.0) -> None:
        """Drain: refuse new calls, finish those in flight, push queued server calls, snapshot."""
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.grpc.stop(grace).wait(grace)
        self._grpc_pool.shutdown(wait=False)  # grpc leaves its executor's threads running
        self.loop.stop()
        self.actuator.drain(grace)
        self.actuator.stop()
        if self.metrics_server is not None:
            self.metrics_server[0].shutdown()
            self.metrics_server[0].server_close()  # its port, now: not when collected
        self.store.close(snapshot=True)
        event(log, "cachemanager stopped", journal_seq=self.store.seq, counters=self.counters.snapshot())


def build_parser() -> argparse.ArgumentParser:
    # Each default is stated once, by hand as "(default: %(default)s)" (true to the code) or as
    # what an absent flag means; ArgumentDefaultsHelpFormatter appended a second "(default: None)".
    p = argparse.ArgumentParser(prog="cachemanager", description=__doc__)
    p.add_argument("--listen", required=True, help="gRPC address HOST:PORT (port 0 picks a free one)")
    p.add_argument("--state-dir", required=True, help="directory for the journal and snapshots")
    p.add_argument("--budget", type=size_flag, default=None,
                   help="cache bytes to allocate (default: total capacity of the servers in the ring)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics on this port (0: a free one, logged at start) (default: off)")
    add_tls_flags(p, serves=True, peers="servers and clients", cert_note=", also towards servers")
    p.add_argument("--cluster-token-file", default=None, metavar="FILE",
                   help="the servers' --cluster-token-file: sent with mode changes and evictions; callers "
                        "that send it see every job in Status and may report chunk loads without a job")
    p.add_argument("--heartbeat-seconds", type=float, default=5.0,
                   help="heartbeat interval told to servers (default: %(default)s)")
    p.add_argument("--heartbeat-misses", type=int, default=3,
                   help="a server missing this many heartbeats leaves the ring (below 1: 1) (default: %(default)s)")
    p.add_argument("--forget-servers-after", type=float, default=86400.0, metavar="SECONDS",
                   help="a server out of the ring this long is forgotten: its record (cachectl status) and the "
                        "evictions owed to it go; back later, it joins as a new server (docs/manager.md) "
                        "(default: %(default)s)")
    p.add_argument("--decision-seconds", type=float, default=5.0,
                   help="period of the decision loop (time-outs, allocation) (default: %(default)s)")
    p.add_argument("--reconcile-seconds", type=float, default=5.0,
                   help="period of reconciling every server with the state (a safety net for missed calls; "
                        "a joining server is reconciled at once) (default: %(default)s)")
    _add_policy_flags(p)
    p.add_argument("--snapshot-every", type=int, default=1000,
                   help="journal events between snapshots (default: %(default)s)")
    p.add_argument("--no-fsync", action="store_true", help="do not fsync the journal (tests only)")
    p.add_argument("--server-timeout", type=float, default=2.0,
                   help="seconds per call to a cache server (default: %(default)s)")
    logs.add_flags(p)
    p.add_argument("--drain-seconds", type=float, default=5.0,
                   help="grace for calls in flight at SIGTERM (default: %(default)s)")
    return p


def _add_policy_flags(p: argparse.ArgumentParser) -> None:
    """The allocation and double-buffering flags of build_parser."""
    p.add_argument("--chunk-size", type=size_flag, default="15GB",  # a string: argparse parses it, help shows it
                   help="largest chunk (a chunk is min(this, 10%% of the dataset)) (default: %(default)s)")
    p.add_argument("--chunks", action="store_true",
                   help="allocate by the FULL / CHUNKED (double buffering) / NONE knapsack; without it: "
                        "benefit-sized shares with one shared LRU (docs/manager-policy.md)")
    p.add_argument("--bypass-probes", action="store_true",
                   help="measure each job's benefit by Quiver's probes (batches in bypass, then normal); without "
                        "it: by regressing reported batch times on their miss fraction, with a bypass probe only "
                        "for a job whose regression stays unsure")
    p.add_argument("--no-chunks", action="store_true",
                   help="implies --chunks, without double-buffered chunks: a dataset that does not fit in full "
                        "shares the room full datasets leave, as spare entries (LRU with substitutable hits)")
    p.add_argument("--job-timeout-seconds", type=float, default=900.0,
                   help="a job not heard from for this long is unregistered (default: %(default)s)")
    p.add_argument("--dataset-grace-seconds", type=float, default=300.0,
                   help="a dataset keeps its space this long after its last job left (default: %(default)s)")
    p.add_argument("--straggler-seconds", type=float, default=600.0,
                   help="forced-eviction timeout of a marked chunk before pass times are known "
                        "(default: %(default)s)")
    p.add_argument("--straggler-min-seconds", type=float, default=60.0,
                   help="lower clamp of the adaptive straggler timeout (1.5 x median pass time) "
                        "(default: %(default)s)")
    p.add_argument("--max-marked-seconds", type=float, default=None,
                   help="evict a marked chunk after this long regardless (default: off)")
    p.add_argument("--policy-config", default=None, metavar="FILE",
                   help='JSON overrides: {"probe": {...}, "alloc": {...}, "buffer": {...}, "admission": {...}, '
                        '"autoscale": {...}, "placement": {...}, "dataset_grace_s": S} (docs/manager-policy.md)')
    p.add_argument("--ray", default=None, metavar="ray://HOST:PORT",
                   help="the Ray cluster for remote preprocessing workers (its head's client server): jobs with "
                        "remote='auto' get it, and their worker counts are decided here (docs/preprocess.md)")


def config_from_args(args: argparse.Namespace) -> DaemonConfig:
    over = _policy_config(args.policy_config) if args.policy_config else {}
    _check_flags(args)
    grace = float(over.get("dataset_grace_s", args.dataset_grace_seconds))
    if not grace >= 0:  # negative: an idle dataset is evicted at once, its grace period skipped
        raise ValueError(f'--policy-config "dataset_grace_s" must be >= 0 seconds, got {grace}')
    model = ManagerConfig(
        budget=args.budget, dataset_grace_s=grace,
        probe=ProbeConfig(**{"passive": not args.bypass_probes, **over.get("probe", {})}),
        alloc=AllocConfig(**{"chunk_bytes": args.chunk_size, "chunked": not args.no_chunks,
                             **({"mechanism": "chunks"} if args.chunks or args.no_chunks else {}), **over.get("alloc", {})}),
        buffer=_buffer_config(args, over.get("buffer", {})),
        admission=AdmissionConfig(**over.get("admission", {})))
    return DaemonConfig(
        listen=args.listen, state_dir=args.state_dir, model=model, metrics_port=args.metrics_port,
        tls=tls_from_args(args),
        heartbeat_s=args.heartbeat_seconds, heartbeat_misses=max(1, args.heartbeat_misses),
        decision_s=args.decision_seconds, reconcile_s=args.reconcile_seconds, job_timeout_s=args.job_timeout_seconds,
        server_timeout_s=args.server_timeout, forget_servers_after_s=args.forget_servers_after,
        snapshot_every=args.snapshot_every, fsync=not args.no_fsync,
        cluster_token_file=args.cluster_token_file,
        scaling=_scaling(args.ray, over))


# Flags that must be > 0 or >= 0; NaN and infinities are refused for every float flag.
_POSITIVE = ("heartbeat_seconds", "decision_seconds", "job_timeout_seconds", "server_timeout",
             "forget_servers_after", "chunk_size", "snapshot_every")
_NOT_NEGATIVE = ("reconcile_seconds", "dataset_grace_seconds", "drain_seconds")


def _check_flags(args: argparse.Namespace) -> None:
    """ValueError naming a flag out of range: a --job-timeout-seconds of 0 dropped every job
    at each decision round, a --server-timeout of 0 failed every call to the servers."""
    for name, value in vars(args).items():  # NaN passes every comparison: a decision loop with no pause
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"--{name.replace('_', '-')} must be a finite number, got {value}")
    for name in _POSITIVE:
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    for name in _NOT_NEGATIVE:
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        raise ValueError(f"--metrics-port must be a port, 0-65535 (0: a free one), got {args.metrics_port}")


def _no_constant(name: str) -> float:
    raise ValueError(f"--policy-config: {name} is not a number a policy can use")


def _policy_config(path: str) -> dict:
    """The --policy-config file's sections. NaN and Infinity (which Python's json reads) are
    refused: NaN fails every comparison, so a NaN grace period never forgot a dataset."""
    with open(path) as f:
        over = json.load(f, parse_constant=_no_constant)
    if not isinstance(over, dict):
        raise ValueError(f"--policy-config: expected an object of sections, got {type(over).__name__}")
    unknown = set(over) - {"probe", "alloc", "buffer", "admission", "dataset_grace_s", "autoscale", "placement"}
    if unknown:
        raise ValueError(f"--policy-config: unknown sections {sorted(unknown)}")
    return over


# BufferConfig fields set by flags (the "buffer" section of --policy-config overrides them)
_BUFFER_FLAGS = {"straggler_timeout_s": ("--straggler-seconds", "straggler_seconds"),
                 "min_straggler_s": ("--straggler-min-seconds", "straggler_min_seconds"),
                 "max_marked_s": ("--max-marked-seconds", "max_marked_seconds")}


def _buffer_config(args: argparse.Namespace, given: dict) -> BufferConfig:
    """The double buffer's configuration from the flags and --policy-config; a value out
    of range is refused naming where it came from, the field and its range."""
    if not isinstance(given, dict):
        raise ValueError(f'--policy-config "buffer" must be an object, got {given!r}')
    flags = {k: getattr(args, attr) for k, (_, attr) in _BUFFER_FLAGS.items()}
    try:
        return BufferConfig(**{**flags, **given}).check()
    except ConfigFieldError as e:
        by_flag = e.field in flags and not any(f in given for f in e.fields)
        src = _BUFFER_FLAGS[e.field][0] if by_flag else '--policy-config "buffer"'
        raise ValueError(f"{src}: {e}") from None
    except TypeError as e:  # a field BufferConfig does not have
        raise ValueError(f'--policy-config "buffer": {e}') from None


def _scaling(ray: str | None, over: dict) -> WorkerScaling:
    try:
        return WorkerScaling(ray, AutoscaleConfig(**over.get("autoscale", {})),
                             PlacementConfig(**over.get("placement", {})))
    except ValueError as e:
        raise ValueError(f"--ray {ray!r}: {e}" if ray and "Ray address" in str(e) else str(e)) from None
    except TypeError as e:  # a key the configuration does not have
        hint = " (linear_slack was replaced by linear_share)" if "linear_slack" in str(e) else ""
        raise ValueError(f"--policy-config \"autoscale\"/\"placement\": {e}{hint}") from None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logs.setup(args.log_level, args.log_format)
    # `kill -USR1 PID`: every thread's stack to stderr (the log), the process running on: where
    # a stalled actuator or RPC waits (docs/operations.md)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        daemon = ManagerDaemon(config_from_args(args))
    except (ValueError, TypeError, OSError, StateError) as e:
        parser.exit(2, f"cachemanager: error: {e}\n")
    return run_until_signal(daemon.start, lambda: daemon.stop(grace=args.drain_seconds),
                            lambda: daemon.address)


if __name__ == "__main__":
    sys.exit(main())
