"""The bytes of a transformed item: a small tagged format that never runs code.

A cached transformed item is read back by every job that shares its key, so it is
decoded with no pickle: only these types round-trip, anything else raises
Uncacheable (the pipeline is then computed, never cached):

    None, bool, int (64-bit), float, str, bytes, numpy arrays (no object dtype) and
    scalars, torch tensors (CPU, by their numpy form), PIL images, and lists, tuples
    and dicts (str/int keys) of these, nested at most MAX_DEPTH deep.

Layout: MAGIC, then one tagged value; lengths are little-endian. Arrays are stored
as dtype string, shape and raw C-order bytes; decoding copies them into writable
arrays. A malformed payload raises CodecError (a PoisonedValue-like failure: the
caller recomputes)."""
from __future__ import annotations

import struct
import sys
from typing import Any

import numpy as np

from .fingerprint import Uncacheable

MAGIC = b"MLT1"
MAX_DEPTH = 16
_U32, _U64, _I64, _F64 = struct.Struct("<I"), struct.Struct("<Q"), struct.Struct("<q"), struct.Struct("<d")


class CodecError(ValueError):
    """A payload that is not a well-formed encoding."""


def encode(obj: Any) -> bytes:
    """Bytes of a transformed item; raises Uncacheable naming the type that cannot be stored."""
    parts: list[bytes] = [MAGIC]
    _put(obj, parts, 0, "item")
    return b"".join(parts)


def _put_array(a: np.ndarray, parts: list[bytes], tag: bytes, path: str) -> None:
    if a.dtype.hasobject:
        raise Uncacheable(f"{path}: an array of Python objects cannot be cached")
    shape = a.shape  # ascontiguousarray makes a 0-d array (a numpy scalar's) 1-d
    a = np.ascontiguousarray(a)
    dt = a.dtype.str.encode()
    parts += [tag, bytes([len(dt)]), dt, bytes([len(shape)]), *(_U64.pack(n) for n in shape),
              _U64.pack(a.nbytes), a.tobytes()]


def _put(x: Any, parts: list[bytes], depth: int, path: str) -> None:
    if depth > MAX_DEPTH:
        raise Uncacheable(f"{path}: nested deeper than {MAX_DEPTH} levels")
    if x is None:
        parts.append(b"N")
    elif isinstance(x, bool):
        parts.append(b"T" if x else b"F")
    elif isinstance(x, int):
        if not -(1 << 63) <= x < (1 << 63):
            raise Uncacheable(f"{path}: int {x} does not fit in 64 bits")
        parts += [b"i", _I64.pack(x)]
    elif isinstance(x, float):
        parts += [b"f", _F64.pack(x)]
    elif isinstance(x, str):
        b = x.encode("utf-8", "surrogatepass")
        parts += [b"s", _U64.pack(len(b)), b]
    elif isinstance(x, (bytes, bytearray, memoryview)):
        parts += [b"b", _U64.pack(len(x)), bytes(x)]
    elif isinstance(x, np.ndarray):
        _put_array(x, parts, b"a", path)
    elif isinstance(x, np.generic):
        _put_array(np.asarray(x), parts, b"g", path)
    elif type(x).__module__ == "torch" and type(x).__name__ == "Tensor":
        _put_array(x.detach().cpu().numpy(), parts, b"t", path)
    elif type(x).__module__.startswith("PIL.") and hasattr(x, "tobytes") and hasattr(x, "mode"):
        mode = x.mode.encode()
        parts += [b"p", bytes([len(mode)]), mode, _U32.pack(x.size[0]), _U32.pack(x.size[1])]
        raw = x.tobytes()
        parts += [_U64.pack(len(raw)), raw]
    else:
        _put_compound(x, parts, depth, path)


