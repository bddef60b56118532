"""How preprocessing worker processes start: forked from multiprocessing's fork server.

Not fork: the trainer has threads (the loader's, gRPC's, the data plane's), which a forked
child would copy held locks of. Spawn was safe but each worker imported torch and every
module its dataset and steps unpickle from, ~2 s of CPU and wall time per worker (3 s with
a test module's imports), paid again for each worker an epoch starts without persistent
workers and for each one the scaling controller adds. The fork server is a fresh process,
started once per trainer process: it imports torch and those modules once (its preload),
and each worker is forked from it, single-threaded, in milliseconds.

What differs from spawn, made the same here: a forked worker has the fork server's
environment (of when it started), so `with_env` gives it the trainer's of when it starts,
as spawn did. Modules imported at the fork server's start read their settings then (torch
reads OMP_NUM_THREADS at import). The fork server's preload is fixed when it starts (the
trainer process's first worker); modules a later pool needs are imported by its workers, as
under spawn."""
from __future__ import annotations

import multiprocessing
import os
import pickle
import sys
from collections.abc import Callable
from typing import Any

from . import forkpath

ALWAYS = ("torch", "numpy", "preprocess.worker")  # what every worker imports


class _Discard:
    def write(self, b: bytes) -> int:
        return len(b)


def _modules_of(obj: Any) -> set[str]:
    """The modules unpickling `obj` imports (those of the classes and functions pickled by
    reference); only its class's if it does not pickle plainly (a dataset holding shared
    memory, which only multiprocessing pickles as it starts a process)."""
    found: set[str] = {type(obj).__module__}

    class Recorder(pickle.Pickler):
        def reducer_override(self, obj: Any) -> Any:
            mod = getattr(obj, "__module__", None) if isinstance(obj, type) or callable(obj) else None
            found.add(mod if isinstance(mod, str) else type(obj).__module__)
            return NotImplemented

    try:
        Recorder(_Discard(), protocol=pickle.HIGHEST_PROTOCOL).dump(obj)  # the modules, not the bytes
    except Exception:
        return {type(obj).__module__}
    return found


def worker_context(*objs: Any) -> Any:
    """The multiprocessing context workers of a pool are started in (torch's, whose queues
    pass tensors through shared memory), its fork server preloading what unpickling `objs`
    (the dataset, pipeline and feed the workers are given) imports, if it is not running yet."""
    try:
        import torch.multiprocessing as tmp
        ctx = tmp.get_context("forkserver")
    except ImportError:  # pragma: no cover
        ctx = multiprocessing.get_context("forkserver")
    mods = set(ALWAYS).union(*(_modules_of(o) for o in objs)) - {"builtins", "__main__", "__mp_main__"}
    loaded = sorted(m for m in mods if m in sys.modules)  # none this process has not imported itself
    # read by forkpath as the fork server starts (at the first worker's start, if not running)
    os.environ[forkpath.ENV] = os.pathsep.join(p for p in sys.path if p)
    ctx.set_forkserver_preload(["__main__", "preprocess.forkpath", *loaded])  # __main__: multiprocessing's default
    return ctx


def with_env(env: dict[str, str], target: Callable[..., Any], *args: Any) -> Any:
    """Run `target(*args)` in a worker under the trainer's environment `env` (see the module)."""
    if env != os.environ:
        os.environ.clear()
        os.environ.update(env)
    return target(*args)
