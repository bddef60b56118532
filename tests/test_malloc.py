"""cacheserver/malloc.py: freed batch buffers are reused instead of faulted in afresh."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Buffers of 1-16 MB, allocated and freed in a worker thread, as a server's or a
# client's batches are; prints the minor page faults the loop took.
SCRIPT = """
import resource, sys, threading
sys.path.insert(0, {root!r})
if {tuned}:
    from cacheserver.malloc import keep_freed_memory
    assert keep_freed_memory()
def work():
    for i in range(200):
        b = bytearray((1 + (i * 7) % 16) << 20)
        b[::4096] = b"\\x01" * len(b[::4096])
        del b
t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
th = threading.Thread(target=work)
th.start()
th.join()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - t0)
"""


def faults(tuned: bool) -> int:
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(root=ROOT, tuned=tuned)],
                         capture_output=True, text=True, timeout=60, check=True)
    return int(out.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_keeping_freed_memory_avoids_page_faults_for_batch_buffers():
    plain, tuned = faults(False), faults(True)
    assert tuned <= 2 * (16 << 20) // 4096  # about one first touch of the largest buffer
    assert tuned * 1.5 < plain, (tuned, plain)
