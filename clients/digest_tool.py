"""Implementation of ``tools/digest``: create, inspect and verify digest files.

Exit codes: 0 success, 1 failure (unreadable or bad data, missing source,
verification mismatch), 2 usage error (bad command line).
"""

from __future__ import annotations

import argparse
import datetime
import difflib
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from cacheserver.sizes import format_size
from clients import crc32c, targets
from clients.digest import Digest, DigestBuilder, DigestError, Kind
from clients.digest_scan import Scanned, check_range_support, probe_range_support, scan_files
from clients.digest_source import SourceFile, ToolError, is_local, list_source, open_source
from clients.digest_verify import verify_digest

TOOL = "mlcache tools/digest 2"  # 2: HTTP entries are names, quoted on read (digest_paths.listed_names)
EXIT_FAIL = 1
EXIT_USAGE = 2
MAX_REPORTED = 50  # problems printed by verify before summarising


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


# -- command line ----------------------------------------------------------------


def _storage_option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:  # JSON values allow anon=true, block_size=1024, client_kwargs={...}
        return key, json.loads(value)
    except ValueError:
        return key, value


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return n


def _add_storage_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--storage-option", "-s", metavar="KEY=VALUE", action="append", default=[],
                   type=_storage_option,
                   help="fsspec storage option (repeatable); VALUE is parsed as JSON when it can be, "
                        "e.g. token=anon, anon=true, endpoint_url=http://...")


def _create_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        usage=f"{prog} [create] SRC -o FILE [options]\n"
              f"       {prog} info FILE [--json]\n"
              f"       {prog} verify FILE [--sample N] [options]",
        description="Hash every item of a dataset into a digest file "
                    f"('{prog} info -h' and '{prog} verify -h' for the other commands).",
        epilog="SRC is a local directory or an fsspec URL (gs://, s3://, http(s)://, memory://). "
               "Exit codes: 0 ok, 1 failure, 2 usage error.")
    p.add_argument("src", metavar="SRC", help="dataset directory, prefix or single file")
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="digest file to write")
    p.add_argument("--format", "-f", choices=[k.value for k in Kind], default="files",
                   help="files: one item per file; tfrecord: one per record; tar: one per member "
                        "(default: files)")
    p.add_argument("--workers", "-j", type=_positive, default=None, metavar="N",
                   help="parallel hashers (default: cores for local SRC, 4 x cores and at least "
                        "8 for remote URLs): threads, except processes for local tfrecord/tar, "
                        "whose record framing is parsed in Python under the GIL")
    p.add_argument("--include", metavar="GLOB", action="append", default=[],
                   help="only files whose relative path matches (repeatable; default for tar: *.tar)")
    p.add_argument("--exclude", metavar="GLOB", action="append", default=[],
                   help="skip files whose relative path matches (repeatable)")
    p.add_argument("--no-crc", action="store_true", help="skip TFRecord data CRC checks")
    p.add_argument("--targets", metavar="dir|FILE", default=None,
                   help="record a target (label) per item: 'dir' = the item's top-level directory "
                        "is its class (torchvision ImageFolder: classes sorted by name); FILE = a JSON "
                        "object {relpath: label} or a CSV of path,label rows")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    _add_storage_options(p)
    return p


def _info_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"{prog} info", description="Print a digest file's header and totals.")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    return p


