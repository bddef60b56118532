"""Client of a whole ring: routes ids to servers by consistent hashing and fans
batches out in parallel. A server that fails is treated as all-miss for a
back-off period (its items are simply fetched from the store and re-inserted
elsewhere later), so a dying server never surfaces as an error to training.

A hung server (stopped, a frozen VM, a black hole) fails only by timing out, so each
try costs its caller a wait: the back-off doubles with each failure in a row (up to
MAX_DOWN_S), and a server must first answer Info within PROBE_TIMEOUT_S, not the
request timeout (30 s by default), before it gets requests: at the ring's first call,
and each time it is tried again. A hung server then costs a few percent of an epoch,
where a 30 s wait every 2 s cost 15 times it, and one hung at a job's start costs the
start a probe, not the request timeout.
"""
from __future__ import annotations

import itertools
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from .. import ops, wire
from .server_client import Call, ServerClient
from .hashring import DEFAULT_VNODES, HashRing
from ..runtime import split_hostport
from ..vocab import ABSENT, FETCH, HIT

log = logging.getLogger("cacheserver.ring")
# Failures that mean "this server is not usable now", not "the request is wrong".
TRANSIENT = (ConnectionError, OSError, TimeoutError, grpc.RpcError)
PEERS_TIMEOUT_S = 5.0  # asking one server for its ring at start-up
MAX_DOWN_S = 60.0  # longest back-off of a server that keeps failing
PROBE_TIMEOUT_S = 2.0  # a server's first Info (and same-host ping), at start or tried again, within this


def parse_spec(spec: str) -> list[str]:
    """"host:port,host:port" -> addresses; a malformed entry is a ValueError naming it
    (else gRPC fails later with "Failed to parse" or dials port 443)."""
    addrs = [a.strip() for a in spec.split(",") if a.strip()]
    if not addrs:
        raise ValueError(f"cache address list {spec!r} names no server (expected HOST:PORT[,HOST:PORT...])")
    for a in addrs:
        check_address(a)
    return addrs


def _why(err: Exception) -> str:
    """One line for a log: gRPC errors carry their reason in details()."""
    details = getattr(err, "details", None)
    text = details() if callable(details) else str(err)
    return " ".join(str(text).split())[:300]


def check_address(addr: str) -> str:
    _, port = split_hostport(addr, "cache server address")
    if not 0 < port < 65536:
        raise ValueError(f"cache server address: port out of range in {addr!r}")
    return addr


def _among(addr: str, peers: Sequence[str]) -> bool:
    """Whether addr names one of peers, by name or by resolved address."""
    if addr in peers:
        return True

    def resolved(a: str) -> set[tuple[str, int]]:
        host, port = split_hostport(a, "cache server address")
        try:
            return {(ai[4][0], port) for ai in socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)}
        except (socket.gaierror, UnicodeError):
            return set()

    mine = resolved(addr)
    return any(mine & resolved(p) for p in peers)


