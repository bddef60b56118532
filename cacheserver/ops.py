"""The data-plane operations, each declared once: its op code, the feature a
server must announce for it, its request and answer on the binary data plane
and over gRPC, and the CacheCore method that serves it.

The data-plane server (dataplane.py) and the gRPC service (grpc_service.py)
serve from TABLE; ServerClient and RingClient ask through the same objects.
Adding an operation: declare it here (with `feature`, a new name, if older
servers lack it: FEATURES, what a server announces, comes from TABLE), give
CacheCore its method, and add its messages and rpc to cache.proto (then
tools/gen_proto.py).

Frames (wire.py): every request body is job[aux_len] + the op's own part.
  LOOKUP, GET, GET_LOCAL, CLAIM, RELEASE   count x 32-byte ids
  PUT     u16 dataset_len + dataset + i32 chunk + count x (32-byte id + u64 size)
          + the values, concatenated
  ADOPT   u16 dataset_len + dataset + i32 chunk (>= 0) + count x 32-byte ids
  PING, OPEN_FOLLOWER   nothing
Answers: LOOKUP, CLAIM, RELEASE, ADOPT and plain GET_LOCAL one byte per id
(vocab.py codes; RELEASE 1 where the caller's claim was dropped); GET and
GET_LOCAL with FLAG_INLINE count x u32 size (MISS, or LOCAL: read it from the
store files) + the values, after a u64 generation with FLAG_GENERATION; PUT 3 x u32
stored, already, rejected_full; PING the server's instance id; OPEN_FOLLOWER 1 byte,
1 if flushed.
"""
from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from .proto import cache_pb2 as pb
from .vocab import BODY_BYTES_HEADER, FLAG_FEATURES, FETCH, ID_LEN, BadRequest, split_ids
from .wire import ProtocolError

FLAG_COUNTED = 1  # GET: the reader already counted this get through GET_LOCAL
FLAG_REPLACE = 2  # PUT: overwrite present ids (the reader found them poisoned)
FLAG_PENDING = 4  # LOOKUP: answer PENDING for absent ids another job is reading from the store
FLAG_INLINE = 8  # GET_LOCAL: values not flushed yet come inline (a follower cannot see them)
FLAG_NOT_SPARE = 16  # LOOKUP: ids held only as spare entries count as absent
FLAG_GENERATION = 32  # GET_LOCAL with INLINE: the answer starts with the store's generation (GENERATION)
MISS = 0xFFFFFFFF
LOCAL = 0xFFFFFFFE  # GET_LOCAL with INLINE: present, read it from the store files
PUT_ENTRY = struct.Struct(f"<{ID_LEN}sQ")
PUT_RESULT = struct.Struct("<III")
GENERATION = struct.Struct("<Q")
_U16 = struct.Struct("<H")
_I32 = struct.Struct("<i")

Value = memoryview | bytes
Frame = tuple[int, list, int]  # count, body parts, flags


class Core(Protocol):
    """What the operations call on the server (cacheserver/core.py's CacheCore)."""
    def lookup(self, job: str, ids: Sequence[bytes], pending: bool = ..., not_spare: bool = ...) -> bytes: ...
    def claim(self, job: str, ids: Sequence[bytes]) -> bytes: ...
    def give_up(self, job: str, ids: Sequence[bytes]) -> bytes: ...
    def adopt(self, job: str, ids: Sequence[bytes], dataset: str, chunk: int) -> bytes: ...
    def get(self, job: str, ids: Sequence[bytes], count: bool = ...) -> list: ...
    def get_local(self, job: str, ids: Sequence[bytes]) -> bytes: ...
    def get_local_inline(self, job: str, ids: Sequence[bytes]) -> list: ...
    def generation(self) -> int: ...
    def put(self, job: str, items: Sequence, dataset: str = ..., chunk: int = ..., replace: bool = ...) -> tuple: ...
    def open_follower(self) -> bool: ...


