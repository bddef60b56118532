"""Checks of `cacheserver`'s flags against the machine, at start: problems that would
otherwise show only as 0% hits or failed writes much later."""
from __future__ import annotations

import ipaddress
import os
import shutil
import socket

from .runtime import split_hostport
from .sizes import format_size


def _is_local_ip(ip: str) -> bool:
    """An address of this machine: one a socket can bind to."""
    if ipaddress.ip_address(ip).is_loopback:
        return True
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((ip, 0))
        return True
    except OSError:
        return False


def _resolve(host: str) -> list[str] | None:
    try:
        return sorted({ai[4][0] for ai in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)})
    except (socket.gaierror, UnicodeError):
        return None


def peers_problem(listen: str, port: int, peers: list[str]) -> str | None:
    """Why --peers cannot be right, or None: clients given this server's address route
    over its --peers, so a list without this server never sends it anything."""
    if not peers:
        return None
    unresolved, mine = [], False
    for p in peers:
        host, pport = split_hostport(p, "--peers")
        ips = _resolve(host)
        if ips is None:
            unresolved.append(p)
        elif pport == port and any(_is_local_ip(ip) for ip in ips):
            mine = True
    if mine:
        return None
    why = f"; these do not resolve here: {', '.join(unresolved)}" if unresolved else ""
    return (f"--peers {','.join(peers)} does not include this server (listening on {listen}){why}. "
            "Clients that are given this server's address route over --peers, so it would get no items: "
            "list every ring member, this one included, by the address clients reach it at")


def _bytes_under(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass  # vanished meanwhile
    return total


def capacity_problem(data_dir: str, capacity: int) -> str | None:
    """Why --capacity cannot be held in data_dir, or None: the disk's free space plus
    what the store already holds there must cover it, else writes fail when it fills."""
    probe = os.path.abspath(data_dir)
    while not os.path.exists(probe):  # the directory is created later: ask its filesystem
        probe = os.path.dirname(probe)
    free = shutil.disk_usage(probe).free
    held = _bytes_under(data_dir) if os.path.isdir(data_dir) else 0
    if capacity <= free + held:
        return None
    return (f"--capacity {format_size(capacity)} is more than {data_dir} can hold: its filesystem has "
            f"{format_size(free)} free" + (f" and the store holds {format_size(held)}" if held else "")
            + f"; pass --capacity {format_size(free + held).replace(' ', '')} or less (some room for RocksDB's own files "
              "is wise), or free space first")
