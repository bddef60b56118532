"""Assembles a cache server: store, core, gRPC + health, data plane, metrics."""
from __future__ import annotations

import logging
import os
import uuid
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .core import CacheCore, Limits
from .counters import Counters
from .dataplane import DataPlaneServer, UnixSocketError
from .claims import DEFAULT_TTL
from .eviction import make_policy
from .grpc_service import CacheService
from .healthsvc import HealthServicer
from .admission import Admission
from .grpcadmit import ByteAdmission
from .grpcopts import grpc_max_message, grpc_server_options
from .logs import event
from .exporter import serve_metrics
from .proto import cache_pb2 as pb
from .proto import cache_pb2_grpc as pb_grpc
from .roles import Roles, read_token
from .runtime import bind_grpc, join_hostport, release_grpc, split_hostport
from .store import Store
from .tls import TlsFiles
from .ops import FEATURES
from .vocab import PLAIN_RECORDS, PROTOCOL_VERSION

log = logging.getLogger("cacheserver")
SERVICE_NAME = "mlcache.v1.Cache"
SERVER_ID_KEY = "server_id"  # in the store's server-wide state


@dataclass
class ServerConfig:
    listen: str
    data_dir: str
    capacity: int
    peers: list[str] = field(default_factory=list)
    manager: str | None = None
    metrics_port: int | None = None
    tls: TlsFiles | None = None
    data_listen: str | None = "auto"   # "auto": gRPC host, port + 1; None: off
    unix_socket: str | None = "auto"   # "auto": DATA_DIR/data.sock; None: off
    eviction: str = "lru"
    limits: Limits = field(default_factory=Limits)
    durability: str = "cache"  # store.DURABILITY
    grpc_workers: int = 64
    claim_ttl: float = DEFAULT_TTL
    cluster_token_file: str | None = None  # the manager's role (roles.py); None: every caller has it
    cluster_token: bytes | None = None  # the same, given in memory (the embedded cache: nobody has it)
    salvage: bool = False  # open a damaged store by dropping what cannot be read (salvage.py)
    # plaintext records (datadir.py), the embedded cache's own: values only in this process
    # and over the owner-only Unix socket; no TCP data plane, no values over gRPC
    plain: bool = False


