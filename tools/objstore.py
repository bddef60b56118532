#!/usr/bin/env python3
"""A bandwidth- and latency-capped HTTP object store serving a local directory.

Stands in for slow shared cloud storage (GCS/S3) in the demo, the benchmarks
and the tests: every object read pays a fixed first-byte latency, and all
object bytes go through one store-wide token bucket, so concurrent readers
share the aggregate bandwidth the way clients of a throttled bucket do. An
optional per-connection cap models the per-stream limit of real stores.

Objects are the files under ``root``; ``GET``/``HEAD /a/b.bin`` serves
``root/a/b.bin`` with single-range support (``bytes=a-b``, ``bytes=a-``,
``bytes=-n``). A directory URL returns an HTML index of ``<a href>`` links, which
is what fsspec's ``HTTPFileSystem`` parses for ``ls``/``find``.
``GET /_stats`` returns ``{"requests", "bytes_served", "by_status", "by_path"}``
as JSON and ``POST /_stats/reset`` zeroes the counters (answering with the
counters as they were just before).

Module use (tests and benchmarks put ``tools/`` on ``sys.path``)::

    import objstore
    with objstore.ObjectStore(root, bandwidth="200MB", latency="20ms") as store:
        fs = fsspec.filesystem("http")
        fs.cat_file(store.url + "/shard-0.bin", 0, 4096)
        print(store.stats()["bytes_served"])

    proc, url = objstore.spawn(root, bandwidth="200MB")   # separate process
    ...; proc.terminate(); proc.wait()

Command line::

    python tools/objstore.py --root DIR [--host 127.0.0.1] [--port 0]
        [--bandwidth 200MB] [--latency 20ms] [--per-connection-bandwidth 50MB]

prints ``READY http://HOST:PORT`` on stdout once listening and runs until
SIGTERM or SIGINT, then exits 0.
"""
from __future__ import annotations

import argparse
import asyncio
import email.utils
import html
import os
import re
import selectors
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import weakref
from urllib.parse import quote, unquote

from aiohttp import web

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
try:
    from cacheserver.sizes import parse_size
except ImportError:  # run as a script, or imported with only tools/ on sys.path
    sys.path.insert(0, _REPO_ROOT)
    from cacheserver.sizes import parse_size

__all__ = ["ObjectStore", "TokenBucket", "spawn", "parse_bandwidth", "parse_duration"]

DEFAULT_CHUNK = 256 * 1024
MIN_CHUNK = 16 * 1024
STATS_PATH = "/_stats"
STATS_RESET_PATH = "/_stats/reset"


# ---------------------------------------------------------------- parsing

def parse_bandwidth(value: str | int | float | None) -> float | None:
    """Bytes per second from ``"200MB"``, ``"1GiB/s"``, ``200_000_000``; ``None``,
    ``0``, ``"0"``, ``"none"`` and ``"unlimited"`` mean no cap."""
    if value is None:
        return None
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"bandwidth must not be negative: {value}")
        return float(value) or None
    text = value.strip()
    if text.lower() in ("", "none", "unlimited", "inf", "off"):
        return None
    if text.lower().endswith("/s"):
        text = text[:-2]
    return float(parse_size(text)) or None


_DURATION_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(us|µs|ms|s|m)?\s*$", re.IGNORECASE)
_DURATION_UNITS = {"us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, None: 1.0}


def parse_duration(value: str | int | float | None) -> float:
    """Seconds from ``"20ms"``, ``"0.5s"``, ``"500us"``, or a number of seconds."""
    if value is None:
        return 0.0
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"duration must not be negative: {value}")
        return float(value)
    m = _DURATION_RE.match(value)
    if not m:
        raise ValueError(f"not a duration: {value!r} (expected e.g. 20ms, 0.5s)")
    unit = m.group(2).lower() if m.group(2) else None
    return float(m.group(1)) * _DURATION_UNITS[unit]


# ---------------------------------------------------------------- pacing

class TokenBucket:
    """Byte pacer for one event loop (GCRA form of a token bucket).

    Each ``consume(n)`` reserves the next ``n / rate`` seconds of the link and
    sleeps until that reservation is within ``burst`` bytes of now, so over any
    interval ``T`` at most ``rate * T + burst`` bytes pass, however many
    coroutines share the bucket. Reservations are first come, first served, so
    readers taking turns with equal chunks get equal shares."""

    def __init__(self, rate: float, burst: int):
        if rate <= 0:
            raise ValueError("rate must be positive")
        self.rate = float(rate)
        self.burst = max(1, int(burst))
        self._tolerance = self.burst / self.rate
        self._tat = 0.0  # theoretical arrival time of the next byte

    def reserve(self, n: int) -> float:
        """Reserve ``n`` bytes; returns how long to wait before sending them."""
        now = time.monotonic()
        self._tat = max(self._tat, now) + n / self.rate
        return self._tat - now - self._tolerance

    async def consume(self, n: int) -> None:
        delay = self.reserve(n)
        if delay > 0:
            await asyncio.sleep(delay)


