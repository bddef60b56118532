"""The words every package shares: ids, cache modes, plan options, answer codes,
the protocol version and its feature names.

The ground floor: it imports nothing from the project, and cacheserver/,
manager/, clients/ and preprocess/ all take these words from here. The wire
codes equal the enums of cacheserver/proto/*.proto (tests/test_proto_stubs.py
checks that).
"""
from __future__ import annotations

from collections.abc import Sequence
from enum import Enum

# gRPC metadata in which a caller declares its request message's size (grpcadmit.py).
BODY_BYTES_HEADER = "x-mlcache-body-bytes"

# ---- ids: 32 bytes, derived by the client from content digests; the server
# only checks their shape.
ID_LEN = 32


class BadRequest(ValueError):
    """A request refused as a whole; the message names what is wrong."""


def split_ids(blob: bytes | memoryview, what: str = "ids") -> list[bytes]:
    """Split concatenated ids; a length that is not a multiple of ID_LEN is refused."""
    n = len(blob)
    if n % ID_LEN:
        raise BadRequest(f"{what}: {n} bytes is not a whole number of {ID_LEN}-byte ids")
    b = bytes(blob)
    return [b[i:i + ID_LEN] for i in range(0, n, ID_LEN)]


def check_ids(ids: Sequence[bytes], error: type[Exception] = BadRequest, what: str = "ids") -> None:
    """Refuse an id of the wrong length, naming its index."""
    for i, k in enumerate(ids):
        if len(k) != ID_LEN:
            raise error(f"{what}[{i}]: expected a {ID_LEN}-byte id, got {len(k)} bytes")


# ---- cache modes: per job, applied by the servers (bypass: every lookup misses).
def transformed_tag(dataset_tag: str, fingerprint: str) -> str:
    """The dataset name a pipeline's transformed items are inserted under (clients)
    and allocated as (manager): the dataset's tag, then the prefix fingerprint."""
    return f"{dataset_tag}+t{fingerprint[:16]}"


def source_tag(tag: str) -> str:
    """The dataset a transformed tag derives from (a plain dataset tag is its own)."""
    return tag.split("+t", 1)[0]


class CacheMode(str, Enum):
    NORMAL = "normal"
    BYPASS = "bypass"

    @property
    def code(self) -> int:
        """The wire value (cache.proto CacheMode)."""
        return _MODE_CODES[self]

    @classmethod
    def of_code(cls, code: int) -> "CacheMode":
        """The mode of a wire value; ValueError names an unknown one."""
        for mode, c in _MODE_CODES.items():
            if c == code:
                return mode
        raise ValueError(f"unknown cache mode {code}")


_MODE_CODES = {CacheMode.NORMAL: 0, CacheMode.BYPASS: 1}


# ---- plan options: what the manager allocates to a dataset.
class Option(str, Enum):
    FULL = "full"         # the whole dataset resident
    CHUNKED = "chunked"   # two chunks resident (double buffering)
    NONE = "none"         # no room of its own

    @property
    def code(self) -> int:
        """The wire value (manager.proto CacheOption)."""
        return _OPTION_CODES[self]

    @classmethod
    def of_code(cls, code: int, default: "Option | None" = None) -> "Option":
        for opt, c in _OPTION_CODES.items():
            if c == code:
                return opt
        if default is not None:
            return default
        raise ValueError(f"unknown cache option {code}")


_OPTION_CODES = {Option.NONE: 0, Option.CHUNKED: 1, Option.FULL: 2}

# ---- answer codes, one byte per id.
# Lookup: ABSENT / HIT, and with the pending flag PENDING for an absent id
# another job is reading from the store now.
ABSENT, HIT, PENDING = 0, 1, 2
# Claim (before reading misses from the store): FETCH (yours: read and insert
# it), WAIT (another job is reading it), PRESENT (already cached: get it).
FETCH, WAIT, PRESENT = 1, 2, 3

# ---- protocol: the version and the features a server announces in Info.
# A client decides what it may ask by these names (ServerClient.supports),
# never by the text of an error. An operation only newer servers serve names
# its feature in its declaration (ops.py), and ops.FEATURES, what a server
# announces, is built from the op table plus the features of flags below.
PROTOCOL_VERSION = 2
FEATURE_PENDING = "lookup_pending"       # Lookup pending / FLAG_PENDING
FEATURE_NOT_SPARE = "lookup_not_spare"   # Lookup not_spare / FLAG_NOT_SPARE
FEATURE_INLINE = "get_local_inline"      # OP_GET_LOCAL with FLAG_INLINE
FEATURE_LOCAL_GEN = "get_local_generation"  # OP_GET_LOCAL with FLAG_INLINE | FLAG_GENERATION
FLAG_FEATURES = frozenset({FEATURE_PENDING, FEATURE_NOT_SPARE, FEATURE_INLINE, FEATURE_LOCAL_GEN})
# announced only by a server whose store holds plaintext records (datadir.py, an embedded cache):
# a record format, not an operation, so clients check it before anything else
PLAIN_RECORDS = "plain_records"