class CacheServer:
    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg
        self.counters = Counters()
        self.instance = uuid.uuid4().hex
        self.store = Store(os.path.join(cfg.data_dir), cfg.capacity, make_policy(cfg.eviction),
                           self.counters, durability=cfg.durability, salvage=cfg.salvage, plain=cfg.plain)
        self.grpc: grpc.Server | None = None
        self.dataplane = None
        self.metrics_server = None
        self.manager_link = None
        try:
            self.server_id = self._server_id()
            self.core = CacheCore(self.store, self.counters, cfg.limits, claim_ttl=cfg.claim_ttl)
            self._listen(cfg)
        except BaseException:  # release the data dir and the ports: the process may go on (embedded.py)
            self._abandon()
            raise

    def _server_id(self) -> str:
        """The id saved in the data dir (stable across restarts); a new one, saved, where none is
        or the saved one is unreadable (empty, not UTF-8, unprintable): the server starts, and
        the manager takes it as a new server at its address (membership.py drops the old record)."""
        raw = self.store.get_state(SERVER_ID_KEY)
        try:
            saved = None if raw is None else raw.decode()
        except UnicodeDecodeError:
            saved = ""
        if saved and saved.isprintable():
            return saved
        sid = uuid.uuid4().hex
        if saved is not None:
            log.warning("the saved server id (server state %r, %d bytes) is not a readable id: replaced by a "
                        "new one, %s; the manager sees this server as a new one", SERVER_ID_KEY, len(raw or b""), sid)
        # owed while writes are stopped (the store serves reads meanwhile): the start goes on
        # and the first put writes it; a restart before then picks another one
        self.store.keep_state(SERVER_ID_KEY, sid.encode())
        return sid

    def _listen(self, cfg: ServerConfig) -> None:
        """Bind every endpoint, so that a port in use fails here, before anything is served."""
        lim = cfg.limits
        self.admission = Admission(lim.max_inflight_bytes, lim.max_connections)  # both transports' bodies
        gate = ByteAdmission(self.admission, grpc_max_message(lim), self.counters)
        self._grpc_pool = futures.ThreadPoolExecutor(cfg.grpc_workers, thread_name_prefix="grpc")
        self.grpc = grpc.server(self._grpc_pool,
                                interceptors=[gate], options=grpc_server_options(lim),
                                maximum_concurrent_rpcs=lim.max_grpc_calls)
        token = self._token = (cfg.cluster_token if cfg.cluster_token is not None else
                               read_token(cfg.cluster_token_file) if cfg.cluster_token_file else None)
        if token is None and cfg.tls is None:
            log.warning("no --cluster-token-file: any client may change job modes and evict (docs/security.md)")
        pb_grpc.add_CacheServicer_to_server(CacheService(self.core, self._info, self.server_id,
                                                         Roles(token, tls=cfg.tls is not None),
                                                         values=not cfg.plain),
                                            self.grpc)
        self.health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        self.host, self.port = bind_grpc(self.grpc, cfg.listen, cfg.tls)
        self.dataplane = self._bind_dataplane(cfg, split_hostport(cfg.listen, "--listen")[1])
        if cfg.metrics_port is not None:
            try:
                self.metrics_server = serve_metrics(cfg.metrics_port, self.host, self.counters, self._gauges,
                                                    self.core.replacers.snapshot)
            except (OSError, OverflowError) as e:
                raise OSError(f"--metrics-port: cannot serve metrics on "
                              f"{join_hostport(self.host, cfg.metrics_port)}: {e}") from e

    @property
    def metrics_address(self) -> str | None:
        """HOST:PORT of the metrics endpoint (the bound port: --metrics-port 0 picks one)."""
        if self.metrics_server is None:
            return None
        return join_hostport(self.host, self.metrics_server[0].server_address[1])

    def _bind_dataplane(self, cfg: ServerConfig, port: int) -> DataPlaneServer:
        host = self.host
        tcp = None
        data_listen = None if cfg.plain else cfg.data_listen  # a plain store's values never leave over TCP
        if data_listen == "auto":
            tcp = (host, self.port + 1 if port and self.port < 65535 else 0)  # past the last port: any free one
        elif data_listen:
            tcp = split_hostport(data_listen, "--data-listen")
        unix = os.path.join(cfg.data_dir, "data.sock") if cfg.unix_socket == "auto" else cfg.unix_socket
        # Absolute: Info announces it to same-host clients, whose working directory is their own.
        unix = os.path.abspath(unix) if unix else None
        if unix and len(unix.encode()) > 100:  # AF_UNIX path limit is 108 bytes
            log.warning("unix socket path too long, same-host fast path off: %s", unix)
            unix = None
        ssl_ctx = cfg.tls.server_context() if cfg.tls else None
        unix_mode = 0o600 if cfg.plain else 0o660  # a plain store's socket: its owner's only
        try:
            return DataPlaneServer(self.core, self.instance, tcp, unix, ssl_ctx, self.admission, unix_mode)
        except UnixSocketError:
            raise  # names the socket, whatever TCP does
        except OSError as e:
            if data_listen != "auto" or tcp[1] == 0:
                raise OSError(f"--data-listen: cannot bind {join_hostport(*tcp)}: {e}") from e
            # gRPC port + 1 is taken: any port will do, clients learn it from Info.
            log.warning("data plane port %d in use (%s); binding a free port instead", tcp[1], e)
            return DataPlaneServer(self.core, self.instance, (host, 0), unix, ssl_ctx, self.admission, unix_mode)

    def _abandon(self) -> None:
        """Undo a constructor that failed half way."""
        if self.grpc is not None:
            release_grpc(self.grpc, self._grpc_pool)
        if self.metrics_server is not None:
            self.metrics_server[0].shutdown()
            self.metrics_server[0].server_close()
        if self.dataplane is not None:
            self.dataplane.stop(grace=0)
        self.store.close()

    def _info(self) -> pb.InfoResponse:
        tcp = self.dataplane.tcp_address
        return pb.InfoResponse(server_id=self.server_id, instance=self.instance,
                               data_address=join_hostport(*tcp) if tcp else "",
                               unix_socket=self.dataplane.unix_path or "",
                               max_batch_bytes=self.cfg.limits.max_batch_bytes,
                               tls=self.cfg.tls is not None, peers=self.cfg.peers,
                               capacity_bytes=self.store.capacity, db_path=self.store.db_path,
                               protocol_version=PROTOCOL_VERSION,
                               features=sorted(FEATURES | ({PLAIN_RECORDS} if self.cfg.plain else set())))

    def _gauges(self) -> dict[str, float]:
        return {"capacity_bytes": self.store.capacity, "used_bytes": self.store.used,
                "items": self.store.items}

    @property
    def address(self) -> str:
        return join_hostport(self.host, self.port)  # "[::1]:7400": what clients and the manager dial

    def start(self) -> None:
        self.grpc.start()
        self.dataplane.start()
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        tcp = self.dataplane.tcp_address
        event(log, "cacheserver started", listen=self.address, server_id=self.server_id,
              data_plane=join_hostport(*tcp) if tcp else None, unix_socket=self.dataplane.unix_path,
              capacity=self.store.capacity, used=self.store.used, items=self.store.items,
              recovered=self.counters["recovered_items"], peers=self.cfg.peers,
              tls=self.cfg.tls is not None, eviction=self.cfg.eviction,
              metrics=self.metrics_address)
        if self.cfg.manager:
            from .registration import ManagerLink
            self.manager_link = ManagerLink(
                self.cfg.manager, self.address, self.server_id,
                lambda: (self.store.capacity, self.store.used, self.store.items), tls=self.cfg.tls,
                token=self._token, on_ring=lambda peers: setattr(self.cfg, "peers", peers))  # Info.peers follows the manager's ring
            self.manager_link.start()

    def stop(self, grace: float = 6.0) -> None:
        """Drain: refuse new work, finish calls in flight, flush the store."""
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.manager_link is not None:
            self.manager_link.stop()
        done = self.grpc.stop(grace)
        self.dataplane.stop(grace=grace / 2)
        done.wait(grace)
        self._grpc_pool.shutdown(wait=False)  # grpc leaves its executor's threads running (embedded: one per open)
        if self.metrics_server is not None:
            self.metrics_server[0].shutdown()
            self.metrics_server[0].server_close()  # its port, now: not when collected
        self.store.close()
        event(log, "cacheserver stopped", counters=self.counters.snapshot())