def _chunk_for(rate: float | None, chunk_size: int) -> int:
    """Chunk size for a paced stream: at most 1/50 s of the rate, so pacing is
    smooth at low rates, but not below 16 KiB."""
    if rate is None:
        return chunk_size
    return max(MIN_CHUNK, min(chunk_size, int(rate / 50)))


# ---------------------------------------------------------------- stats

class _Stats:
    def __init__(self):
        self._lock = threading.Lock()
        self._zero()

    def _zero(self):
        self.requests = 0
        self.bytes_served = 0
        self.by_status: dict[str, int] = {}
        self.by_path: dict[str, dict[str, int]] = {}

    def request(self, path: str) -> None:
        with self._lock:
            self.requests += 1
            entry = self.by_path.get(path)
            if entry is None:
                entry = self.by_path[path] = {"requests": 0, "bytes": 0}
            entry["requests"] += 1

    def status(self, code: int) -> None:
        with self._lock:
            key = str(code)
            self.by_status[key] = self.by_status.get(key, 0) + 1

    def sent(self, path: str, n: int) -> None:
        with self._lock:
            self.bytes_served += n
            entry = self.by_path.get(path)
            if entry is None:
                entry = self.by_path[path] = {"requests": 0, "bytes": 0}
            entry["bytes"] += n

    def snapshot(self, by_path: bool = True, reset: bool = False) -> dict:
        with self._lock:
            out = {"requests": self.requests, "bytes_served": self.bytes_served,
                   "by_status": dict(self.by_status)}
            if by_path:
                out["by_path"] = {p: dict(e) for p, e in self.by_path.items()}
            if reset:
                self._zero()
            return out


# ---------------------------------------------------------------- ranges

class _Unsatisfiable(Exception):
    pass


_RANGE_RE = re.compile(r"^\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*$", re.IGNORECASE)


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """``(start, end_exclusive)`` for a single-range ``Range`` header, ``None``
    to serve the whole object (no header, a multi-range or malformed header:
    RFC 9110 lets a server ignore those), or raises ``_Unsatisfiable`` (416)."""
    if not header:
        return None
    m = _RANGE_RE.match(header)
    if not m:
        return None
    first, last = m.group(1), m.group(2)
    if first == "" and last == "":
        return None
    if first == "":  # suffix: the last n bytes
        n = int(last)
        if n == 0 or size == 0:
            raise _Unsatisfiable
        return max(0, size - n), size
    start = int(first)
    if last != "" and int(last) < start:
        return None  # invalid range-spec: ignore the header
    if start >= size:
        raise _Unsatisfiable
    end = size if last == "" else min(size, int(last) + 1)
    return start, end


# ---------------------------------------------------------------- server

class _Forbidden(Exception):
    pass


