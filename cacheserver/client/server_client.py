"""Client of one cache server: gRPC for control, the data plane for bulk data.

Same-host fast paths: if the server's Unix socket exists on this machine and
answers with the same instance id as the gRPC server, bulk calls use it (no
TCP stack), and gets read values straight from the store files when this
process may open them (localread.py; transport "local"). Data connections are pooled; each carries one request at a
time, so threads issue requests in parallel on separate connections.
"""
from __future__ import annotations

import logging
import os
import queue
import socket
import struct
import time
from collections.abc import Callable, Generator, Sequence
from typing import Any

from .. import inproc, ops, wire
from ..datadir import PlaintextDir, check_private
from ..proto import cache_pb2 as pb
from ..proto import cache_pb2_grpc as pb_grpc
from ..tls import TlsFiles, grpc_channel
from ..vocab import FEATURE_INLINE, FEATURE_LOCAL_GEN, PLAIN_RECORDS, check_ids
from .follower import FIRST_OPEN_WAIT_S, Follower, Refused
from .localread import LocalReader
from .readpath import ReadPaths
from ..roles import metadata

log = logging.getLogger("cacheserver.client")

CHANNEL_OPTIONS = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
# An answer holds a u32 size per id asked plus values within the server's announced batch
# limit (getbound.py), or a few small fields: what a ping, a put or an error message needs.
ANSWER_SLACK = 64 << 10
# a ring-wide deadline (Call.result) cuts an answer's wait only once this much of the timeout is spent
DEADLINE_SLACK_S = 0.5
DEFAULT_MAX_VALUES = 256 << 20  # a server's --max-batch-size default, until its Info says


class ClientClosed(ValueError):
    """A data-plane call on a ServerClient after its close() (as gRPC's closed channel
    raises ValueError): never a new connection that nobody would close."""


class RecordsMismatch(ValueError):
    """A client and a server disagree on the record format (cacheserver/datadir.py), or a
    plain one is not this user's own."""


def peer_uid(s: socket.socket, path: str) -> int:
    """The uid of the process at the other end of a Unix socket (where the OS says;
    else the socket file's owner, who bound it)."""
    if hasattr(socket, "SO_PEERCRED"):
        _, uid, _ = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        return uid
    return os.stat(path).st_uid


