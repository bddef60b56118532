"""A step module for tests/test_review_worker_start.py: each process that imports it writes
its pid to $START_STEPS_LOG, and its step reports the worker's environment mark."""
import os
import struct

with open(os.environ["START_STEPS_LOG"], "a") as _f:
    _f.write(f"{os.getpid()}\n")


def mark(data: bytes) -> tuple[int, str]:
    """The item's index (its first 8 bytes) and $START_STEPS_MARK where the step ran."""
    return struct.unpack_from("<q", data)[0], os.environ.get("START_STEPS_MARK", "")