def _put_compound(x: Any, parts: list[bytes], depth: int, path: str) -> None:
    if isinstance(x, (list, tuple)):
        parts += [b"l" if isinstance(x, list) else b"u", _U32.pack(len(x))]
        for k, v in enumerate(x):
            _put(v, parts, depth + 1, f"{path}[{k}]")
    elif isinstance(x, dict):
        parts += [b"d", _U32.pack(len(x))]
        for k, v in x.items():
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise Uncacheable(f"{path}: dict key {k!r} is not a str or int")
            _put(k, parts, depth + 1, path)
            _put(v, parts, depth + 1, f"{path}[{k!r}]")
    else:
        raise Uncacheable(f"{path}: a {type(x).__module__}.{type(x).__qualname__} cannot be cached "
                          f"(the transformed-item format stores arrays, tensors, images, numbers, "
                          f"strings, bytes and lists/tuples/dicts of them)")


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.mv, self.pos = memoryview(data), 0

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.mv):
            raise CodecError(f"payload ends early (wanted {n} bytes at offset {self.pos} of {len(self.mv)})")
        out = self.mv[self.pos:self.pos + n]
        self.pos += n
        return out

    def unpack(self, s: struct.Struct) -> Any:
        return s.unpack(self.take(s.size))[0]


def decode(data: bytes) -> Any:
    """The item encode() made; raises CodecError on anything else."""
    r = _Reader(data)
    if bytes(r.take(len(MAGIC))) != MAGIC:
        raise CodecError("not a transformed-item payload (bad magic)")
    x = _get(r, 0)
    if r.pos != len(r.mv):
        raise CodecError(f"{len(r.mv) - r.pos} stray bytes after the item")
    return x


def _get_array(r: _Reader) -> np.ndarray:
    dt = bytes(r.take(r.take(1)[0])).decode("ascii", "replace")
    try:
        dtype = np.dtype(dt)
    except TypeError:
        raise CodecError(f"unknown dtype {dt!r}") from None
    if dtype.hasobject:
        raise CodecError("object arrays are never decoded")
    shape = tuple(r.unpack(_U64) for _ in range(r.take(1)[0]))
    nbytes = r.unpack(_U64)
    if nbytes != int(np.prod(shape, dtype=np.uint64)) * dtype.itemsize:
        raise CodecError(f"array of shape {shape} and dtype {dt} cannot hold {nbytes} bytes")
    return np.frombuffer(r.take(nbytes), dtype=dtype).reshape(shape).copy()


def _get(r: _Reader, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise CodecError(f"nested deeper than {MAX_DEPTH} levels")
    tag = bytes(r.take(1))
    simple = {b"N": None, b"T": True, b"F": False}
    if tag in simple:
        return simple[tag]
    if tag == b"i":
        return r.unpack(_I64)
    if tag == b"f":
        return r.unpack(_F64)
    if tag == b"s":
        return bytes(r.take(r.unpack(_U64))).decode("utf-8", "surrogatepass")
    if tag == b"b":
        return bytes(r.take(r.unpack(_U64)))
    if tag in (b"a", b"g", b"t"):
        a = _get_array(r)
        return a if tag == b"a" else a[()] if tag == b"g" else _tensor(a)
    if tag == b"p":
        return _image(r)
    if tag in (b"l", b"u"):
        items = [_get(r, depth + 1) for _ in range(r.unpack(_U32))]
        return items if tag == b"l" else tuple(items)
    if tag == b"d":
        out = {}
        for _ in range(r.unpack(_U32)):
            k = _get(r, depth + 1)
            if not isinstance(k, (str, int)):
                raise CodecError(f"dict key of type {type(k).__name__}")
            out[k] = _get(r, depth + 1)
        return out
    raise CodecError(f"unknown tag {tag!r} at offset {r.pos - 1}")


def _tensor(a: np.ndarray) -> Any:
    torch = sys.modules.get("torch")
    if torch is None:
        import torch  # noqa: F811 - a tensor was stored, so torch is installed where it is read
    return torch.from_numpy(a)


def _image(r: _Reader) -> Any:
    from PIL import Image
    mode = bytes(r.take(r.take(1)[0])).decode("ascii", "replace")
    size = (r.unpack(_U32), r.unpack(_U32))
    raw = bytes(r.take(r.unpack(_U64)))
    try:
        return Image.frombytes(mode, size, raw)
    except ValueError as e:
        raise CodecError(f"bad image ({mode} {size}): {e}") from None
