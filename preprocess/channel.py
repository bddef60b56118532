"""One-way message channels from each worker process to the scheduler.

Every worker writes to a pipe of its own. A multiprocessing.Queue shared by all
workers serialises its writers with a cross-process lock, and a worker killed
(SIGKILL, the OOM killer) while holding it never releases it: the other workers
then block for ever and so does the epoch. Here a killed worker can spoil only its
own pipe, and no process waits on a lock another one holds: the writer's lock is a
thread lock (the worker's two threads), and the reader never blocks: its end is
non-blocking, bytes are buffered until a whole frame (8-byte length, then the
pickle) is in, and end of file (the writer's process gone) closes the channel,
dropping a partial last frame (its item is re-run by the scheduler). A worker that
stops marks its end with an empty frame and stays until the scheduler closes its
end: a tensor in a message is fetched from the sender's process while it is
unpickled (torch's shared-memory reducers), which fails once that process is gone."""
from __future__ import annotations

import os
import select
import struct
import threading
import time
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import ForkingPickler
from typing import Any

HEADER = struct.Struct("!Q")
READ_BYTES = 1 << 20
MAX_READS = 64  # per read(): a reader takes at most 64 MiB at a time, so one busy worker cannot starve the rest
END = HEADER.pack(0)  # an empty frame (no pickle is empty): the writer has sent its last message


def _register_tensor_reducers() -> None:
    """Tensors pass through shared memory as with torch's queues (what DataLoader does)."""
    try:
        import torch.multiprocessing  # noqa: F401  (registers its reducers with ForkingPickler)
    except ImportError:  # pragma: no cover
        pass


class ChannelWriter:
    """The worker's end: send() from any of its threads; blocking writes."""

    def __init__(self, conn: Connection) -> None:
        _register_tensor_reducers()
        self.conn, self.lock = conn, threading.Lock()

    def send(self, msg: Any) -> None:
        data = bytes(ForkingPickler.dumps(msg))
        view = memoryview(HEADER.pack(len(data)) + data)
        fd = self.conn.fileno()
        with self.lock:
            try:
                while view:
                    view = view[os.write(fd, view):]
            except BrokenPipeError:  # the scheduler closed its end: nothing left to work for
                os._exit(1)

    def finish(self, timeout: float) -> None:
        """After the last message: mark the end, then stay until the reader closes its
        end (at most `timeout` s). Tensors sent go through shared memory that the reader
        fetches from this process while unpickling, so it must still be there."""
        fd = self.conn.fileno()
        with self.lock:
            try:
                os.write(fd, END)  # under PIPE_BUF: written whole
            except BrokenPipeError:
                return
        p = select.poll()
        p.register(fd, select.POLLERR | select.POLLHUP)  # a pipe's write end: POLLERR once no reader is left
        p.poll(timeout * 1000)

    def close(self) -> None:
        self.conn.close()


class ChannelReader:
    """The scheduler's end: read() returns the whole messages that have arrived."""

    def __init__(self, conn: Connection) -> None:
        self.conn, self.buf, self.closed = conn, bytearray(), False
        self.ended = False  # the writer has marked its end (ChannelWriter.finish) and waits for close()
        os.set_blocking(conn.fileno(), False)

    def fileno(self) -> int:
        return self.conn.fileno()

    def read(self, decode: bool = True) -> list[Any]:
        """The whole messages in; decode=False: their bytes, unpickled by nobody (what a
        stopping worker still sends: a tensor in it would be fetched from a process
        that may be gone)."""
        for _ in range(MAX_READS):
            if self.closed:
                break
            try:
                chunk = os.read(self.conn.fileno(), READ_BYTES)
            except BlockingIOError:
                break
            if not chunk:
                self.closed = True
            self.buf += chunk
        return self._frames(decode)

    def _frames(self, decode: bool) -> list[Any]:
        out, at = [], 0
        while len(self.buf) - at >= HEADER.size:
            (n,) = HEADER.unpack_from(self.buf, at)
            if len(self.buf) - at - HEADER.size < n:
                break
            at += HEADER.size
            if n == 0:
                self.ended = True
                continue
            frame = bytes(self.buf[at:at + n])
            out.append(decode_frame(frame) if decode else frame)
            at += n
        del self.buf[:at]
        return out

    def close(self) -> None:
        self.conn.close()


def decode_frame(frame: bytes) -> Any:
    """A message from its bytes (read(decode=False)); its tensors are fetched from the
    sender's process, so this fails once that process is gone."""
    return ForkingPickler.loads(frame)


def channel(ctx: Any) -> tuple[ChannelReader, Connection]:
    """A new channel: the reader for this process, the write end to hand to the worker
    (as a process argument; close it here once the worker has started)."""
    r, w = ctx.Pipe(duplex=False)
    return ChannelReader(r), w


def ready(readers: list[ChannelReader], timeout: float) -> list[ChannelReader]:
    """Readers with bytes or end of file waiting, within timeout seconds."""
    open_ = [r for r in readers if not r.closed]
    if not open_:
        time.sleep(timeout)
        return []
    return wait(open_, timeout)
