"""The manager's policy layer: pure functions and explicit state machines of
measured inputs (no I/O, no threads, no clocks -- ``now`` is an argument).

* regression    -- per-job benefit from batch time vs miss fraction, no bypass (default)
* probing       -- per-job benefit probing (bypass vs normal mini-batch times)
* shares        -- benefit-sized pinned shares beside one shared LRU (default allocation)
* allocation    -- greedy multiple-choice knapsack: FULL / CHUNKED / NONE per dataset
* chunks        -- striped chunk plan (which items form chunk c)
* double_buffer -- per-dataset chunk double-buffering with two-step eviction
* autocache     -- per (dataset, pipeline): compute, cache source or cache transformed

See docs/manager-policy.md.
"""
from .allocation import (AllocConfig, Allocation, DatasetDemand, Option, allocate,
                         budget_from_capacities, chunk_size_for, demands, option_values)
from .autocache import Decision, PipelineCosts, decide, merge_costs
from .chunks import (ChunkPlan, chunk_len, chunk_members, chunk_of, iter_chunk, num_chunks,
                     partition_bounds)
from .double_buffer import (Action, Activate, Assign, BufferConfig, ChunkState, DoubleBuffer,
                            Evict, JobSlot, StartLoading, action_from_dict, action_to_dict)
from .probing import (DEFAULT_PRIOR_BENEFIT, Batch, CacheMode, JobGain, JobProbe, Phase,
                      ProbeBoard, ProbeConfig, Transition, dataset_gain, job_benefit,
                      relative_stderr, robust_mean)

__all__ = [
    "Decision", "PipelineCosts", "decide", "merge_costs",
    "AllocConfig", "Allocation", "DatasetDemand", "Option", "allocate",
    "budget_from_capacities", "chunk_size_for", "demands", "option_values",
    "ChunkPlan", "chunk_len", "chunk_members", "chunk_of", "iter_chunk", "num_chunks",
    "partition_bounds",
    "Action", "Activate", "Assign", "BufferConfig", "ChunkState", "DoubleBuffer", "Evict",
    "JobSlot", "StartLoading", "action_from_dict", "action_to_dict",
    "DEFAULT_PRIOR_BENEFIT", "Batch", "CacheMode", "JobGain", "JobProbe", "Phase",
    "ProbeBoard", "ProbeConfig", "Transition", "dataset_gain", "job_benefit",
    "relative_stderr", "robust_mean",
]
