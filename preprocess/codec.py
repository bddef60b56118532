"""The bytes of a transformed item: a small tagged format that never runs code.

A cached transformed item is read back by every job that shares its key, so it is
decoded with no pickle: only these types round-trip, anything else raises
Uncacheable (the pipeline is then computed, never cached):

    None, bool, int (64-bit), float, str, bytes, numpy arrays (no object dtype) and
    scalars, torch tensors (CPU, by their numpy form; a dtype numpy lacks, such as
    bfloat16, by its bits and its name), PIL images (palette images with their
    palette and transparency), and lists, tuples and dicts (str/int keys) of these,
    nested at most MAX_DEPTH deep.

Layout: MAGIC, then one tagged value; lengths are little-endian. Arrays are stored
as dtype string, shape and raw C-order bytes; decoding copies them into writable
arrays. A malformed payload raises CodecError (a PoisonedValue-like failure: the
caller recomputes)."""
from __future__ import annotations

import math
import struct
import sys
from typing import Any

import numpy as np

from .fingerprint import Uncacheable

MAGIC = b"MLT1"
MAX_DEPTH = 16
_U32, _U64, _I64, _F64 = struct.Struct("<I"), struct.Struct("<Q"), struct.Struct("<q"), struct.Struct("<d")
_PALETTE_MODES = ("P", "PA")  # pixels are indices into the image's palette


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
    if np.dtype(a.dtype.str) != a.dtype:  # a structured dtype's str is raw void: its fields would be lost
        raise Uncacheable(f"{path}: an array of dtype {a.dtype} cannot be cached")
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
    elif isinstance(x, np.generic):  # before float, str, bytes: np.float64 and np.str_ subclass them
        _put_array(np.asarray(x), parts, b"g", path)
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
        b = bytes(x)  # a memoryview's len() counts its items, not its bytes
        parts += [b"b", _U64.pack(len(b)), b]
    elif type(x) is np.ndarray or type(x) is np.memmap:  # subclasses (masked, matrix) would come back plain
        _put_array(x, parts, b"a", path)
    elif type(x).__module__ == "torch" and type(x).__name__ == "Tensor":
        _put_tensor(x, parts, path)
    elif type(x).__module__.startswith("PIL.") and hasattr(x, "tobytes") and hasattr(x, "mode"):
        _put_image(x, parts, depth, path)
    else:
        _put_compound(x, parts, depth, path)


def _put_tensor(x: Any, parts: list[bytes], path: str) -> None:
    # a quantized tensor's scale and zero point, a sparse tensor's indices, a nested
    # tensor's parts are not its bits: refused, never stored as something else
    if x.is_quantized or x.layout is not _strided() or x.is_meta or getattr(x, "is_nested", False):
        kind = "quantized" if x.is_quantized else "meta" if x.is_meta else "nested" if x.is_nested else str(x.layout)
        raise Uncacheable(f"{path}: a {kind} tensor cannot be cached")
    try:
        t = x.detach().cpu().resolve_conj().resolve_neg()
        a = t.numpy()
    except TypeError:  # a dtype numpy lacks (bfloat16, float8): below
        pass
    else:
        _put_array(a, parts, b"t", path)
        return
    import torch  # loaded: x is one of its tensors
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(t.element_size())
    try:
        if bits is None:
            raise TypeError(f"no integer type of {t.element_size()} bytes")
        a = t.contiguous().view(bits).numpy()
    except (TypeError, RuntimeError) as e:
        raise Uncacheable(f"{path}: a {t.dtype} tensor cannot be cached ({e})") from None
    name = str(t.dtype).removeprefix("torch.").encode()
    parts += [b"q", bytes([len(name)]), name]  # then its bits as an integer array, viewed back on decoding
    _put_array(a, parts, b"", path)


def _strided() -> Any:
    import torch  # loaded: only called for one of its tensors

    return torch.strided


