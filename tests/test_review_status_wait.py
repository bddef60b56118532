"""`cachectl status` waits out its --timeout for a manager still starting (or a connect that
failed once) rather than giving up at the first failed connect; a real cachemanager."""
import argparse
import io
import threading
import time

from manager.status import add_status_parser, run_status
from procs import cachemanager, free_port


def _status(address: str, timeout: str) -> tuple[int, float]:
    parser = argparse.ArgumentParser()
    add_status_parser(parser.add_subparsers(dest="command"))
    t = time.monotonic()
    rc = run_status(parser.parse_args(["status", "--manager", address, "--timeout", timeout]), io.StringIO())
    return rc, time.monotonic() - t


def test_status_waits_for_a_manager_still_starting(tmp_path):
    """Before: exit 1 at once (connection refused) though the manager was up a second later."""
    port = free_port()
    m = cachemanager(str(tmp_path / "m"), port)
    starter = threading.Timer(1.0, m.start)
    starter.start()
    try:
        rc, took = _status(f"127.0.0.1:{port}", "60")
        assert rc == 0, f"gave up after {took:.1f} s"
    finally:
        starter.join(30)
        m.kill()


def test_status_of_no_manager_ends_at_its_timeout(tmp_path):
    rc, took = _status(f"127.0.0.1:{free_port()}", "1")
    assert rc == 1 and took < 10