def sized_call(method: Any, request: Any, timeout: float) -> Any:
    """Call a gRPC method declaring the request's size: the server admits the call by it
    against its bytes in flight before reading the message (grpcadmit.py)."""
    return method(request, timeout=timeout, metadata=((BODY_BYTES_HEADER, str(request.ByteSize())),))


class Op:
    """One operation. Client side: frame() -> (count, parts, flags), result(count,
    body) -> value, grpc() for a server reached over gRPC only, unserved(n) for a
    server that does not announce `feature`. Server side: serve() answers a
    frame as (count, parts); serve_grpc() answers the gRPC request."""
    name = ""
    code = 0
    rpc = ""               # the Cache rpc serving it over gRPC ("" for data-plane-only ops)
    feature: str | None = None  # announced by servers that serve it (FEATURES); None: every server does
    keyed = True           # asks about ids (or items); without any, the answer is empty()

    def empty(self) -> Any:
        return self.result(0, b"")

    def ids_of(self, keys: Sequence) -> Sequence[bytes]:
        return keys

    def frame(self, keys: Sequence, **opts: Any) -> Frame:
        return len(keys), [b"".join(keys)], 0

    def result(self, count: int, body: bytes) -> Any:
        return body

    def unserved(self, n: int) -> Any:
        raise NotImplementedError(f"{self.name} is served by every server")

    def grpc(self, stub: Any, keys: Sequence, job: str, timeout: float, **opts: Any) -> Any:
        raise NotImplementedError(f"{self.name} has no gRPC form")

    def serve(self, core: Core, job: str, flags: int, count: int, body: memoryview) -> tuple[int, list]:
        raise NotImplementedError

    def serve_grpc(self, core: Core, request: Any) -> Any:
        raise NotImplementedError(f"{self.name} has no gRPC form")


class Lookup(Op):
    name, code, rpc = "lookup", 1, "Lookup"

    def frame(self, keys: Sequence[bytes], pending: bool = False, not_spare: bool = False) -> Frame:
        return len(keys), [b"".join(keys)], (FLAG_PENDING if pending else 0) | (FLAG_NOT_SPARE if not_spare else 0)

    def grpc(self, stub, keys, job, timeout, pending: bool = False, not_spare: bool = False) -> bytes:
        return sized_call(stub.Lookup, pb.LookupRequest(job=job, ids=b"".join(keys), pending=pending,
                                                        not_spare=not_spare), timeout).present

    def serve(self, core, job, flags, count, body):
        present = core.lookup(job, split_counted(body, count), pending=bool(flags & FLAG_PENDING),
                              not_spare=bool(flags & FLAG_NOT_SPARE))
        return count, [present]

    def serve_grpc(self, core, request):
        return pb.LookupResponse(present=core.lookup(request.job, split_ids(request.ids), pending=request.pending,
                                                     not_spare=request.not_spare))


class Claim(Op):
    name, code, rpc, feature = "claim", 6, "Claim", "claim"

    def unserved(self, n: int) -> bytes:
        return bytes([FETCH]) * n  # nobody to wait for: read everything ourselves

    def grpc(self, stub, keys, job, timeout) -> bytes:
        return sized_call(stub.Claim, pb.ClaimRequest(job=job, ids=b"".join(keys)), timeout).codes

    def serve(self, core, job, flags, count, body):
        return count, [core.claim(job, split_counted(body, count))]

    def serve_grpc(self, core, request):
        return pb.ClaimResponse(codes=core.claim(request.job, split_ids(request.ids)))


class Release(Op):
    """A claimant that will not put items it claimed (its store read failed, its put was
    refused before reaching the store) gives up its own claims on them (claims.py)."""
    name, code, rpc, feature = "release", 9, "ReleaseClaims", "claim_release"

    def unserved(self, n: int) -> bytes:
        return bytes(n)  # a server from before it: the claims lapse after its --claim-ttl

    def grpc(self, stub, keys, job, timeout) -> bytes:
        return sized_call(stub.ReleaseClaims, pb.ReleaseClaimsRequest(job=job, ids=b"".join(keys)),
                          timeout).released

    def serve(self, core, job, flags, count, body):
        return count, [core.give_up(job, split_counted(body, count))]

    def serve_grpc(self, core, request):
        return pb.ReleaseClaimsResponse(released=core.give_up(request.job, split_ids(request.ids)))


