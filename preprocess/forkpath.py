"""Imported first by the preprocessing workers' fork server (startctx.py), before the modules
it preloads: puts the trainer's sys.path in place, which CPython 3.11's fork server is handed
but does not apply, so that modules found on it (a training script's own, beside it) import
there as they do in the trainer, once, rather than in every worker."""
import os
import sys

ENV = "MLCACHE_FORKSERVER_SYS_PATH"

sys.path[:0] = [p for p in os.environ.get(ENV, "").split(os.pathsep) if p and p not in sys.path]