class _Server:
    """The aiohttp server and its limits; lives on one event loop."""

    def __init__(self, root: str, *, bandwidth=None, latency=0.0,
                 per_connection_bandwidth=None, chunk_size: int = DEFAULT_CHUNK,
                 follow_symlinks: bool = False):
        self.root = os.path.realpath(root)
        if not os.path.isdir(self.root):
            raise FileNotFoundError(f"object store root is not a directory: {root}")
        self.bandwidth = parse_bandwidth(bandwidth)
        self.per_connection_bandwidth = parse_bandwidth(per_connection_bandwidth)
        self.latency = parse_duration(latency)
        self.follow_symlinks = follow_symlinks
        if int(chunk_size) < 1:  # a 0-byte chunk would send no body after its Content-Length
            raise ValueError(f"chunk size must be at least 1 byte: {chunk_size}")
        rates = [r for r in (self.bandwidth, self.per_connection_bandwidth) if r]
        self.chunk_size = _chunk_for(min(rates) if rates else None, int(chunk_size))
        self.stats = _Stats()
        self._bucket: TokenBucket | None = None
        # One bucket per connection (its transport), dropped when the connection is.
        self._conn_buckets: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._runner: web.ServerRunner | None = None

    # -- lifecycle (on the loop) --

    async def start(self, sock: socket.socket) -> None:
        if self.bandwidth:
            self._bucket = TokenBucket(self.bandwidth, self.chunk_size)
        server = web.Server(self._handle, access_log=None)
        self._runner = web.ServerRunner(server, handle_signals=False, shutdown_timeout=0.25)
        await self._runner.setup()
        site = web.SockSite(self._runner, sock, backlog=1024)
        await site.start()

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- request handling --

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        raw_path = request.rel_url.raw_path
        if raw_path == STATS_PATH or raw_path == STATS_RESET_PATH:
            return self._handle_stats(request, raw_path)
        if request.method not in ("GET", "HEAD"):
            return self._plain(405, "method not allowed", headers={"Allow": "GET, HEAD"})
        try:
            segments = self._segments(raw_path)
        except _Forbidden:
            self.stats.request(raw_path)
            return self._plain(403, "forbidden")
        rel = "/".join(segments)
        self.stats.request(rel)
        if self.latency:
            await asyncio.sleep(self.latency)
        try:
            path = self._resolve(segments)
        except _Forbidden:
            return self._plain(403, "forbidden")
        try:
            st = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            return self._plain(404, "not found")
        except OSError:
            return self._plain(403, "forbidden")
        if stat.S_ISDIR(st.st_mode):
            return self._listing(request, path, segments)
        if not stat.S_ISREG(st.st_mode):
            return self._plain(403, "forbidden")
        return await self._send_file(request, path, rel, st)

    def _plain(self, status: int, text: str, headers: dict | None = None) -> web.Response:
        self.stats.status(status)
        return web.Response(status=status, text=text + "\n", headers=headers)

    def _handle_stats(self, request: web.BaseRequest, raw_path: str) -> web.Response:
        by_path = request.query.get("by_path", "1") not in ("0", "false", "no")
        if raw_path == STATS_PATH and request.method in ("GET", "HEAD"):
            body = self.stats.snapshot(by_path=by_path)
        elif raw_path == STATS_RESET_PATH and request.method == "POST":
            body = self.stats.snapshot(by_path=by_path, reset=True)
        else:
            allow = "GET, HEAD" if raw_path == STATS_PATH else "POST"
            return web.Response(status=405, text="method not allowed\n", headers={"Allow": allow})
        return web.json_response(body, headers={"Cache-Control": "no-store"})

    @staticmethod
    def _segments(raw_path: str) -> list[str]:
        out = []
        for part in raw_path.split("/"):
            if part == "":
                continue
            try:
                name = unquote(part, errors="strict")
            except UnicodeDecodeError:
                raise _Forbidden from None
            if name in (".", "..") or "/" in name or "\\" in name or "\x00" in name:
                raise _Forbidden
            out.append(name)
        return out

    def _resolve(self, segments: list[str]) -> str:
        path = os.path.join(self.root, *segments)
        if not self.follow_symlinks:
            real = os.path.realpath(path)
            if real != self.root and not real.startswith(self.root + os.sep):
                raise _Forbidden
        return path

    def _listing(self, request: web.BaseRequest, path: str, segments: list[str]) -> web.Response:
        base = "/" + "".join(quote(s, safe="") + "/" for s in segments)
        entries = []
        try:
            with os.scandir(path) as it:
                for e in it:
                    try:
                        quote(e.name)  # a name that is not UTF-8 has no URL here (nor in GCS/S3)
                        is_dir = e.is_dir()
                        if not is_dir and not e.is_file():
                            continue
                        if not self.follow_symlinks and e.is_symlink():
                            self._resolve(segments + [e.name])
                    except (OSError, _Forbidden, UnicodeEncodeError):
                        continue
                    entries.append((e.name, is_dir))
        except OSError:
            return self._plain(403, "forbidden")
        entries.sort()
        title = html.escape(base)
        lines = ["<!DOCTYPE html>", "<html><head><meta charset=\"utf-8\">",
                 f"<title>Index of {title}</title></head><body>",
                 f"<h1>Index of {title}</h1>", "<ul>"]
        for name, is_dir in entries:
            slash = "/" if is_dir else ""
            href = base + quote(name, safe="") + slash
            lines.append(f'<li><a href="{href}">{html.escape(name)}{slash}</a></li>')
        lines.append("</ul></body></html>")
        self.stats.status(200)
        body = "\n".join(lines).encode()
        return web.Response(body=body, content_type="text/html", charset="utf-8",
                            headers={"Cache-Control": "no-store"})

    async def _send_file(self, request: web.BaseRequest, path: str, rel: str,
                         st: os.stat_result) -> web.StreamResponse:
        size = st.st_size
        headers = {
            "Accept-Ranges": "bytes",
            "ETag": f'"{st.st_mtime_ns:x}-{size:x}"',
            "Last-Modified": email.utils.formatdate(st.st_mtime, usegmt=True),
            "Content-Type": "application/octet-stream",
        }
        try:
            rng = parse_range(request.headers.get("Range"), size)
        except _Unsatisfiable:
            headers["Content-Range"] = f"bytes */{size}"
            del headers["Content-Type"]
            self.stats.status(416)
            return web.Response(status=416, headers=headers)
        if rng is None:
            start, end, status = 0, size, 200
        else:
            start, end = rng
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return self._plain(403, "forbidden")
        resp = web.StreamResponse(status=status, headers=headers)
        resp.content_length = end - start
        self.stats.status(status)
        try:
            await resp.prepare(request)
            if request.method == "HEAD":
                await resp.write_eof()
                return resp
            conn_bucket = self._conn_bucket(request)
            pos = start
            while pos < end:
                data = os.pread(fd, min(self.chunk_size, end - pos), pos)
                if not data:  # truncated underneath us
                    break
                if conn_bucket is not None:
                    await conn_bucket.consume(len(data))
                if self._bucket is not None:
                    await self._bucket.consume(len(data))
                # Counted before the write: a client may have the bytes (and
                # ask for /_stats) before this coroutine resumes.
                self.stats.sent(rel, len(data))
                await resp.write(data)
                pos += len(data)
            await resp.write_eof()
            return resp
        except ConnectionError:  # the client went away mid-response
            return resp
        finally:
            os.close(fd)

    def _conn_bucket(self, request: web.BaseRequest) -> TokenBucket | None:
        """The per-connection bucket of the request's connection: a keep-alive
        client's requests share it, so a run of small reads (each within one
        burst) is paced as well, not only each large response on its own."""
        if not self.per_connection_bandwidth:
            return None
        transport = request.transport
        bucket = self._conn_buckets.get(transport) if transport is not None else None
        if bucket is None:
            bucket = TokenBucket(self.per_connection_bandwidth, self.chunk_size)
            if transport is not None:
                self._conn_buckets[transport] = bucket
        return bucket


