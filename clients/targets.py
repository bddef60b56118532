"""Per-item targets (labels) for a digest: from class directories, as torchvision's
ImageFolder does, or from the user's own file mapping paths to labels.

Both give ``(targets, classes)``: an integer per item and the class names the
integers index. Integer labels in a user file are kept as they are, with no class
names (``classes`` empty)."""
from __future__ import annotations

import csv
import io
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

DIR = "dir"  # --targets dir: the class is the item's top-level directory
INT64 = (-2**63, 2**63 - 1)  # the range of integer labels (the digest stores targets as int64)


class TargetError(ValueError):
    """Targets cannot be derived; the message names the path or label at fault."""


def from_dirs(paths: Sequence[str]) -> tuple[list[int], list[str]]:
    """ImageFolder's convention: ``root/<class>/.../file``; classes sorted by name,
    class_to_idx = position. Only directories holding a selected file are classes."""
    tops = []
    for p in paths:
        top, sep, _ = p.partition("/")
        if not sep:
            raise TargetError(f"--targets dir: {p!r} is not inside a class directory "
                              "(expected ROOT/CLASS/FILE, as torchvision's ImageFolder)")
        tops.append(top)
    classes = sorted(set(tops))
    index = {c: k for k, c in enumerate(classes)}
    return [index[t] for t in tops], classes


def load_labels(path: str | Path) -> dict[str, str | int]:
    """A user's labels: a JSON object {relpath: label} or a CSV of ``path,label`` rows
    (a header row ``path,label`` is allowed)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8-sig")  # Excel's "CSV UTF-8" starts with a BOM
    except OSError as e:
        raise TargetError(f"cannot read labels file {path}: {e.strerror or e} (--targets takes 'dir' or "
                          "a labels file: a JSON object {path: label} or a CSV of path,label rows)") from None
    except UnicodeDecodeError as e:
        raise TargetError(f"labels file {path} is not UTF-8 text ({e.reason} at byte {e.start}): expected "
                          "a JSON object {path: label} or a CSV of path,label rows") from None
    if p.suffix.lower() == ".json":
        try:
            labels = json.loads(text)
        except ValueError as e:
            raise TargetError(f"labels file {path} is not valid JSON: {e}") from None
        if not isinstance(labels, dict):
            raise TargetError(f"labels file {path}: expected a JSON object {{path: label}}")
    else:
        labels = {}
        # newline="": csv.writer quotes a path holding a newline; splitting lines first would break it
        rows = csv.reader(io.StringIO(text, newline=""))
        for k, row in enumerate(rows, 1):
            if not row or (k == 1 and [c.strip().lower() for c in row] == ["path", "label"]):
                continue
            if len(row) != 2:
                raise TargetError(f"labels file {path}, line {rows.line_num}: expected 'path,label', got {row!r}")
            labels[row[0].strip()] = row[1].strip()
    for key, v in labels.items():
        if isinstance(v, bool) or not isinstance(v, (str, int)):
            raise TargetError(f"labels file {path}: label of {key!r} must be a string or an integer, got {v!r}")
    return labels


def from_labels(paths: Sequence[str], labels: Mapping[str, str | int],
                source: str = "labels file") -> tuple[list[int], list[str]]:
    """Each item's label by its path (every record of a file shares the file's label).
    All-integer labels (JSON ints, or CSV cells that parse as integers) are the targets;
    otherwise labels are class names, sorted, and targets index them."""
    missing = sorted({p for p in paths if p not in labels})
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise TargetError(f"{source} has no label for {', '.join(map(repr, missing[:3]))}{more}")
    values = [labels[p] for p in paths]
    ints = _as_ints(values)
    if ints is not None:
        big = next((p for p, t in zip(paths, ints) if not INT64[0] <= t <= INT64[1]), None)
        if big is not None:  # the digest's target column is int64: say so before any hashing, not after
            raise TargetError(f"{source}: label {labels[big]!r} of {big!r} is an integer outside the 64-bit range "
                              "that targets are stored in")
        return ints, []
    names = [str(v) for v in values]
    classes = sorted(set(names))
    index = {c: k for k, c in enumerate(classes)}
    return [index[v] for v in names], classes


def _as_ints(values: Sequence[str | int]) -> list[int] | None:
    out = []
    for v in values:
        if isinstance(v, int):
            out.append(v)
            continue
        try:
            out.append(int(v))
        except ValueError:
            return None
    return out


def derive(spec: str, paths: Sequence[str], labels: Mapping[str, str | int] | None = None
           ) -> tuple[list[int], list[str]]:
    """``--targets SPEC``: 'dir' or a labels file (``labels``: its contents, read already)."""
    if spec == DIR:
        return from_dirs(paths)
    return from_labels(paths, load_labels(spec) if labels is None else labels, f"labels file {spec}")