class Adopt(Op):
    name, code, rpc, feature = "adopt", 8, "Adopt", "adopt"

    def frame(self, keys: Sequence[bytes], dataset: str = "", chunk: int = -1) -> Frame:
        return len(keys), [tag_bytes(dataset, chunk), b"".join(keys)], 0

    def unserved(self, n: int) -> bytes:
        return bytes(n)  # all absent: the caller reads those items from the store

    def grpc(self, stub, keys, job, timeout, dataset: str = "", chunk: int = -1) -> bytes:
        return sized_call(stub.Adopt, pb.AdoptRequest(job=job, dataset=dataset, chunk=chunk, ids=b"".join(keys)),
                          timeout).held

    def serve(self, core, job, flags, count, body):
        dataset, chunk, pos = parse_tag(body, "adopt")
        return count, [core.adopt(job, split_counted(body[pos:], count), dataset, chunk)]

    def serve_grpc(self, core, request):
        return pb.AdoptResponse(held=core.adopt(request.job, split_ids(request.ids), request.dataset, request.chunk))


class Get(Op):
    name, code, rpc = "get", 2, "Get"

    def frame(self, keys: Sequence[bytes], counted: bool = False) -> Frame:
        return len(keys), [b"".join(keys)], FLAG_COUNTED if counted else 0

    def result(self, count: int, body: bytes) -> list[memoryview | None]:
        return values_of(count, body)[0]

    def grpc(self, stub, keys, job, timeout) -> list[memoryview | None]:
        out: list[memoryview | None] = [None] * len(keys)
        for msg in sized_call(stub.Get, pb.GetRequest(job=job, ids=b"".join(keys)), timeout):
            mv, pos = memoryview(msg.data), 0
            for j, size in enumerate(msg.sizes):
                if size >= 0:
                    out[msg.first + j] = mv[pos:pos + size]
                    pos += size
        return out

    def serve(self, core, job, flags, count, body):
        return values_frame(core.get(job, split_counted(body, count), count=not flags & FLAG_COUNTED))


class GetLocal(Op):
    """A same-host reader announces a get whose values it reads itself from the
    store files (client/localread.py); with `inline` (vocab.FEATURE_INLINE), values it
    cannot read there yet come inline; with `generation` (vocab.FEATURE_LOCAL_GEN, only with
    `inline`) the answer starts with the store's generation, read after the values: a
    follower whose view may predate it catches up before it reads (localread.LocalReader.sync)."""
    name, code = "get_local", 5

    def frame(self, keys: Sequence[bytes], inline: bool = False, generation: bool = False) -> Frame:
        if generation and not inline:
            raise ValueError("get_local: generation is answered only with inline")
        return len(keys), [b"".join(keys)], (FLAG_INLINE if inline else 0) | (FLAG_GENERATION if generation else 0)

    def serve(self, core, job, flags, count, body):
        ids = split_counted(body, count)
        if flags & FLAG_GENERATION and not flags & FLAG_INLINE:
            raise BadRequest("get_local: flag GENERATION (32) is served only with flag INLINE (8)")
        if not flags & FLAG_INLINE:
            return count, [core.get_local(job, ids)]
        count, parts = values_frame(core.get_local_inline(job, ids))
        if flags & FLAG_GENERATION:  # read after the values: it covers every flush that made one LOCAL
            parts.insert(0, GENERATION.pack(core.generation()))
        return count, parts


