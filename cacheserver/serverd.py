"""`cacheserver`: the cache daemon's command line. Runs in the foreground (fit
for systemd and Kubernetes); SIGTERM or SIGINT drain calls in flight and exit 0."""
from __future__ import annotations

import argparse
import faulthandler
import logging
import signal
import sys

from . import logs, startchecks
from .claims import DEFAULT_TTL
from .core import Limits
from .malloc import keep_freed_memory
from .runtime import run_until_signal
from .server import CacheServer, ServerConfig
from .sizes import size_flag
from .store import DURABILITY, DataDirBusy
from .tls import add_tls_flags, tls_from_args

log = logging.getLogger("cacheserver")
# Longest of the seconds flags: gRPC takes 10 x --request-timeout in ms as a C int
# (grpcopts.py) and sockets refuse timeouts past time_t (such values crashed the start-up
# with a gRPC traceback); an infinite --claim-ttl had a dead claimant's items waited on forever.
MAX_SECONDS = 86400.0


def _seconds(text: str, zero: bool = False) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not (v > 0 or (zero and v == 0)):  # NaN fails this too
        raise argparse.ArgumentTypeError(f"must be {'>= 0' if zero else 'positive'}, got {text}")
    if not v <= MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_SECONDS:.0f} seconds (a day), got {text}")
    return v


def _positive_seconds(text: str) -> float:
    return _seconds(text)


def _drain_seconds(text: str) -> float:
    """>= 0: a negative or NaN grace silently cut the calls in flight at SIGTERM."""
    return _seconds(text, zero=True)


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return v


def _port(text: str) -> int | None:
    if text == "":  # an empty setting (systemd's METRICS_PORT=) turns metrics off
        return None
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"expected a port 0-65535, got {text!r}")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    # Each default is stated once, by hand as "(default: %(default)s)" (true to the code) or as
    # what an absent flag means; ArgumentDefaultsHelpFormatter added "(default: None)" to flags
    # whose help said what their absence does, and --claim-ttl said it twice.
    p = argparse.ArgumentParser(prog="cacheserver", description=__doc__)
    p.add_argument("--listen", required=True, help="gRPC address HOST:PORT (port 0 picks a free one)")
    p.add_argument("--data-dir", required=True, help="directory for the RocksDB store (local NVMe)")
    p.add_argument("--capacity", required=True, type=size_flag,
                   help="bytes to store at most, e.g. 200GB, 512MiB; never exceeded")
    p.add_argument("--peers", default="",
                   help="comma-separated gRPC addresses of all ring members, this server included "
                        "(default: none: a ring of this server alone, or the manager's ring with --manager)")
    p.add_argument("--manager", default=None,
                   help="cache manager address HOST:PORT; the ring then follows the manager's (default: none)")
    p.add_argument("--metrics-port", type=_port, default=None,
                   help="serve Prometheus metrics on this port (0: a free one, logged at start; empty: off) "
                        "(default: off)")
    p.add_argument("--data-listen", default="auto",
                   help="data-plane address HOST:PORT; 'auto' = gRPC port + 1; 'off' disables "
                        "(default: %(default)s)")
    p.add_argument("--unix-socket", default="auto",
                   help="same-host data-plane socket path; 'auto' = DATA_DIR/data.sock; 'off' disables "
                        "(default: %(default)s)")
    p.add_argument("--eviction", default="lru", choices=["lru", "none"],
                   help="fallback when full: evict least recently used unreferenced entries, or refuse "
                        "(default: %(default)s)")
    _add_limit_flags(p)
    p.add_argument("--durability", default="cache", choices=list(DURABILITY),
                   help="what a killed server may lose: 'cache' the inserts of its last few seconds "
                        "(refetched as misses; values skip the RocksDB log, about half the CPU per insert), "
                        "'process' nothing acknowledged, 'power' nothing even on power loss (fsync) "
                        "(default: %(default)s)")
    p.add_argument("--sync-writes", action="store_true", help="the same as --durability power")
    p.add_argument("--claim-ttl", type=_positive_seconds, default=DEFAULT_TTL, metavar="SECONDS",
                   help="how long a client's claim to be reading a miss from the store makes other "
                        "jobs wait for its insert (default: %(default)s)")
    p.add_argument("--salvage", action="store_true",
                   help="if the store's files are damaged, keep what is readable and drop the rest "
                        "(a cache refetches it) instead of refusing to start")
    p.add_argument("--cluster-token-file", default=None, metavar="FILE",
                   help="shared secret of the cache manager (mode 600): only callers that send it may change "
                        "job modes, chunk references and active chunks, evict, and see tenants in Stats")
    add_tls_flags(p, serves=True, peers="clients")
    logs.add_flags(p)
    p.add_argument("--drain-seconds", type=_drain_seconds, default=6.0,
                   help="grace for calls in flight at SIGTERM (default: %(default)s)")
    return p


