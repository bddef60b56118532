"""The data plane's accept loop ends quietly on a listener closed before its thread ran
(a server stopped as it started): before, its first settimeout raised EBADF in the thread."""
import socket
import threading

from cacheserver.acceptloop import accept_forever


def test_a_listener_closed_before_the_loop_runs_ends_it_quietly():
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen()
    lsock.close()
    errors: list[int] = []
    accept_forever(lsock, threading.Event(), lambda conn: None, lambda: errors.append(1))
    assert errors == []