class Put(Op):
    name, code, rpc = "put", 3, "Put"

    def frame(self, keys: Sequence[tuple[bytes, Value]], dataset: str = "", chunk: int = -1,
              replace: bool = False) -> Frame:
        table = b"".join(PUT_ENTRY.pack(k, len(v)) for k, v in keys)
        return (len(keys), [tag_bytes(dataset, chunk if dataset else -1), table, *(v for _, v in keys)],
                FLAG_REPLACE if replace else 0)

    def result(self, count: int, body: bytes) -> tuple[int, int, int]:
        if len(body) != PUT_RESULT.size:
            raise ProtocolError(f"a put's answer has {len(body)} bytes, not {PUT_RESULT.size}")
        return PUT_RESULT.unpack(body)

    def empty(self) -> tuple[int, int, int]:
        return 0, 0, 0

    def ids_of(self, keys: Sequence[tuple[bytes, Value]]) -> list[bytes]:
        return [k for k, _ in keys]

    def grpc(self, stub, keys, job, timeout, dataset: str = "", chunk: int = -1,
             replace: bool = False) -> tuple[int, int, int]:
        req = pb.PutRequest(job=job, dataset=dataset, chunk=chunk if dataset else -1, replace=replace,
                            items=[pb.PutItem(id=k, size=len(v), value=bytes(v)) for k, v in keys])
        r = sized_call(stub.Put, req, timeout)
        return r.stored, r.already, r.rejected_full

    def serve(self, core, job, flags, count, body):
        dataset, chunk, pos = parse_tag(body, "put")
        result = core.put(job, _put_items(body, pos, count), dataset, chunk, replace=bool(flags & FLAG_REPLACE))
        return 3, [PUT_RESULT.pack(*result)]

    def serve_grpc(self, core, request):
        items = [(it.id, it.size, it.value) for it in request.items]
        stored, already, rejected = core.put(request.job, items, request.dataset,
                                             request.chunk if request.dataset else -1, request.replace)
        return pb.PutResponse(stored=stored, already=already, rejected_full=rejected)


class OpenFollower(Op):
    """A same-host reader is about to open a follower: the server flushes a large
    memtable so that the follower's replay is short."""
    name, code, feature, keyed = "open_follower", 7, "open_follower", False

    def frame(self, keys: Sequence = ()) -> Frame:
        return 0, [], 0

    def result(self, count: int, body: bytes) -> bool:
        return bool(body[0])

    def unserved(self, n: int) -> bool:
        return False  # no flush: the replay is only slower

    def serve(self, core, job, flags, count, body):
        return 0, [bytes([core.open_follower()])]


class Ping(Op):
    """The server's instance id: a Unix socket path may belong to a namesake.
    The data-plane server answers it itself (it knows its instance)."""
    name, code, keyed = "ping", 4, False

    def frame(self, keys: Sequence = ()) -> Frame:
        return 0, [], 0

    def result(self, count: int, body: bytes) -> str:
        return body.decode()


LOOKUP, CLAIM, ADOPT, GET, GET_LOCAL, PUT = Lookup(), Claim(), Adopt(), Get(), GetLocal(), Put()
RELEASE, OPEN_FOLLOWER, PING = Release(), OpenFollower(), Ping()
TABLE: dict[int, Op] = {op.code: op for op in (LOOKUP, CLAIM, RELEASE, ADOPT, GET, GET_LOCAL, PUT, OPEN_FOLLOWER,
                                               PING)}
UNARY_RPCS = tuple(op for op in TABLE.values() if op.rpc and op is not GET)  # Get streams its answer
# What a server announces in Info: the features of its operations and of their flags.
FEATURES = frozenset(op.feature for op in TABLE.values() if op.feature) | FLAG_FEATURES


# ---- shared pieces of the frames
def split_counted(body: memoryview, count: int) -> list[bytes]:
    """The `count` ids a frame declares; a body of another length is refused."""
    if len(body) != count * ID_LEN:
        raise BadRequest(f"{count} ids need {count * ID_LEN} bytes, frame has {len(body)}")
    return split_ids(body)


def tag_bytes(dataset: str, chunk: int) -> bytes:
    ds = dataset.encode()
    return _U16.pack(len(ds)) + ds + _I32.pack(chunk)


