"""Reaching the Ray cluster that runs remote preprocessing workers.

The trainer joins as a Ray Client (`ray://HOST:PORT`, the head's client server,
port 10001 by default), not as a driver of the cluster: a driver's process is
ended by Ray when its cluster goes, while a client only sees its calls fail,
and the job falls back to local workers and keeps training.

`remote="auto"` takes the address from the cache manager (`cachemanager --ray`),
else from RAY_ADDRESS (a ray:// one); with neither the job runs local workers.
"""
from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any

from manager.workers import check_ray_address

GRACE_ENV = "RAY_CLIENT_RECONNECT_GRACE_PERIOD"
DEFAULT_GRACE_S = 10  # Ray's default is 30 s of stalled calls before a lost cluster is reported
CHECK_TIMEOUT_S = 3.0
# The head's proxy starts a client server process per connection; one that dies starting (a
# loaded head, its port taken meanwhile) fails the connection with one of these texts, at once
# or after the proxy's wait for it (RAY_CLIENT_SERVER_CHECK_CHANNEL_TIMEOUT_S, 30 s). The next
# try gets a new server on another port.
SERVER_START_FAILED = ("Starting Ray client server failed", "Proxy failed to Connect to backend")
START_TRIES = 2
START_RETRY_S = 1.0


class ClusterUnavailable(RuntimeError):
    """The Ray cluster cannot be reached, or was lost; the job runs local workers."""


def check_remote(remote: str) -> None:
    """ValueError naming what is wrong with a `remote=` value."""
    if remote == "auto":
        return
    try:
        check_ray_address(remote)
    except ValueError as e:
        raise ValueError(f"remote= takes 'ray://HOST:PORT' (the Ray head's client server) or 'auto': {e}") from None


def resolve(remote: str, given: str | None = None) -> str | None:
    """The ray:// address `remote=` names: itself; for 'auto' the one the cache manager
    gives (`given`, from cachemanager --ray), else RAY_ADDRESS when it is a ray:// one,
    else None (no cluster known: the job runs local workers)."""
    check_remote(remote)
    if remote != "auto":
        return remote
    if given:
        return check_ray_address(given)
    env = os.environ.get("RAY_ADDRESS", "")
    return env if env.startswith("ray://") else None


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ImportError("remote= needs Ray: install the extra, pip install '.[ray]'") from None
    return ray


class _Joined:
    """The Ray Client connection connect() made, shared by the pools that use it (two
    loaders with remote=): the last to leave closes it, not the first. `generation`
    tells a share of a connection since replaced (its cluster was lost) from one of
    the live one. A connection the user made is never counted here, never closed."""
    lock = threading.Lock()
    generation = 0
    users = 0


def connect(address: str) -> tuple[Any, int | None]:
    """Connect this process as a Ray Client, or reuse its live connection: (the ray
    module, this pool's share of a connection made here, for leave(); None where the
    user made the connection). ClusterUnavailable when the head cannot be reached."""
    ray = import_ray()
    with _Joined.lock:
        if ray.is_initialized():
            if not _Joined.users:
                return ray, None
            _Joined.users += 1
            return ray, _Joined.generation
        host, _, port = address[len("ray://"):].rpartition(":")
        try:  # a refused port fails here in milliseconds, not after Ray's minute of retries
            socket.create_connection((host, int(port)), CHECK_TIMEOUT_S).close()
        except OSError as e:
            raise ClusterUnavailable(f"Ray cluster {address} cannot be reached: {e}") from None
        os.environ.setdefault(GRACE_ENV, str(DEFAULT_GRACE_S))
        disconnect(ray)  # a client whose cluster was lost stays half-connected until shut down
        _Joined.users = 0  # shares of a lost connection are void
        _Joined.generation += 1
        _init(ray, address)
        _Joined.users = 1
        return ray, _Joined.generation


def _init(ray: Any, address: str) -> None:
    """ray.init as a Ray Client; a client server that died starting is tried once more."""
    for attempt in range(START_TRIES):
        try:
            ray.init(address=address, logging_level="ERROR", log_to_driver=False)
            return
        except Exception as e:
            if attempt + 1 < START_TRIES and any(t in str(e) for t in SERVER_START_FAILED):
                disconnect(ray)
                time.sleep(START_RETRY_S)
                continue
            raise ClusterUnavailable(f"Ray cluster {address}: {type(e).__name__}: {e}") from None


def leave(ray: Any, share: int | None) -> None:
    """A pool is done with its share of the connection: the last share closes it."""
    if share is None:
        return
    with _Joined.lock:
        if share != _Joined.generation or not _Joined.users:
            return
        _Joined.users -= 1
        if not _Joined.users:  # under the lock: a pool connecting meanwhile makes a new one
            disconnect(ray)


def stays_open(ray: Any, share: int | None) -> bool:
    """Whether the connection stays open once this share leaves: the user's (share None),
    or one made here that another pool still holds a share of. Its actors then live on
    until killed (a closed connection ends the actors made through it)."""
    if not ray.is_initialized():
        return False
    if share is None:
        return True
    with _Joined.lock:
        return share == _Joined.generation and _Joined.users > 1


def disconnect(ray: Any, timeout: float = 5.0) -> None:
    """Leave the cluster without waiting on a lost one for long (shutdown can stall)."""
    t = threading.Thread(target=ray.shutdown, name="ray-shutdown", daemon=True)
    t.start()
    t.join(timeout)
