"""Accepting connections when the process may run out of file descriptors.

accept() fails with EMFILE/ENFILE (no descriptor left) or ENOBUFS/ENOMEM
while many connections are open; the listener is fine and later accepts
succeed once some close. So such errors are logged (at most once per
LOG_EVERY_S), counted and waited out with a growing pause; only a closed
listener ends the loop."""
from __future__ import annotations

import errno
import logging
import select
import socket
import threading
import time
from collections.abc import Callable

log = logging.getLogger("cacheserver.dataplane")
TRANSIENT = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
MIN_PAUSE_S, MAX_PAUSE_S = 0.01, 1.0
LOG_EVERY_S = 10.0


def accept_forever(lsock: socket.socket, stopping: threading.Event,
                   serve: Callable[[socket.socket], None], on_error: Callable[[], None]) -> None:
    """Accept connections on ``lsock`` and hand each to ``serve`` until ``stopping``."""
    try:
        lsock.settimeout(0.2)
    except OSError:  # closed before this thread ran (a server stopped as it started)
        return
    pause, last_log = MIN_PAUSE_S, float("-inf")
    while not stopping.is_set():
        try:
            conn, _ = lsock.accept()
        except (TimeoutError, socket.timeout):
            continue
        except OSError as e:
            if e.errno not in TRANSIENT or stopping.is_set():
                return  # the listener was closed
            on_error()
            if time.monotonic() - last_log >= LOG_EVERY_S:
                last_log = time.monotonic()
                log.error("accepting a data-plane connection failed: %s; retrying (raise the open-files "
                          "limit, e.g. LimitNOFILE=, or lower the client count)", e)
            stopping.wait(pause)
            pause = min(MAX_PAUSE_S, pause * 2)
            continue
        pause = MIN_PAUSE_S
        try:
            serve(conn)
        except Exception:  # one connection's failure must not end accepting (the listener would
            # stay open, unanswered: every later client hangs until its timeout)
            on_error()
            log.exception("serving an accepted data-plane connection failed; accepting on")
            conn.close()


def wait_readable(sock: socket.socket, timeout_s: float) -> bool:
    """select() for one socket at any descriptor number (select.select fails past 1023)."""
    p = select.poll()
    p.register(sock, select.POLLIN | select.POLLPRI)
    return bool(p.poll(timeout_s * 1000))