class RingClient:
    def __init__(self, addresses: Sequence[str], *, vnodes: int = DEFAULT_VNODES,
                 down_backoff: float = 2.0, plain: bool = False, **client_kw) -> None:
        if not addresses:
            raise ValueError("a ring needs at least one cache server address")
        for a in addresses:
            check_address(a)
        self.ring = HashRing(addresses, vnodes)
        # every client's first contact (Info) waits a probe, not the request timeout: at the
        # start as when a failed server is tried again (a caller's probe_timeout= is kept)
        self._client_kw = {"probe_timeout": PROBE_TIMEOUT_S, **client_kw}
        # each server's --max-batch-size, as its Info last said (kept when its client is replaced)
        self._limits: dict[str, int] = {}
        self._batch_limit: int | None = None  # the smallest of them
        self.clients = {a: ServerClient(a, plain=plain, on_limit=self._heard, **self._client_kw)
                        for a in self.ring.nodes}
        self._down_until: dict[str, float] = {}
        self._fails: dict[str, int] = {}  # failures in a row, per server
        self._answering: set[str] = set()  # down for an error the server itself answered (busy): reachable
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max(2, 2 * len(self.clients)), thread_name_prefix="ring")
        self.down_backoff = down_backoff
        # values are the items themselves (an embedded cache's plain store, datadir.py), not
        # sealed: set only by the owner of that cache, never from what a server says
        self.plain = plain
        self.errors = 0

    @staticmethod
    def resolve(spec: str, tls: Any = None) -> list[str]:
        """"host:port,host:port" -> addresses; a single address is expanded to that
        server's --peers. A single server that cannot answer is used alone (it is
        then all-miss until it is back): a cache that is down must not stop training.
        Resolve once per job and hand the result to every process, so that they all
        route over the same ring."""
        addrs = parse_spec(spec)
        if len(addrs) == 1:
            try:
                with ServerClient(addrs[0], timeout=PEERS_TIMEOUT_S, tls=tls) as c:
                    peers = list(c.info().peers)
            except TRANSIENT as e:
                log.warning("cache server %s did not answer (%s); using it alone, without its peers",
                            addrs[0], _why(e))
                peers = []
            if peers:
                if not _among(addrs[0], peers):
                    log.warning("cache server %s is not in the ring it serves (its --peers: %s): this job "
                                "routes over those servers, not over %s; check the servers' --peers",
                                addrs[0], ",".join(peers), addrs[0])
                addrs = peers
        return addrs

    # ---- health ---------------------------------------------------------
    def _usable(self, node: str) -> bool:
        until = self._down_until.get(node)
        return until is None or time.monotonic() >= until

    def backoff(self, fails: int) -> float:
        """Seconds a server that failed `fails` times in a row stays all-miss."""
        return min(self.down_backoff * 2 ** min(fails - 1, 30), max(MAX_DOWN_S, self.down_backoff))

    def _failed(self, node: str, err: Exception) -> None:
        with self._lock:
            self.errors += 1
            first = self._usable(node)
            if _alive_error(err):
                self._answering.add(node)
            else:
                self._answering.discard(node)
            if first and _alive_error(err):  # busy, or an error it sent: alive, so no growing back-off
                self._fails[node] = 1
            elif first:  # calls in flight when it failed do not count again
                self._fails[node] = self._fails.get(node, 0) + 1
            period = self.backoff(self._fails.get(node, 1))
            self._down_until[node] = time.monotonic() + period
        if first:
            log.warning("cache server %s unavailable for %.1fs: %s", node, period, _why(err))
        if _alive_error(err):  # it answered: alive, its connections and follower (costly to reopen) still serve
            return
        # Drop pooled sockets and the fast path: the server may come back as a new instance.
        # Retired, not closed: another thread may be in a call on it (a prefetch beside the loader).
        old = self.clients[node]
        self.clients[node] = ServerClient(node, plain=self.plain, **self._client_kw, on_limit=self._heard)
        old.retire()

    def _answered(self, node: str) -> None:
        if self._fails.get(node):
            with self._lock:
                self._fails.pop(node, None)

    # ---- batch limits ---------------------------------------------------
    def _heard(self, node: str, limit: int) -> None:
        with self._lock:
            self._limits[node] = limit
            self._batch_limit = min(self._limits.values())

    def batch_limit(self) -> int | None:
        """The smallest --max-batch-size the ring's servers announce (None while none has
        answered): a put of more bytes is refused, and a get's answer is cut there, by the
        server that has it. Servers not heard from yet are asked for their Info first (what
        their first call reads anyway; one that fails is down, as in a call); after that, an
        attribute read."""
        if len(self._limits) < len(self.clients):
            for node in [n for n in self.clients if n not in self._limits and self._usable(n)]:
                self._guarded(node, self.clients[node].resolve)
        return self._batch_limit

    # ---- fan-out --------------------------------------------------------
    def _guarded(self, node: str, fn: Callable[[], None], answer: bool = False) -> None:
        """Run fn; a server that fails is marked down (its share stays a miss). `answer`:
        fn reads the server's answer, so its success ends the server's run of failures
        (a send alone can succeed into a hung server's socket buffer)."""
        try:
            fn()
            if answer:
                self._answered(node)
        except wire.RemoteError as e:
            if e.status == wire.BAD_REQUEST:
                raise ValueError(str(e)) from None
            self._failed(node, e)
        except TRANSIENT as e:
            self._failed(node, e)

    def ask(self, op: ops.Op, keys: Sequence, job: str = "", down: Any = None,
            per_key: Callable[[Any], Iterable] = list, answering: bool = False, **opts: Any) -> list:
        """Run `op` (cacheserver/ops.py) on every server for its share of `keys`:
        the answers per key, `per_key` turning a server's answer into its keys'
        values; a server that is down answers `down` for each of its keys
        (with `answering`, one down for an error it answered itself, busy, is asked too).

        Each data-plane server gets its request on the wire (ServerClient.start)
        before any answer is read, so they work in parallel without a thread
        each; a server on gRPC only gets its call in a pool thread."""
        out = [down] * len(keys)

        def put_out(idx: list[int], values: list) -> None:
            for i, v in zip(idx, values):
                out[i] = v

        def share(idx: list[int]) -> list:
            return [keys[i] for i in idx]

        calls: list[tuple[str, list[int], Call]] = []
        futures = []
        try:
            for node, idx in self.ring.route(op.ids_of(keys)).items():
                if not self._usable(node) and not (answering and node in self._answering):
                    continue
                client, started = self.clients[node], []
                self._guarded(node, lambda c=client, idx=idx: started.append(c.start(op, share(idx), job, **opts)))
                if started and started[0] is not None:
                    calls.append((node, idx, started[0]))
                elif started:
                    futures.append(self._pool.submit(self._guarded, node, lambda c=client, idx=idx: put_out(
                        idx, per_key(c.ask(op, share(idx), job, **opts))), True))
            # one deadline for every server's first answer: each was sent its request before any is read
            deadline = time.monotonic() + self.clients[calls[0][0]].timeout if calls else None
            for node, idx, handle in calls:
                self._guarded(node, lambda h=handle, idx=idx: put_out(idx, per_key(h.result(deadline))), True)
            for f in futures:
                f.result()
        finally:
            for _, _, handle in calls:
                handle.abandon()  # only those whose answers were never read
        return out

    def lookup(self, ids: Sequence[bytes], job: str = "", not_spare: bool = False) -> list[bool]:
        """Present per id; with not_spare, ids held only as spare entries count as absent."""
        return self.ask(ops.LOOKUP, ids, job, False, _hits, not_spare=not_spare)

    def lookup_pending(self, ids: Sequence[bytes], job: str = "") -> list[int]:
        """ABSENT / HIT / PENDING per id (vocab.py)."""
        return self.ask(ops.LOOKUP, ids, job, ABSENT, pending=True)

    def claim(self, ids: Sequence[bytes], job: str = "") -> list[int]:
        """FETCH / WAIT / PRESENT per id (vocab.py); a server that is down answers FETCH."""
        return self.ask(ops.CLAIM, ids, job, FETCH)

    def release(self, ids: Sequence[bytes], job: str = "") -> list[bool]:
        """Give up this job's claims on ids it will not put (ops.RELEASE), so the jobs told
        WAIT read them at once instead of waiting out the claims' ttl. True per id whose
        claim was dropped. Servers down only for being busy (the usual reason a put did
        not reach them) are asked too; one that is unreachable, or older, keeps the claims
        until their ttl."""
        return self.ask(ops.RELEASE, ids, job, False, _hits, answering=True)

    def adopt(self, ids: Sequence[bytes], job: str, dataset: str, chunk: int) -> list[bool]:
        """Spare entries join chunk `chunk` where they lie (ServerClient.adopt):
        True per id held other than as spare now; a server that is down answers False."""
        return self.ask(ops.ADOPT, ids, job, False, _hits, dataset=dataset, chunk=chunk)

    def get(self, ids: Sequence[bytes], job: str = "") -> list[memoryview | None]:
        return self.ask(ops.GET, ids, job, None)

    def put(self, items: Sequence[tuple[bytes, bytes | memoryview]], job: str = "",
            dataset: str = "", chunk: int = -1, replace: bool = False,
            unsent: list[int] | None = None) -> int:
        """Insert; returns how many were newly stored (failures are not errors: it's a cache).
        `unsent` gets the positions of items whose server took no put (down, busy, failed):
        their claims, if the caller holds any, were not released by a put."""
        stored = [0]

        def count(result: tuple[int, int, int]) -> Iterable[bool]:
            with self._lock:  # gRPC-only servers add theirs from pool threads
                stored[0] += result[0]
            return itertools.repeat(True)  # every item of that server's share was answered

        taken = self.ask(ops.PUT, items, job, False, count, dataset=dataset, chunk=chunk, replace=replace)
        if unsent is not None:
            unsent.extend(p for p, t in enumerate(taken) if not t)
        return stored[0]

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for c in self.clients.values():
            c.close()

    def __enter__(self) -> "RingClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _alive_error(err: Exception) -> bool:
    """Whether the server itself answered with this error (busy, or failing a request):
    it is alive, unlike one that timed out or refused the connection."""
    if isinstance(err, wire.RemoteError):
        return True
    return isinstance(err, grpc.RpcError) and callable(getattr(err, "code", None)) and \
        err.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INTERNAL)


def _hits(answer: bytes) -> list[bool]:
    return [a == HIT for a in answer]