def _bind(host: str, port: int) -> socket.socket:
    if not 0 <= port <= 65535:  # getaddrinfo would take 70000 as 4464, -1 with a cryptic error
        raise ValueError(f"port must be 0-65535 (0: any free port): {port}")
    family, type_, proto, _, addr = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, type_, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def _url_for(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


# ---------------------------------------------------------------- in-process API

class ObjectStore:
    """The object store running in a background thread with its own event loop.

    ``bandwidth`` and ``per_connection_bandwidth`` are bytes/s or strings like
    ``"200MB"`` (``None``/0: unlimited); ``latency`` is seconds or ``"20ms"``."""

    def __init__(self, root: str | os.PathLike, bandwidth=None, latency=0.0,
                 host: str = "127.0.0.1", port: int = 0, *,
                 per_connection_bandwidth=None, chunk_size: int = DEFAULT_CHUNK,
                 follow_symlinks: bool = False):
        self._server = _Server(os.fspath(root), bandwidth=bandwidth, latency=latency,
                               per_connection_bandwidth=per_connection_bandwidth,
                               chunk_size=chunk_size, follow_symlinks=follow_symlinks)
        self.host = host
        self.port = port
        self.url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def root(self) -> str:
        return self._server.root

    @property
    def bandwidth(self) -> float | None:
        return self._server.bandwidth

    @property
    def latency(self) -> float:
        return self._server.latency

    def start(self, timeout: float = 10.0) -> "ObjectStore":
        """Bind, start serving in a background thread; returns once listening."""
        if self._thread is not None:
            raise RuntimeError("object store already started")
        sock = _bind(self.host, self.port)
        self.port = sock.getsockname()[1]
        self.url = _url_for(sock)
        ready = threading.Event()
        errors: list[BaseException] = []
        loop = asyncio.new_event_loop()
        self._loop = loop

        def run():
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self._server.start(sock))
            except BaseException as exc:  # report to start(), then unwind
                errors.append(exc)
                sock.close()
                ready.set()
                loop.close()
                return
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(self._server.close())
                pending = asyncio.all_tasks(loop)
                for t in pending:
                    t.cancel()
                if pending:
                    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()

        self._thread = threading.Thread(target=run, name=f"objstore:{self.port}", daemon=True)
        self._thread.start()
        if not ready.wait(timeout):
            raise TimeoutError("object store did not start")
        if errors:
            self._thread.join()
            self._thread = None
            raise errors[0]
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving (in-flight responses are cut off within about 0.5 s)."""
        if self._thread is None:
            return
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)
        self._thread = None

    def stats(self, by_path: bool = True) -> dict:
        """``{"requests", "bytes_served", "by_status", "by_path"}`` since the last reset."""
        return self._server.stats.snapshot(by_path=by_path)

    def reset_stats(self) -> dict:
        """Zero the counters; returns them as they were just before."""
        return self._server.stats.snapshot(reset=True)

    def __enter__(self) -> "ObjectStore":
        if self._thread is None:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return (f"ObjectStore(root={self.root!r}, url={self.url!r}, "
                f"bandwidth={self.bandwidth}, latency={self.latency})")


# ---------------------------------------------------------------- subprocess API

def spawn(root: str | os.PathLike, bandwidth=None, latency=None, host: str = "127.0.0.1",
          port: int = 0, *, per_connection_bandwidth=None, extra_args=(),
          stderr=None, timeout: float = 20.0) -> tuple[subprocess.Popen, str]:
    """Start ``tools/objstore.py`` as a child process and wait for ``READY``.

    Returns ``(proc, url)``. Stop it with ``proc.terminate(); proc.wait()`` (it
    exits 0 on SIGTERM); ``proc.stdout`` stays open (a pipe) until then, so use
    ``with proc:`` or close it. ``stderr`` is passed to ``Popen`` (default: inherit)."""
    args = [sys.executable, os.path.abspath(__file__), "--root", os.fspath(root),
            "--host", host, "--port", str(port)]
    if bandwidth is not None:
        args += ["--bandwidth", str(bandwidth)]
    if latency is not None:
        args += ["--latency", str(latency)]
    if per_connection_bandwidth is not None:
        args += ["--per-connection-bandwidth", str(per_connection_bandwidth)]
    args += list(extra_args)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=stderr, env=env)
    fd = proc.stdout.fileno()
    buf = b""
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while True:
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                text = line.decode(errors="replace").strip()
                if text.startswith("READY "):
                    return proc, text.split()[1]
            left = deadline - time.monotonic()
            if left <= 0:
                why = f"did not print READY within {timeout} s"
                break
            if not sel.select(left):
                continue
            data = os.read(fd, 4096)
            if not data:
                why = f"exited with {proc.wait()} before READY"
                break
            buf += data
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    proc.stdout.close()
    raise RuntimeError(f"objstore {why}: {' '.join(args)}")


# ---------------------------------------------------------------- CLI

def _arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Bandwidth- and latency-capped HTTP object store serving a local "
                    "directory (a stand-in for GCS/S3).")
    p.add_argument("--root", required=True, help="directory to serve")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="listen port (default 0: any free port)")
    p.add_argument("--bandwidth", default=None,
                   help="store-wide cap shared by all connections, e.g. 200MB, 1GiB "
                        "(per second; default unlimited)")
    p.add_argument("--per-connection-bandwidth", default=None,
                   help="cap for each connection (its responses one after another), "
                        "e.g. 50MB (default unlimited)")
    p.add_argument("--latency", default="0",
                   help="first-byte latency added to every request, e.g. 20ms, 0.5s")
    p.add_argument("--chunk-size", default="256KiB", help="read/write chunk (default 256KiB)")
    p.add_argument("--follow-symlinks", action="store_true",
                   help="serve symlinks that point outside --root")
    return p


async def _serve(server: _Server, sock: socket.socket) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await server.start(sock)
    print(f"READY {_url_for(sock)}", flush=True)
    try:
        await stop.wait()
    finally:
        await server.close()


def main(argv: list[str] | None = None) -> int:
    args = _arg_parser().parse_args(argv)
    try:
        server = _Server(args.root, bandwidth=args.bandwidth, latency=args.latency,
                         per_connection_bandwidth=args.per_connection_bandwidth,
                         chunk_size=parse_size(args.chunk_size),
                         follow_symlinks=args.follow_symlinks)
        sock = _bind(args.host, args.port)
    except (ValueError, OSError) as exc:
        print(f"objstore: {exc}", file=sys.stderr)
        return 2
    def rate(r):
        return f"{int(r)} B/s" if r else "unlimited"
    print(f"objstore: serving {server.root} at {_url_for(sock)} "
          f"bandwidth={rate(server.bandwidth)} "
          f"per-connection={rate(server.per_connection_bandwidth)} "
          f"latency={server.latency * 1000:g} ms", file=sys.stderr, flush=True)
    asyncio.run(_serve(server, sock))
    return 0


if __name__ == "__main__":
    sys.exit(main())
