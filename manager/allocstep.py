"""The allocation step of the manager's state machine (``ManagerModel.reallocate``), and
how the policy layer's outputs become effects: a mixin of ``ManagerModel`` (model.py),
which holds the state it reads and changes. Kept apart from the event handlers because it
is the one place that decides what each dataset holds, and it is long."""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Mapping

from .effects import ActivateChunk, Effect, EvictChunk, EvictDataset, SetMode, note
from .modelrecords import MAX_DECISIONS
from .policy import (Activate, Action, Allocation, Assign, CacheMode, DoubleBuffer, Evict, Option, Phase,
                     StartLoading, Transition, allocate, demands, num_chunks)
from .policy.shares import Share, allocate_shares

if TYPE_CHECKING:
    from .modelrecords import DatasetRecord, JobRecord, ManagerConfig
    from .pipelines import PipelineRecord
    from .policy.admission import AdmissionBoard


class AllocationStep:
    """``ManagerModel``'s allocation step; the attributes below are the model's fields."""

    config: "ManagerConfig"
    jobs: dict[str, "JobRecord"]
    datasets: dict[str, "DatasetRecord"]
    allocs: dict[str, Allocation]
    buffers: dict[str, DoubleBuffer]
    decisions: list[dict[str, Any]]
    counters: dict[str, int]
    pipelines: dict[str, "PipelineRecord"]
    admission: "AdmissionBoard"
    plan_floor: int

    def reallocate(self, now: float) -> list[Effect]:
        """The allocation step: the probe board's measured gains go to ``allocate()``
        under the budget (``--budget`` or the alive servers' total capacity); a
        dataset whose option or chunk size changes gets a new ``DoubleBuffer``.
        The allocations never sum to more than the budget (``_grace``)."""
        gains = self.job_gains()
        self._mark_idle_sets(gains, now)
        kept, sizes = self._grace(gains, now)
        budget = self.budget()
        given_up = self._give_up_grace(kept, sizes, gains, budget)
        items = {ds: self.datasets[ds].n_items for ds in sizes if ds in self.datasets}
        new = self._allocate(demands(gains, sizes, items), max(0, budget - sum(a.bytes for a in kept.values())))
        self._admit(new, gains, now)
        for ds in given_up:
            new[ds] = replace(new[ds], reason=f"idle: gave up its space before its grace period ended: the budget "
                                              f"({budget} bytes) no longer holds it beside the running datasets")
        new.update(kept)
        out: list[Effect] = []
        for ds in sorted(new):
            old, a = self.allocs.get(ds), new[ds]
            if (old is None or old.option is not a.option or old.spare != a.spare
                    or (a.option is Option.CHUNKED and old.chunk_size != a.chunk_size)):
                out += self._reconfigure(ds, old, a, now)
            elif old.share != a.share:  # same mechanism, another share: a new plan version
                self.datasets[ds].plan_base += 1
                out += self._decided(ds, old, a, now)
        self.allocs = new
        return out + self._forget_idle(gains, now)

    def _grace(self, gains: Mapping[str, list], now: float) -> tuple[dict[str, Allocation], dict[str, int]]:
        """(idle datasets that keep their allocation, sizes of the datasets to allocate).
        A dataset whose jobs all left keeps its space (or its spare entries) for a grace
        period: a job restarting (or the next one of a pipeline) would otherwise find its
        cached dataset evicted and reload it from the store."""
        kept: dict[str, Allocation] = {}
        sizes: dict[str, int] = {}
        why = "idle: kept during the grace period after its last job left; "
        for ds, rec in sorted(self.datasets.items()):
            a = self.allocs.get(ds)
            if (ds not in gains and a is not None and (a.option is not Option.NONE or a.spare)
                    and rec.idle_since is not None and now - rec.idle_since < self.config.dataset_grace_s):
                kept[ds] = a if a.reason.startswith(why) else replace(a, reason=why + a.reason)
            else:
                sizes[ds] = rec.bytes
        return kept, sizes

    def _give_up_grace(self, kept: dict[str, Allocation], sizes: dict[str, int], gains: Mapping[str, list],
                       budget: int) -> list[str]:
        """Idle datasets in their grace period give up their space, longest idle first,
        until what they keep and what the running datasets hold now fit the budget
        (it shrank: a server left). Running jobs lose nothing to an idle dataset, and the
        allocations never sum to more than the budget. Moves them from ``kept`` to
        ``sizes`` (allocated as datasets without jobs: NONE); returns their names."""
        running = sum(a.bytes for ds, a in self.allocs.items() if ds in gains)
        reserved = sum(a.bytes for a in kept.values())
        out: list[str] = []
        for ds in sorted(kept, key=lambda d: (self.datasets[d].idle_since, d)):
            if reserved + running <= budget:
                break
            if kept[ds].bytes > 0:
                reserved -= kept.pop(ds).bytes
                sizes[ds] = self.datasets[ds].bytes
                out.append(ds)
        return out

    def _forget_idle(self, gains: Mapping[str, list], now: float) -> list[Effect]:
        """Forget datasets nobody used for a whole grace period (their space is already
        freed; spare entries they left go too, as nobody will read them)."""
        out: list[Effect] = []
        for ds, rec in sorted(self.datasets.items()):
            if (rec.idle_since is not None and now - rec.idle_since >= self.config.dataset_grace_s
                    and self.option(ds) is Option.NONE and ds not in gains):
                self.plan_floor = max(self.plan_floor, self.plan_version(ds) + 1)
                del self.datasets[ds]
                out.append(EvictDataset(ds, "forgotten: no job for a whole grace period"))
                self.allocs.pop(ds, None)
        for key in [k for k, p in self.pipelines.items() if p.dataset not in self.datasets]:
            del self.pipelines[key]
        return out

    def _admit(self, new: dict[str, Allocation], gains: Mapping[str, list], now: float) -> None:
        """Shares: datasets whose misses yield too few hits in the shared LRU stop
        inserting there (policy/admission.py), measured while all of them insert."""
        if self.config.alloc.mechanism != "shares":
            return
        users = [ds for ds, a in new.items() if a.spare and a.option is Option.NONE and ds in gains]
        jobs = {g.job_id: ds for ds, gs in gains.items() for g in gs}
        self.admission.step(jobs, users, self.budget(), now, self.config.admission)
        for ds, why in sorted(self.admission.excluded.items()):
            if ds in new and new[ds].spare:
                new[ds] = replace(new[ds], spare=False, reason=f"{why}; {new[ds].reason}")

    def _allocate(self, ds: list, budget: int) -> dict[str, Allocation]:
        """shares (default): a pinned share per dataset sized by benefit (FULL when the
        share is the whole dataset); chunks: the FULL / CHUNKED / NONE knapsack."""
        cfg = self.config.alloc
        if cfg.mechanism == "chunks":
            current = {d: a.knapsack_option for d, a in self.allocs.items()}  # hysteresis, also under --no-chunks
            return allocate(ds, budget, cfg, current)
        shares = allocate_shares(ds, budget, cfg, {d: a.share for d, a in self.allocs.items()})
        gaining = {d.name for d in ds if any(j.benefit is None or j.benefit >= cfg.min_benefit for j in d.jobs)}
        shares = _keep_full(shares, {d.name: d.size_bytes for d in ds}, self.allocs, budget, gaining)
        out = {}
        for d in ds:
            s = shares[d.name]
            full = d.size_bytes > 0 and s.bytes >= d.size_bytes
            benefits = d.name in gaining
            out[d.name] = Allocation(d.name, Option.FULL if full else Option.NONE, s.bytes,
                                     d.size_bytes if full else 0, s.value, s.reason,
                                     spare=bool(d.jobs) and benefits, share=s.bytes)
        return out

    def _decided(self, ds: str, old: Allocation | None, a: Allocation, now: float) -> list[Effect]:
        old_opt = old.option if old is not None else Option.NONE
        self.counters["decisions"] = self.counters.get("decisions", 0) + 1
        self.decisions.append({"at": now, "dataset": ds, "option": a.option.value, "reason": a.reason})
        del self.decisions[:-MAX_DECISIONS]
        return [note("allocation", dataset=ds, old=old_opt.value, new=a.option.value,
                     bytes=a.bytes, reason=a.reason)]

    def _reconfigure(self, ds: str, old: Allocation | None, a: Allocation, now: float) -> list[Effect]:
        old_opt = old.option if old is not None else Option.NONE
        rec = self.datasets[ds]
        out = self._decided(ds, old, a, now)
        buf = self.buffers.pop(ds, None)
        rec.plan_base = rec.plan_base + (buf.version if buf else 0) + 1
        if a.option is Option.NONE:
            # Leaving chunks or full: NONE holds no chunk, so free the dataset (its jobs
            # insert spare entries again if allowed). Spare turning on or off only
            # changes the plan: spare entries left behind take room nobody needs, and
            # evicting them would make a flip (a new job's prior, then its measured
            # benefit) cost a reload.
            if old_opt is not Option.NONE:
                out.append(EvictDataset(ds, a.reason))
            return out
        # Going from chunks to FULL keeps what is resident (everything is wanted
        # now). Any other change invalidates the chunk tags already on the
        # servers (they number chunks of another plan): start from a clean slate.
        if old_opt is not Option.NONE and not (old_opt is Option.CHUNKED and a.option is Option.FULL):
            out.append(EvictDataset(ds, f"re-plan {old_opt.value} -> {a.option.value}"))
        k = 1 if a.option is Option.FULL else num_chunks(rec.bytes, a.chunk_size, rec.n_items)
        buf, actions = DoubleBuffer.create(ds, rec.n_items, k, now, self.config.buffer)
        for job in sorted(j for j, r in self.jobs.items() if r.dataset == ds):
            actions += buf.attach(job, now)
        self.buffers[ds] = buf
        return out + self.effects_of_actions(actions)

    # ---------------------------------------------------------------- policy outputs -> effects
    def _transitions(self, ts: list[Transition]) -> list[Effect]:
        out: list[Effect] = []
        for t in ts:
            if t.new is Phase.PROBE_BYPASS and t.old is not Phase.PROBE_BYPASS:
                self._count("probes_started")
            elif t.new is Phase.DECIDED and t.old is Phase.MEASURE_NORMAL:
                self._count("probes_finished")
            elif t.reason.startswith("probe aborted"):
                self._count("probes_aborted")
            was_bypass = t.old is Phase.PROBE_BYPASS
            if was_bypass != (t.mode is CacheMode.BYPASS):
                self._count("mode_switches")
                out.append(SetMode(t.job_id, t.mode.value, t.reason))
            out.append(note("probe", job=t.job_id, old=t.old.value, new=t.new.value, reason=t.reason))
        return out

    def effects_of_actions(self, actions: list[Action]) -> list[Effect]:
        """DoubleBuffer actions -> effects (Assign/StartLoading are only logged: clients
        learn them from their plan)."""
        out: list[Effect] = []
        for a in actions:
            if isinstance(a, Activate):
                out.append(ActivateChunk(a.dataset, a.chunk))
            elif isinstance(a, Evict):  # not sent if it loads again meanwhile: actuator._send
                self._count("chunk_evictions_forced" if a.forced else "chunk_evictions")
                out.append(EvictChunk(a.dataset, a.chunk, a.forced, a.reason))
            elif isinstance(a, StartLoading):
                out.append(note("chunk loading", dataset=a.dataset, chunk=a.chunk))
            elif isinstance(a, Assign):
                out.append(note("job assigned", dataset=a.dataset, job=a.job, chunk=a.chunk))
        return out


def _keep_full(shares: dict[str, Share], sizes: Mapping[str, int], allocs: Mapping[str, Allocation],
               budget: int, gaining: set[str]) -> dict[str, Share]:
    """A FULL dataset offered a partial share, or none while its jobs still gain from
    the cache, stays FULL while the budget holds it: leaving FULL evicts its entries,
    so the jobs still reading it would lose what they read from the cache now (a job
    leaving made the share partial; another dataset's first estimates made the
    shared LRU look worth more for a moment, say)."""
    out = dict(shares)
    for name, s in sorted(shares.items()):
        a = allocs.get(name)
        if a is None or a.option is not Option.FULL or s.bytes >= sizes[name] or (s.bytes == 0 and name not in gaining):
            continue
        if sum(x.bytes for x in out.values()) - s.bytes + sizes[name] <= budget:
            out[name] = Share(name, sizes[name], s.value, f"kept full: a partial share would evict what its "
                                                          f"jobs read now; {s.reason}")
    return out

