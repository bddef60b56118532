"""What a step's input and output are: their size in bytes, their kind (type and
rank, which AutoOrder never moves a step across) and whether two outputs agree."""
from __future__ import annotations

from typing import Any

import numpy as np


def nbytes(x: Any) -> int:
    """Bytes an item occupies as data (not Python object overhead), summed over
    tuples, lists and dict values; unknown objects count as 0."""
    if isinstance(x, (bytes, bytearray, memoryview)):
        return len(x)
    if isinstance(x, np.ndarray):
        return int(x.nbytes)
    n = getattr(x, "nbytes", None)  # torch tensors too (numel * element size)
    if isinstance(n, int):
        return n
    if _is_tensor(x):
        return int(x.numel() * x.element_size())
    if isinstance(x, (tuple, list)):
        return sum(nbytes(v) for v in x)
    if isinstance(x, dict):
        return sum(nbytes(v) for v in x.values())
    if isinstance(x, str):
        return len(x)
    size = getattr(x, "size", None)  # PIL images: width x height x bands
    bands = getattr(x, "getbands", None)
    if isinstance(size, tuple) and len(size) == 2 and callable(bands):
        return int(size[0] * size[1] * len(bands()))
    return 0


def kind(x: Any) -> tuple[str, int]:
    """(container type, rank): a step whose output differs in either from its input
    changes type or rank (decoding, flattening) and stays where it was written."""
    if isinstance(x, (tuple, list)):
        return (type(x).__name__, len(x))
    if isinstance(x, np.ndarray) or _is_tensor(x):
        return ("array", x.ndim)
    if isinstance(x, (bytes, bytearray, memoryview, str)):
        return (type(x).__name__, 1)
    if hasattr(x, "getbands"):  # PIL image: rank 3 like the array it becomes
        return ("array", 3)
    return (type(x).__name__, 0)


def _is_tensor(x: Any) -> bool:
    return type(x).__module__ == "torch" and hasattr(x, "numel")


def as_array(x: Any) -> np.ndarray | None:
    if isinstance(x, np.ndarray):
        return x
    if _is_tensor(x):
        return x.detach().cpu().numpy()
    if hasattr(x, "getbands"):
        return np.asarray(x)
    return None


def agree(a: Any, b: Any, rel_tol: float = 0.01) -> bool:
    """Do two outputs agree: same structure, shapes and dtypes, and numbers within
    rel_tol of the larger magnitude (reordering steps may round differently:
    resizing uint8 then converting vs converting then resizing)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(agree(x, y, rel_tol) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(agree(a[k], b[k], rel_tol) for k in a)
    xa, xb = as_array(a), as_array(b)
    if xa is None or xb is None:
        return a == b
    if xa.shape != xb.shape or xa.dtype != xb.dtype:
        return False
    if xa.size == 0:
        return True
    fa, fb = xa.astype(np.float64), xb.astype(np.float64)
    scale = max(float(np.abs(fa).max()), float(np.abs(fb).max()), 1e-12)
    return float(np.abs(fa - fb).max()) <= rel_tol * scale


def same(a: Any, b: Any) -> bool:
    """Exactly equal outputs (the determinism check)."""
    return agree(a, b, rel_tol=0.0)
