"""Works around ray-project/ray#63202 on the tests' Ray heads: the Ray Client proxy starts a
client server per connection with subprocess.Popen(preexec_fn=...) from one of its gRPC threads.
A preexec_fn makes CPython fork (not vfork) and run Python in the child of a multi-threaded
process before exec: the child died at once in 5 of ~60 starts on this 2-core host under the
suite's load (SIGSEGV in threading._after_fork, or SIGABRT; logs empty), and Ray's client heard
of it only ~45 s later (its channel check, 30 s, then five log-stream retries), a Ray test's
whole budget. Without a preexec_fn CPython vforks and execs at once; what the preexec_fn did
(SIGINT blocked, PR_SET_PDEATHSIG) the tests do not need: a head's processes share its process
group, which RayHead kills whole. Product code is untouched: users' heads run stock Ray, and
preprocess.remote.cluster.connect tries such a connection again (tests/test_remote_fallback.py)."""
from __future__ import annotations


def is_proxy() -> bool:
    """Whether this process is a Ray head's client proxy (`ray.util.client.server --mode=proxy`)."""
    try:
        with open("/proc/self/cmdline", "rb") as f:
            return b"--mode=proxy" in f.read()
    except OSError:
        return False


def apply() -> None:
    """In a head's client proxy, the processes Ray starts get no preexec_fn (see above)."""
    if not is_proxy():
        return
    from ray._private import services

    class NoPreexecPopen(services.ConsolePopen):
        def __init__(self, *args, preexec_fn=None, **kwargs):
            super().__init__(*args, **kwargs)

    services.ConsolePopen = NoPreexecPopen
