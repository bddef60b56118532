"""preprocess/channel.py with real spawned writers: a writer killed in the middle of a
message spoils only its own channel, and the reader never blocks on it."""
import multiprocessing
import os
import signal
import time

import pytest

from preprocess.channel import HEADER, ChannelWriter, channel, ready

pytestmark = pytest.mark.timeout(60)
BIG = 100_000  # over a pipe's 64 KiB buffer: frames arrive in pieces


def killed_mid_message(conn):
    """Sends one whole message, then half of a second one, then dies by SIGKILL."""
    w = ChannelWriter(conn)
    w.send(("done", 1))
    os.write(conn.fileno(), HEADER.pack(1 << 20) + bytes(1000))
    os.kill(os.getpid(), signal.SIGKILL)


def steady(conn, n):
    w = ChannelWriter(conn)
    for k in range(n):
        w.send(("done", k, bytes(BIG)))


def read_until_closed(readers, seconds):
    got = {id(r): [] for r in readers}
    deadline = time.monotonic() + seconds
    while not all(r.closed for r in readers) and time.monotonic() < deadline:
        for r in ready(readers, 0.1):
            got[id(r)] += r.read()
    return [got[id(r)] for r in readers]


def test_a_writer_killed_mid_message_blocks_neither_the_reader_nor_the_other_writers():
    ctx = multiprocessing.get_context("spawn")
    (ra, wa), (rb, wb) = channel(ctx), channel(ctx)
    a = ctx.Process(target=killed_mid_message, args=(wa,), daemon=True)
    b = ctx.Process(target=steady, args=(wb, 40), daemon=True)
    a.start(), b.start()
    wa.close(), wb.close()  # the children hold the only write ends
    t0 = time.monotonic()
    got_a, got_b = read_until_closed([ra, rb], 30)
    a.join(5), b.join(5)
    assert a.exitcode == -signal.SIGKILL and b.exitcode == 0
    assert ra.closed and rb.closed and time.monotonic() - t0 < 30
    assert got_a == [("done", 1)]                      # the whole message; the torn one dropped
    assert [m[1] for m in got_b] == list(range(40))    # all, in order, none torn
    assert all(len(m[2]) == BIG for m in got_b)
    ra.close(), rb.close()


def test_reading_an_empty_channel_returns_at_once():
    ctx = multiprocessing.get_context("spawn")
    r, w = channel(ctx)
    t0 = time.monotonic()
    assert r.read() == [] and ready([r], 0.05) == [] and not r.closed
    assert time.monotonic() - t0 < 5
    w.close()
    assert ready([r], 1.0) == [r] and r.read() == [] and r.closed  # end of file: closed, nothing torn
    r.close()