def _add_limit_flags(p: argparse.ArgumentParser) -> None:
    """The size, connection and time limits of build_parser."""
    # Sizes as strings: argparse parses a string default with the flag's type, and help shows it.
    p.add_argument("--max-item-size", type=size_flag, default="64MiB",
                   help="largest accepted value (default: %(default)s)")
    p.add_argument("--max-batch-size", type=size_flag, default="256MiB",
                   help="largest put batch (sum of values); a get's answer stops at it too (the rest: misses) "
                        "(default: %(default)s)")
    p.add_argument("--max-inflight-bytes", type=size_flag, default="1GiB",
                   help="request bodies and get answers held at once across all data-plane connections and "
                        "gRPC calls; past it a request is answered 'server busy' (default: %(default)s)")
    # positive: 0 would answer every data-plane connection 'server busy' (clients: server down)
    p.add_argument("--max-connections", type=_positive_int, default=4096, metavar="N",
                   help="open data-plane connections at most; one past it is answered 'server busy' "
                        "(default: %(default)s)")
    p.add_argument("--request-timeout", type=_positive_seconds, default=30.0, metavar="SECONDS",
                   help="a data-plane request that stalls this long while being sent or answered is cut off, "
                        "as is one not sent or answered within this plus 1 s per MiB (default: %(default)s)")
    p.add_argument("--max-grpc-calls", type=_positive_int, default=64, metavar="N",
                   help="gRPC calls served at once (each may hold up to --max-batch-size); past it a call "
                        "is refused with RESOURCE_EXHAUSTED (default: %(default)s)")


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        listen=args.listen, data_dir=args.data_dir, capacity=args.capacity,
        peers=[p.strip() for p in args.peers.split(",") if p.strip()],
        manager=args.manager, metrics_port=args.metrics_port,
        tls=tls_from_args(args),
        data_listen=None if args.data_listen == "off" else args.data_listen,
        unix_socket=None if args.unix_socket == "off" else args.unix_socket,
        eviction=args.eviction,
        durability="power" if args.sync_writes else args.durability, claim_ttl=args.claim_ttl,
        salvage=args.salvage, cluster_token_file=args.cluster_token_file,
        limits=Limits(max_item_bytes=args.max_item_size, max_batch_bytes=args.max_batch_size,
                      max_inflight_bytes=args.max_inflight_bytes, max_connections=args.max_connections,
                      request_timeout_s=args.request_timeout, max_grpc_calls=args.max_grpc_calls),
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logs.setup(args.log_level, args.log_format)
    # `kill -USR1 PID`: every thread's stack to stderr (the log), the server running on
    # (docs/operations.md, Signals)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    keep_freed_memory()  # before the buffers of the first requests
    problem = startchecks.capacity_problem(args.data_dir, args.capacity)
    if problem:  # refused: a cache that cannot hold its capacity fails writes once the disk fills
        parser.exit(2, f"cacheserver: error: {problem}\n")
    try:
        server = CacheServer(config_from_args(args))
        problem = startchecks.peers_problem(server.address, server.port, server.cfg.peers)
    except (ValueError, OSError, DataDirBusy) as e:
        parser.exit(2, f"cacheserver: error: {e}\n")
    if problem:
        log.warning(problem)
    return run_until_signal(server.start, lambda: server.stop(grace=args.drain_seconds),
                            lambda: server.address)


if __name__ == "__main__":
    sys.exit(main())
