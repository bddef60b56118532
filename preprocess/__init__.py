"""Transform pipelines for CachedDataset: per-sample scheduling, AutoOrder and
structural fingerprints (docs/preprocess.md).

    from preprocess import Pipeline, step
    ds = CachedDataset("train.dig", transform=Pipeline([decode, step(crop, random=True), to_float]))
    loader = ds.loader(batch_size=256, num_workers=None, seed=0)   # None: adaptive worker count
"""
from .engine import PipelineError, StepTimeout
from .fingerprint import Uncacheable
from .pipeline import ItemContext, Pipeline, StepError, as_pipeline, autocache
from .pool import PoolClosed, WorkerDied
from .steps import Step, step

__all__ = ["Pipeline", "Step", "step", "PipelineError", "StepTimeout", "StepError", "Uncacheable", "ItemContext",
           "as_pipeline", "WorkerDied", "PoolClosed", "autocache"]