def _verify_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"{prog} verify",
        description="Re-read items from the store and compare each one's size and SHA-256 with the "
                    "digest, and its BLAKE3 too in a format-3 digest (which tools/digest writes).",
        epilog="Exit codes: 0 all match, 1 mismatches or errors (each named), 2 usage error.")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--sample", type=_positive, metavar="N", help="check N random items instead of all")
    p.add_argument("--seed", type=int, help="random seed for --sample")
    p.add_argument("--workers", "-j", type=_positive, default=None, metavar="N",
                   help="parallel readers, threads (default: cores for a local store, 4 x cores and at "
                        "least 8 for a remote one)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    _add_storage_options(p)
    return p


def _load_labels(spec: str | None) -> dict[str, str | int] | None:
    """The labels file of --targets FILE, read before the scan."""
    if spec is None or spec == targets.DIR:
        return None
    try:
        return targets.load_labels(spec)
    except targets.TargetError as e:
        raise ToolError(str(e)) from None


def _targets_for(spec: str | None, labels: dict[str, str | int] | None,
                 paths: list[str]) -> tuple[list[int] | None, list[str]]:
    """(targets, classes) of --targets for these paths (files, then items); (None, [])
    without it. Every item of a file shares the file's label, so the listed files alone
    show any path --targets cannot label."""
    if spec is None:
        return None, []
    try:
        return targets.derive(spec, paths, labels)
    except targets.TargetError as e:
        raise ToolError(str(e)) from None


def _worker_kind(local: bool, kind: Kind, workers: int) -> str:
    if workers == 1:
        return "process"
    return "processes" if local and kind is not Kind.FILES else "threads"


def _check_output(out: Path, parser: argparse.ArgumentParser) -> None:
    """Refuse an output the digest could not be saved to before hashing, not after."""
    if out.is_dir():
        parser.error(f"output {str(out)!r} is a directory; -o takes the digest file to write")
    if not out.parent.is_dir():
        parser.error(f"output directory {str(out.parent)!r} does not exist")
    try:  # as Digest.save will: a temp file beside the output
        fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        raise ToolError(f"cannot write {out}: {e.strerror or e}") from None


def _without_output(files: list[SourceFile], out: Path) -> list[SourceFile]:
    """files less the digest being written and Digest.save's temp files, when SRC holds
    them: a second run would digest the first one's output, which it then replaces."""
    where = os.path.realpath(out.parent)
    prefix = f".{out.name}."  # mkstemp's: not a glob, which '[' in the name would make a class

    def ours(f: SourceFile) -> bool:
        name = os.path.basename(f.path)
        temp = name.startswith(prefix) and name.endswith(".tmp") and len(name) > len(prefix) + 4
        return (name == out.name or temp) and os.path.realpath(os.path.dirname(f.path)) == where
    return [f for f in files if not ours(f)]


def _save(digest: Digest, out: Path) -> None:
    try:
        digest.save(out)
    except OSError as e:  # e.g. a full disk: name the output, not save's temp file
        raise ToolError(f"cannot write {out}: {e.strerror or e}") from None


def _add_scanned(builder: DigestBuilder, files: list[SourceFile], scanned: Scanned) -> None:
    """Add the scanned items to builder in file order, dropping each job's items once added:
    the items are held once, not twice."""
    scanned.reverse()
    while scanned:
        batch, items = scanned.pop()
        for k, i in enumerate(batch):
            builder.add_many(files[i].rel, *items.columns(items.file(k)))
        del items  # not held on through build and save


def cmd_create(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    out = Path(args.output)
    _check_output(out, parser)
    kind = Kind(args.format)
    so = dict(args.storage_option)
    fs, base = open_source(args.src, so)
    includes = args.include or (["*.tar"] if kind is Kind.TAR else [])
    local = is_local(fs)
    # A progress bar: a listing can take long (millions of objects, or retries when unreachable).
    root, files = list_source(fs, base, args.src, includes, args.exclude, args.quiet)
    if local:
        files = _without_output(files, out)
        if not files:
            raise ToolError(f"empty dataset: no file under {args.src} but the digest {out}")
    workers = args.workers or (cpu_count() if local else max(8, 4 * cpu_count()))
    workers = min(workers, len(files))
    if kind is Kind.TFRECORD and not args.no_crc and not crc32c.FAST:
        print("digest: warning: google-crc32c is not installed; checking TFRecord CRCs in pure "
              "Python is slow (pip install google-crc32c, or pass --no-crc)", file=sys.stderr)
    if not local and kind is not Kind.FILES:
        probe_range_support(fs, root, files)
    labels = _load_labels(args.targets)
    _targets_for(args.targets, labels, [f.rel for f in files])  # a wrong --targets fails before hashing
    t0 = time.perf_counter()
    scanned = scan_files(fs, files, kind.value, workers, not args.no_crc, args.quiet)
    elapsed = time.perf_counter() - t0
    if not local and kind is not Kind.FILES:
        check_range_support(fs, root, files, scanned)
    builder = DigestBuilder(fs.unstrip_protocol(root), kind, {
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "tool": TOOL})
    _add_scanned(builder, files, scanned)
    if not len(builder):
        raise ToolError(f"empty dataset: {len(files)} file(s) under {args.src} hold no {kind.value} items")
    # Targets by path (every item of a file has the file's label): no string per item.
    paths, path_index = builder.path_table()
    found, classes = _targets_for(args.targets, labels, paths)
    digest = builder.build(None if found is None else np.asarray(found, np.int64)[path_index], classes)
    del builder
    _save(digest, out)
    nbytes = digest.total_bytes
    print(f"digest: wrote {out}: {len(digest)} items in {len(files)} files, {format_size(nbytes)} "
          f"hashed in {elapsed:.3f} s ({format_size(nbytes / max(elapsed, 1e-9))}/s, "
          f"{workers} {_worker_kind(local, kind, workers)})",
          file=sys.stderr)
    return 0


def _info_dict(path: str, d: Digest) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    if d.targets is not None:
        extra["targets"] = f"{len(d.classes)} classes" if d.classes else "integers"
    if d.has_names:
        extra["names"] = "yes"
    return {"file": path, "format_version": d.version, "kind": d.kind.value, "root": d.root,
            "items": len(d), "paths": d.num_paths, "total_bytes": d.total_bytes, **extra,
            "fingerprint": d.fingerprint.hex(), **{f"meta.{k}": v for k, v in sorted(d.meta.items())}}


def cmd_info(args: argparse.Namespace) -> int:
    d = Digest.load(args.file)
    info = _info_dict(args.file, d)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    info["total_bytes"] = f"{format_size(d.total_bytes)} ({d.total_bytes} bytes)"
    width = max(map(len, info))
    for k, v in info.items():
        print(f"{k + ':':<{width + 1}} {v}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    d = Digest.load(args.file)
    fs, base = open_source(d.root, dict(args.storage_option))
    n = len(d)
    indices: Sequence[int] = range(n)
    if args.sample is not None and args.sample < n:
        indices = sorted(random.Random(args.seed).sample(range(n), args.sample))
    workers = args.workers or (cpu_count() if is_local(fs) else max(8, 4 * cpu_count()))
    problems = verify_digest(d, fs, base, indices, workers, args.quiet)
    if problems:
        for p in problems[:MAX_REPORTED]:
            print(f"verify: {p}", file=sys.stderr)
        if len(problems) > MAX_REPORTED:
            print(f"verify: ... and {len(problems) - MAX_REPORTED} more", file=sys.stderr)
        print(f"verify: FAILED: {len(problems)} problem(s) in {len(indices)} checked items of {args.file}",
              file=sys.stderr)
        return EXIT_FAIL
    print(f"verify: OK: {len(indices)} of {n} items match {d.root}")
    return 0


def _misspelled_command(word: str, commands: Collection[str]) -> str | None:
    """The command `word` looks like a typo of, if it cannot be a SRC.

    An existing path always wins, and URLs or anything with a path separator
    are always sources: `digest ./inf -o x` with no `./inf` reports "source
    not found", not a typo.
    """
    if word.startswith("-") or "://" in word or "/" in word or os.sep in word or os.path.lexists(word):
        return None
    close = difflib.get_close_matches(word, commands, n=1, cutoff=0.6)
    return close[0] if close else None


def main(argv: Sequence[str] | None = None, prog: str = "digest") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands: dict[str, Callable[[str], argparse.ArgumentParser]] = {
        "info": _info_parser, "verify": _verify_parser, "create": _create_parser}
    implied = not (argv and argv[0] in commands)
    cmd = "create" if implied else argv[0]
    if not implied:
        argv = argv[1:]
    parser = commands[cmd](prog)
    try:
        if implied and argv:  # after an explicit `create`, argv[0] is a SRC whatever its name
            typo = _misspelled_command(argv[0], commands)
            if typo:
                parser.error(f"unknown command {argv[0]!r} (did you mean {typo!r}?)")
        args = parser.parse_args(argv)
        if cmd == "info":
            return cmd_info(args)
        if cmd == "verify":
            return cmd_verify(args)
        return cmd_create(args, parser)
    except SystemExit as e:  # argparse: --help (0) or usage error (2)
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    except (ToolError, DigestError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return EXIT_FAIL
    except OSError as e:  # e.g. the digest file to read is missing
        where = f": {e.filename}" if e.filename is not None else ""  # not ': None'
        print(f"{prog}: error: {e.strerror or e}{where}", file=sys.stderr)
        return EXIT_FAIL
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