def _put_image(x: Any, parts: list[bytes], depth: int, path: str) -> None:
    mode = x.mode.encode()
    palette = x.mode in _PALETTE_MODES
    parts += [b"P" if palette else b"p", bytes([len(mode)]), mode, _U32.pack(x.size[0]), _U32.pack(x.size[1])]
    raw = x.tobytes()
    parts += [_U64.pack(len(raw)), raw]
    if not palette:
        return
    # without the palette (and the transparent index or alphas, which convert() applies) the
    # indices mean nothing
    pmode = x.palette.mode if x.palette is not None else "RGB"
    colours = bytes(x.getpalette(pmode) or [])
    parts += [bytes([len(pmode)]), pmode.encode(), _U64.pack(len(colours)), colours]
    t = x.info.get("transparency")
    if not (t is None or isinstance(t, (int, bytes))) or isinstance(t, bool):
        raise Uncacheable(f"{path}: a palette image's transparency {t!r} cannot be cached")
    _put(t, parts, depth + 1, f"{path}.info['transparency']")


def _put_compound(x: Any, parts: list[bytes], depth: int, path: str) -> None:
    # exact types: a subclass (a namedtuple, a defaultdict) would be read back as the plain one
    if type(x) in (list, tuple):
        parts += [b"l" if type(x) is list else b"u", _U32.pack(len(x))]
        for k, v in enumerate(x):
            _put(v, parts, depth + 1, f"{path}[{k}]")
    elif type(x) is dict:
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
    try:
        x = _get(r, 0)
    except CodecError:
        raise
    except (ValueError, OverflowError) as e:  # bad UTF-8, a dtype of no size, an image too large: all malformed
        raise CodecError(f"malformed payload ({type(e).__name__}: {e})") from None
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
    if nbytes != math.prod(shape) * dtype.itemsize:  # Python ints: a product cannot wrap round to match
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
    if tag in (b"p", b"P"):
        return _image(r, depth, tag == b"P")
    if tag == b"q":
        return _raw_tensor(r)
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


def _torch() -> Any:
    torch = sys.modules.get("torch")
    if torch is None:
        import torch  # noqa: F811 - a tensor was stored, so torch is installed where it is read
    return torch


def _tensor(a: np.ndarray) -> Any:
    return _torch().from_numpy(a)


def _raw_tensor(r: _Reader) -> Any:
    """A tensor of a dtype numpy lacks: its name, then its bits as integers."""
    name = bytes(r.take(r.take(1)[0])).decode("ascii", "replace")
    a = _get_array(r)
    torch = _torch()
    dtype = getattr(torch, name, None) if name.isidentifier() else None
    if not isinstance(dtype, torch.dtype) or a.dtype.kind not in "iu" or dtype.itemsize != a.dtype.itemsize:
        raise CodecError(f"bad raw tensor: dtype {name!r} over {a.dtype}")
    return torch.from_numpy(a).view(dtype)


def _image(r: _Reader, depth: int, palette: bool) -> Any:
    from PIL import Image
    mode = bytes(r.take(r.take(1)[0])).decode("ascii", "replace")
    size = (r.unpack(_U32), r.unpack(_U32))
    raw = bytes(r.take(r.unpack(_U64)))
    if palette != (mode in _PALETTE_MODES):
        # also a palette image stored by the encoder before palettes were kept: recomputed, not served blank
        raise CodecError(f"{mode} image {'with' if palette else 'without'} a palette")
    try:
        img = Image.frombytes(mode, size, raw)
        if palette:
            pmode = bytes(r.take(r.take(1)[0])).decode("ascii", "replace")
            colours = bytes(r.take(r.unpack(_U64)))
            if colours:
                img.putpalette(colours, pmode)
            t = _get(r, depth + 1)
            if not (t is None or isinstance(t, (int, bytes))):
                raise ValueError(f"transparency {t!r}")
            if t is not None:
                img.info["transparency"] = t
        return img
    except ValueError as e:
        raise CodecError(f"bad image ({mode} {size}): {e}") from None