class ServerClient:
    def __init__(self, address: str, *, tls: TlsFiles | None = None, prefer_unix: bool = True,
                 timeout: float = 30.0, use_dataplane: bool = True, local_read: bool = True,
                 control_token: bytes | None = None, plain: bool = False,
                 probe_timeout: float | None = None,
                 on_limit: Callable[[str, int], None] | None = None) -> None:
        self.address = address
        self.plain = plain  # records of an embedded cache's plain store expected (datadir.py)
        self._md = metadata(control_token)  # the manager's role for control calls (roles.py)
        self.timeout = timeout
        # A server that failed before: finding out whether it answers at all (Info, the
        # same-host ping) must not wait the whole request timeout (ring_client.py).
        self._probe_timeout = min(timeout, probe_timeout) if probe_timeout else timeout
        self._tls = tls
        self.channel = grpc_channel(address, tls, CHANNEL_OPTIONS)
        self.stub = pb_grpc.CacheStub(self.channel)
        self._prefer_unix = prefer_unix
        self._use_dataplane = use_dataplane
        self._local_read = local_read
        self.paths = ReadPaths()
        # the same-host follower's life (follower.py); _new_follower is looked up now, so a
        # subclass's or a test's own is the one used
        self._fol = Follower(address, self.paths, self._new_follower)
        self._closed = False
        self._features: frozenset[str] | None = None
        self._pool: queue.LifoQueue[socket.socket] = queue.LifoQueue()
        self._max_values = DEFAULT_MAX_VALUES  # bytes of values one answer may hold (Info)
        # told (address, limit) each time the server's Info gives its --max-batch-size: the ring
        # splits batches by the smallest of its servers' (RingClient.batch_limit)
        self._on_limit = on_limit
        self._target: tuple[str, object] | None = None  # ("unix", path) | ("tcp", (host, port))
        self.transport = "unresolved"
        self._read_ahead = True  # same-host gets read the follower while the server answers
        self._inproc_get = local_read  # operations on a server in this process go to its core (inproc.py)

    # ---- what the server serves -------------------------------------------
    def supports(self, feature: str) -> bool:
        """Whether the server announces `feature` in its Info (ops.FEATURES):
        the one place this client decides what it may ask. A server that
        announces none gets only what every server serves."""
        if self._features is None:
            self._resolve()  # one Info answers the transport and the features
        return feature in self._features

    def serves(self, op: ops.Op) -> bool:
        return op.feature is None or self.supports(op.feature)

    # ---- data-plane connections ----------------------------------------
    def _resolve(self) -> None:
        info = self.info()
        features = frozenset(info.features)
        if (PLAIN_RECORDS in features) != self.plain:  # never plaintext to a sealed store, nor back
            raise RecordsMismatch(
                f"cache server {self.address} holds an embedded cache's plaintext records: only the process "
                f"that runs it and its DataLoader workers may use it; run a cacheserver to share a cache"
                if not self.plain else
                f"cache server {self.address} holds sealed records, not the plain ones of the embedded "
                f"cache this client was made for")
        self._features = features
        self._max_values = info.max_batch_bytes or DEFAULT_MAX_VALUES
        try:
            self._pick_transport(info)
        except BaseException:  # unresolved still: the next call asks again, never falls back to gRPC
            self._features, self._target, self.transport = None, None, "unresolved"
            raise
        if self._on_limit is not None:
            self._on_limit(self.address, self._max_values)

    def resolve(self) -> None:
        """Read the server's Info now if no call has yet (its first call would): what it serves,
        the transport, and its batch limit."""
        if self.transport == "unresolved":
            self._resolve()

    def _pick_transport(self, info: pb.InfoResponse) -> None:
        """The Unix socket, else the TCP data plane, else gRPC; a plain store's values only over
        the Unix socket."""
        if self.plain:  # values read unhashed: never over TCP or gRPC, which anyone on the host may answer
            if not self._try_unix(info):
                raise RecordsMismatch(
                    f"cache server {self.address} announces plaintext records but no Unix socket of this "
                    f"user's that answers as it ({info.unix_socket or 'none announced'}): an embedded cache's "
                    f"values are taken only over its owner's socket, not over TCP or gRPC")
        elif self._use_dataplane and not (self._prefer_unix and self._try_unix(info)) and info.data_address:
            _, port = info.data_address.rsplit(":", 1)
            host = self.address.rsplit(":", 1)[0].strip("[]")
            self._target, self.transport = ("tcp", (host, int(port))), "tcp"
        if self._target is None:
            self.transport = "grpc"

    def _try_unix(self, info: pb.InfoResponse) -> bool:
        """Take the server's Unix socket if it answers as this server (for a plain store: and
        is this user's, else RecordsMismatch); an OSError is raised for a plain store only."""
        if not (info.unix_socket and os.path.exists(info.unix_socket)):
            return False
        try:
            s = self._connect(("unix", info.unix_socket))
            if self.plain and peer_uid(s, info.unix_socket) != os.geteuid():
                s.close()  # values read unhashed come only from this user's own processes
                raise RecordsMismatch(f"cache server {self.address}: its Unix socket {info.unix_socket} "
                                      f"is another user's, not this user's embedded cache")
            # the request timeout, not the probe's: Info has just answered, and a ping cut short
            # by a loaded host would keep this client on TCP, without its follower, for good
            s.settimeout(self.timeout)
            try:
                instance = self._ping(s)
            except BaseException:
                s.close()
                raise
            if instance != info.instance:  # a namesake path, not this server
                s.close()
                return False
            self._target, self.transport = ("unix", info.unix_socket), "unix"
            self._pool.put(s)
            self._open_local(info.db_path)
            return True
        except OSError:
            if self.plain:  # this user's socket failed: the ring takes the server as down
                raise
            return False

    def _open_local(self, db_path: str) -> None:
        if not (self._local_read and db_path and os.access(db_path, os.R_OK | os.X_OK)):
            return
        if inproc.core_for(self.address) is not None:  # served in this process: no follower needed
            return
        if self.plain:  # read unhashed: only from a data dir of this user's own (datadir.py)
            try:
                check_private(os.path.dirname(db_path))
            except (PlaintextDir, OSError):
                return
        # opened now (waited for no longer than a probe), or in the background
        if self._fol.enable(db_path, min(self._probe_timeout, FIRST_OPEN_WAIT_S)) is not None:
            self.transport = "local"

    def _new_follower(self, db_path: str) -> LocalReader:
        """Open a follower (in a thread of its own: follower.py); the time it takes counts as
        follower cost (readpath.py). Refused: not now (the server did not take OPEN_FOLLOWER,
        or this process could not make the follower's scratch dir); RocksDB's own errors: not
        now either, unless they cannot go away (follower.lasting)."""
        t = time.perf_counter()
        try:
            self.ask(ops.OPEN_FOLLOWER, ())  # the server shortens the log the follower replays
        except (wire.RemoteError, OSError) as e:  # busy, a timeout, a dropped connection
            raise Refused(f"{type(e).__name__}: {e}") from e
        try:
            local = LocalReader(db_path, self.plain)
        except OSError as e:  # its scratch dir (scratch.py): a full or missing temp dir, no fds left
            raise Refused(f"{type(e).__name__}: {e}") from e  # RocksDB's own are not OSErrors: lasting() judges them
        self.paths.follower(time.perf_counter() - t)
        return local

    def _follower(self) -> LocalReader | None:
        """The follower to read from now (follower.py), None: read over the socket."""
        local = self._fol.current()
        if local is not None:
            self.transport = "local"
        return local

    # What tests read: the follower now, and the store it follows (None: none will be opened).
    @property
    def _local(self) -> LocalReader | None:
        return self._fol.local

    @property
    def _db_path(self) -> str | None:
        return self._fol.db_path

    def _connect(self, target: tuple[str, object]) -> socket.socket:
        kind, addr = target
        if kind == "unix":
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(self.timeout)
            s.connect(addr)
            return s
        s = socket.create_connection(addr, timeout=self.timeout)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._tls:
            s = self._tls.client_context().wrap_socket(s)
        return s

    def _send(self, op: int, job: str, count: int, parts: Sequence[bytes | memoryview],
              flags: int = 0) -> socket.socket:
        """Send one request on a pooled connection; _recv takes its answer."""
        if self._closed:
            raise ClientClosed(f"the client of cache server {self.address} is closed")
        try:
            s = self._pool.get_nowait()
        except queue.Empty:
            s = self._connect(self._target)
        jb = job.encode()
        body_len = len(jb) + sum(len(p) for p in parts)
        try:
            wire.send_buffers(s, [wire.pack_header(op, len(jb), count, body_len, flags), jb, *parts])
        except BaseException:
            s.close()  # framing state unknown: never reuse
            raise
        return s

    def _recv(self, s: socket.socket, asked: int = 0, deadline: float | None = None) -> tuple[int, bytes]:
        """The answer (count, body) to a request of `asked` ids, waited for until `deadline`
        where that is sooner than the timeout (a syscall only then: not on the hit path)."""
        cut = deadline is not None and deadline - time.monotonic() < self.timeout - DEADLINE_SLACK_S
        try:
            if cut:
                s.settimeout(max(deadline - time.monotonic(), 0.001))
            status, aux_len, rcount, rbody = wire.unpack_header(wire.recv_exact(s, wire.HEADER.size))
            if status != wire.OK:
                raise wire.RemoteError(status, wire.recv_exact(s, aux_len).decode(errors="replace"))
            limit = 4 * asked + self._max_values + ANSWER_SLACK
            if rbody > limit:  # a broken peer's length: never a buffer to allocate
                raise wire.ProtocolError(f"cache server {self.address} announced an answer of {rbody} bytes "
                                         f"to {asked} ids; at most {limit} can be valid")
            body = wire.recv_exact(s, rbody)
            if cut:
                s.settimeout(self.timeout)
        except BaseException:
            s.close()  # framing state unknown: never reuse
            raise
        self._pool.put(s)
        if self._closed:  # closed while this answer came: its drain may have run before the put
            self._drain()
        return rcount, body

    def _ping(self, s: socket.socket) -> str:
        """The instance id the socket's server answers; RemoteError if it answers busy (it
        cannot say now which server it is: taken for another's, this client kept to TCP)."""
        try:
            wire.send_buffers(s, [wire.pack_header(ops.PING.code, 0, 0, 0)])
        except (BrokenPipeError, ConnectionResetError):
            pass  # past --max-connections the server answers busy and closes unread: read that answer
        status, aux_len, _, body_len = wire.unpack_header(wire.recv_exact(s, wire.HEADER.size))
        if body_len > ANSWER_SLACK:
            raise wire.ProtocolError(f"a ping answered {body_len} bytes, not an instance id")
        text = wire.recv_exact(s, body_len or aux_len).decode(errors="replace")
        if status == wire.UNAVAILABLE:  # resolved again at the next call (_resolve)
            raise wire.RemoteError(status, text)
        return text

    def _dataplane(self) -> bool:
        self.resolve()
        return self._target is not None

    # ---- operations (cacheserver/ops.py) --------------------------------------
    def start(self, op: ops.Op, keys: Sequence, job: str = "", **opts: Any) -> "Call | None":
        """Send the first request of `op` without waiting for its answer:
        RingClient puts one on every server before it waits for any, instead of
        a thread per server. Call.result() finishes it. None on gRPC."""
        if not self._dataplane():
            return None
        self._check(op, keys)
        if not self.serves(op):
            return Call.done(op.unserved(len(keys)))
        refused = self._too_big(op, keys)
        if refused:  # answered as the server would, after the ring has sent the other servers theirs
            return Call.failed(wire.RemoteError(wire.BAD_REQUEST, refused))
        return Call(self, self._steps(op, keys, job, opts))

    def ask(self, op: ops.Op, keys: Sequence, job: str = "", **opts: Any) -> Any:
        """Run `op` on `keys` (ids; (id, value) items for a put) and return its answer."""
        if op.keyed and not keys:
            return op.empty()
        self._check(op, keys)
        if not self.serves(op):
            return op.unserved(len(keys))
        dataplane = self._dataplane()  # resolved: the server's batch limit is known
        refused = self._too_big(op, keys)
        if refused:
            raise wire.RemoteError(wire.BAD_REQUEST, refused)
        if dataplane:
            return Call(self, self._steps(op, keys, job, opts)).result()
        return op.grpc(self.stub, keys, job, self.timeout, **opts)

    @staticmethod
    def _check(op: ops.Op, keys: Sequence) -> None:
        # struct's "32s" would silently pad or cut a wrong-sized id: refuse it here.
        check_ids(op.ids_of(keys), ValueError)

    def _too_big(self, op: ops.Op, keys: Sequence) -> str:
        """Why the server would refuse this put for its size ("" if it would not): refused
        here, unsent, as the server refuses it. Sent, a frame past its limit is cut off unread
        (a broken pipe; over gRPC RESOURCE_EXHAUSTED), which the ring takes for a failed
        server: all-miss for its back-off, over one item too large to cache."""
        if op is not ops.PUT:
            return ""
        total = sum(len(v) for _, v in keys)
        if total <= self._max_values:
            return ""
        return (f"cache server {self.address}: batch of {total} bytes exceeds the limit of "
                f"{self._max_values} (its --max-batch-size)")

    def _steps(self, op: ops.Op, keys: Sequence, job: str, opts: dict[str, Any]) -> Steps:
        """Generators that yield each request (op, job, count, parts, flags) and are
        sent its answer (count, body); Call runs them. A server in this very process
        (the embedded default) is asked straight through its core: no socket, no
        server thread taking the GIL (its puts are not vouched for: inproc.py)."""
        core = inproc.core_for(self.address) if self._inproc_get else None
        if core is not None:
            return inproc.ask(core, op, job, keys, opts)
        if op is ops.GET:
            return (yield from self._get_steps(keys, job))
        count, body = yield (op.code, job, *op.frame(keys, **opts))
        return op.result(count, body)

    def lookup(self, ids: Sequence[bytes], job: str = "", pending: bool = False,
               not_spare: bool = False) -> bytes:
        """One byte per id: HIT; with `pending`, PENDING if absent but another
        job is reading it from the store; with `not_spare`, ABSENT for ids held
        only as spare entries."""
        return self.ask(ops.LOOKUP, ids, job, pending=pending, not_spare=not_spare)

    def claim(self, ids: Sequence[bytes], job: str = "") -> bytes:
        """Claim misses before reading them from the store: FETCH / WAIT / PRESENT per id."""
        return self.ask(ops.CLAIM, ids, job)

    def release(self, ids: Sequence[bytes], job: str = "") -> bytes:
        """Give up this job's claims on ids it will not put: 1 per id whose claim was dropped
        (a server from before the operation is not asked: all 0, its claims lapse by ttl)."""
        return self.ask(ops.RELEASE, ids, job)

    def adopt(self, ids: Sequence[bytes], job: str, dataset: str, chunk: int) -> bytes:
        """Take ids held as spare entries into chunk `chunk` of `dataset` where
        their values lie: one byte per id, 1 held other than as spare now, 0 absent."""
        return self.ask(ops.ADOPT, ids, job, dataset=dataset, chunk=chunk)

    def get(self, ids: Sequence[bytes], job: str = "") -> list[memoryview | None]:
        """Values in id order (zero-copy views of one receive buffer), None for misses."""
        return self.ask(ops.GET, ids, job)

    def put(self, items: Sequence[tuple[bytes, bytes | memoryview]], job: str = "",
            dataset: str = "", chunk: int = -1, replace: bool = False) -> tuple[int, int, int]:
        """Store (id, value) pairs; returns (stored, already, rejected_full)."""
        return self.ask(ops.PUT, items, job, dataset=dataset, chunk=chunk, replace=replace)

    # ---- gets: same-host reads from the store files, or over the socket
    def _get_steps(self, ids: Sequence[bytes], job: str) -> Steps:
        local = self._follower()
        if local is None:
            return (yield from self._remote_get_steps(ids, job))
        inline = self.supports(FEATURE_INLINE)
        gen = inline and self.supports(FEATURE_LOCAL_GEN)  # which files to read: follower.Follower.read
        # While the server answers which ids it holds, read them all from the follower
        # (Call runs `ahead` between sending and receiving): the round trip no longer
        # adds to the reads. Only while most ids were present last time.
        ahead: list = []
        read_ahead = (lambda: ahead.append(self._timed_read(local, ids))) if self._read_ahead else None
        count, body = yield (ops.GET_LOCAL.code, job, *ops.GET_LOCAL.frame(ids, inline=inline, generation=gen),
                             read_ahead)
        _check_count(len(ids), count if inline else len(body))
        generation = ops.generation_of(body) if gen else None
        if inline:  # values the follower cannot see yet (not flushed) came inline
            out, want = ops.values_of(count, body, ops.GENERATION.size if gen else 0)
        else:
            out, want = [None] * len(ids), [i for i, p in enumerate(body) if p]
        self._read_ahead = 2 * len(want) >= len(ids)
        missing = self._fol.read(local, ids, want, out, ahead[0] if ahead else None, generation)
        if missing:  # not visible to the follower yet, or damaged: the server decides
            got = yield from self._remote_get_steps([ids[i] for i in missing], job, counted=True)
            for i, v in zip(missing, got):
                out[i] = v
        return out

    @staticmethod
    def _timed_read(local: LocalReader, ids: Sequence[bytes]) -> tuple[list[memoryview | None], float, int | None]:
        t, view = time.perf_counter(), local.view  # the view before the read: it holds at least that
        return local.read(ids), time.perf_counter() - t, view

    def _remote_get_steps(self, ids: Sequence[bytes], job: str, counted: bool = False) -> Steps:
        # Timed from the send: in a ring's fan-out that includes waiting on other
        # servers' answers, which errs towards keeping the follower.
        t = time.perf_counter()
        count, body = yield (ops.GET.code, job, *ops.GET.frame(ids, counted=counted))
        _check_count(len(ids), count)
        out = ops.GET.result(count, body)
        if self._db_path is not None:  # only worth measuring where a follower is an option
            self.paths.remote_read(time.perf_counter() - t, sum(len(v) for v in out if v is not None))
        return out

    # ---- control (gRPC) -------------------------------------------------
    def info(self) -> pb.InfoResponse:
        # Until the server has answered once, within the probe timeout (see __init__).
        return self.stub.Info(pb.InfoRequest(), timeout=self._probe_timeout if self._features is None
                              else self.timeout)

    def stats(self) -> pb.StatsResponse:
        return self.stub.Stats(pb.StatsRequest(), timeout=self.timeout, metadata=self._md)

    def set_job_mode(self, job: str, mode: int) -> int:
        return self.stub.SetJobMode(pb.SetJobModeRequest(job=job, mode=mode), timeout=self.timeout,
                                    metadata=self._md).previous

    def active_chunk(self, dataset: str, chunk: int = -1) -> int:
        return self.stub.ActiveChunk(pb.ActiveChunkRequest(dataset=dataset, chunk=chunk),
                                     timeout=self.timeout, metadata=self._md).active

    def ref_chunk(self, dataset: str, chunk: int, job: str) -> int:
        return self.stub.RefChunk(pb.RefChunkRequest(dataset=dataset, chunk=chunk, job=job),
                                  timeout=self.timeout, metadata=self._md).refs

    def unref_chunk(self, dataset: str, chunk: int, job: str) -> int:
        return self.stub.UnrefChunk(pb.RefChunkRequest(dataset=dataset, chunk=chunk, job=job),
                                    timeout=self.timeout, metadata=self._md).refs

    def evict_chunk(self, dataset: str, chunk: int, force: bool = False) -> tuple[int, int]:
        r = self.stub.EvictChunk(pb.EvictChunkRequest(dataset=dataset, chunk=chunk, force=force),
                                 timeout=self.timeout, metadata=self._md)
        return r.items, r.bytes

    def evict_dataset(self, dataset: str) -> tuple[int, int]:
        r = self.stub.EvictDataset(pb.EvictDatasetRequest(dataset=dataset), timeout=self.timeout,
                                   metadata=self._md)
        return r.items, r.bytes

    def retire(self) -> None:
        """Let go of this client while other threads may still be in a call on it (the
        ring replaces a failed server's client): idle connections are closed; the follower
        and the channel are dropped, not closed, so a call under way ends as any failure
        does, and the last reference closes them."""
        self._fol.retire()
        self._drain()

    def _drain(self) -> None:
        while True:
            try:
                self._pool.get_nowait().close()
            except queue.Empty:
                break

    def close(self) -> None:
        self._closed = True  # calls under way end with ClientClosed, not on a new connection
        self._fol.close()  # an open under way closes its own
        self._drain()
        self.channel.close()

    def __enter__(self) -> "ServerClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