def parse_tag(body: memoryview, what: str) -> tuple[str, int, int]:
    """The (dataset, chunk) tag that heads put and adopt bodies, and where it ends."""
    if len(body) < 2:
        raise BadRequest(f"{what} frame too short for the dataset name")
    (ds_len,) = _U16.unpack_from(body, 0)
    pos = 2 + ds_len
    if len(body) < pos + 4:
        raise BadRequest(f"{what} frame too short for the chunk tag")
    dataset = bytes(body[2:pos]).decode()
    (chunk,) = _I32.unpack_from(body, pos)
    return dataset, chunk, pos + 4


def _put_items(body: memoryview, pos: int, count: int) -> list[tuple[bytes, int, memoryview]]:
    table_len = count * PUT_ENTRY.size
    if len(body) < pos + table_len:
        raise BadRequest(f"put frame too short for {count} item headers")
    items = []
    vpos = pos + table_len
    for i in range(count):
        key, size = PUT_ENTRY.unpack_from(body, pos + i * PUT_ENTRY.size)
        if vpos + size > len(body):
            raise BadRequest(f"items[{i}]: declared size {size} runs past the end of the frame")
        items.append((key, size, body[vpos:vpos + size]))
        vpos += size
    if vpos != len(body):
        raise BadRequest(f"put frame has {len(body) - vpos} bytes beyond its {count} declared items")
    return items


def values_frame(values: Sequence[Value | bool | None]) -> tuple[int, list]:
    """A GET answer; True (GET_LOCAL INLINE: read it from the files) goes as size LOCAL, with no bytes."""
    sizes = struct.pack(f"<{len(values)}I", *(MISS if v is None else LOCAL if v is True else len(v)
                                              for v in values))
    return len(values), [sizes, *(v for v in values if v is not None and v is not True)]


def values_of(count: int, body: bytes, start: int = 0) -> tuple[list[memoryview | None], list[int]]:
    """A GET answer's values (zero-copy views of the body, None for a miss) and
    the indices answered LOCAL (to be read from the store files), from byte `start` on
    (past a GET_LOCAL answer's generation: generation_of). A body its sizes
    do not fill exactly is a broken peer's (ProtocolError), not values cut short."""
    mv, pos = memoryview(body), start + 4 * count
    if len(body) < pos:
        raise ProtocolError(f"an answer of {count} values has {len(body) - start} bytes, too few for their sizes")
    out: list[memoryview | None] = []
    local: list[int] = []
    for i, size in enumerate(struct.unpack_from(f"<{count}I", body, start)):
        if size == MISS:
            out.append(None)
        elif size == LOCAL:
            out.append(None)
            local.append(i)
        else:
            out.append(mv[pos:pos + size])
            pos += size
    if pos != len(body):
        raise ProtocolError(f"an answer's {count} sizes add up to {pos - start - 4 * count} bytes of values, "
                            f"its body holds {len(body) - start - 4 * count}")
    return out, local


def generation_of(body: bytes) -> int:
    """The store's generation a GET_LOCAL answer with FLAG_GENERATION starts with; its values follow."""
    if len(body) < GENERATION.size:
        raise ProtocolError(f"a get_local answer of {len(body)} bytes has no room for its generation")
    return GENERATION.unpack_from(body)[0]


def grpc_values(values: Sequence[Value | None], message_bytes: int) -> Iterator[pb.GetResponse]:
    """A Get answer over gRPC: messages of about `message_bytes` of values each."""
    first, sizes, parts, size = 0, [], [], 0
    for i, v in enumerate(values):
        sizes.append(-1 if v is None else len(v))
        if v is not None:
            parts.append(v)
            size += len(v)
        if size >= message_bytes:
            yield pb.GetResponse(first=first, sizes=sizes, data=b"".join(parts))
            first, sizes, parts, size = i + 1, [], [], 0
    if sizes or not values:
        yield pb.GetResponse(first=first, sizes=sizes, data=b"".join(parts))