Steps = Generator[tuple, tuple[int, bytes], Any]


def _check_count(asked: int, answered: int) -> None:
    """Answers go by position: one for another number of ids matches none of them."""
    if answered != asked:
        raise wire.ProtocolError(f"a get of {asked} ids was answered for {answered}")


class Call:
    """One data-plane operation in flight: its first request is sent on creation;
    result() waits for each answer and sends the next request its steps yield."""

    def __init__(self, client: ServerClient | None, steps: Steps | None) -> None:
        self._client, self._steps, self._sock = client, steps, None
        self._done, self._value, self._error = False, None, None
        if steps is None:
            return
        self._meanwhile = None
        try:
            req = next(steps)
        except StopIteration as stop:  # answered without a call
            self._done, self._value = True, stop.value
            return
        self._sock = self._send(req)

    def _send(self, req: tuple) -> socket.socket:
        """Send (op, job, count, parts, flags[, meanwhile]): `meanwhile` runs after the
        request is sent and before its answer is read."""
        sock = self._client._send(*req[:5])
        self._meanwhile = req[5] if len(req) > 5 else None
        self._asked = req[2]  # ids asked: bounds the answer's length (ServerClient._recv)
        return sock

    @classmethod
    def done(cls, value: Any) -> "Call":
        c = cls(None, None)
        c._done, c._value = True, value
        return c

    @classmethod
    def failed(cls, err: Exception) -> "Call":
        """A call answered, unsent, with the error the server would have answered."""
        c = cls.done(None)
        c._error = err
        return c

    def result(self, deadline: float | None = None) -> Any:
        """The call's value. `deadline` (time.monotonic()): its first answer is waited for until
        then at most, where that is sooner than the client's timeout (RingClient.ask: calls sent to
        every server at once share one deadline, so k hung servers cost one timeout, not k)."""
        if self._done:
            if self._error is not None:
                raise self._error
            return self._value
        client, steps = self._client, self._steps
        sock, self._sock = self._sock, None
        while True:
            try:
                if self._meanwhile is not None:
                    meanwhile, self._meanwhile = self._meanwhile, None
                    meanwhile()
                answer = client._recv(sock, self._asked, deadline)
                deadline = None  # a later step's request is sent now: the client's own timeout
            except BaseException:
                steps.close()
                sock.close()  # its answer was never read: the connection cannot be reused
                raise
            try:
                req = steps.send(answer)
            except StopIteration as stop:
                value = stop.value
                break
            sock = self._send(req)
        self._done, self._value = True, value
        return value

    def abandon(self) -> None:
        """Drop a call whose answer will not be read: its connection cannot be reused."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
