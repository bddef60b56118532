"""The autocache decision (manager/policy/autocache.py) on recorded traces:
tests/autocache_trace.json is `tools/bench/autocache --record` on the shared 2-core
machine (docs/benchmarks.md). Per cell (inflation f, CPU s): the costs probed on our
read path (store, cache hits of source and transformed items, handing items to the
workers) and the steps' wall time in the workers of a real run, and the measured
totals of 3 epochs of each fixed option and of auto."""
import json
import pathlib
import statistics

import pytest

from manager.policy.autocache import (DEFAULT_OVERLAP, PipelineCosts, costs_from_dict, decide,
                                      project)

TRACE = json.loads((pathlib.Path(__file__).parent / "autocache_trace.json").read_text())
FIXED = ("compute", "source", "transformed")
CELLS = [c for c in TRACE["cells"] if all(c["measured"].get(p) for p in FIXED)]
# The loaded 2-core machine's run-to-run noise is about 15% (docs/benchmarks.md); a
# choice within it of the best measured option is not a wrong choice.
NOISE = 0.15


def model_error(overlap: float) -> float:
    errs = []
    for c in CELLS:
        pc = costs_from_dict(c["costs"])
        proj = project(pc, overlap)
        errs += [abs(proj[p] * pc.epochs_left - c["measured"][p]) / c["measured"][p] for p in FIXED]
    return statistics.mean(errs)


def test_trace_covers_the_benchmark_grid():
    assert len(CELLS) == 18
    assert {c["f"] for c in CELLS} == {1.0, 2.5, 8.0}
    assert {c["s_ms"] for c in CELLS} == {0.0, 0.5, 1.0, 2.0, 4.0, 8.0}
    winners = {min(FIXED, key=lambda p: c["measured"][p]) for c in CELLS}
    assert len(winners) >= 2, winners  # the grid has regimes where different options win


def test_decisions_from_the_probes_are_near_the_best_measured_option():
    for c in CELLS:
        m = c["measured"]
        mode = decide(costs_from_dict(c["costs"])).mode
        best = min(m[p] for p in FIXED)
        assert m[mode] <= best * (1 + NOISE), (c["f"], c["s_ms"], mode, m)


def regret(overlap: float) -> float:
    """Worst measured time of the option decided from the probes over the best one."""
    worst = 1.0
    for c in CELLS:
        m = c["measured"]
        mode = decide(costs_from_dict(c["costs"]), overlap=overlap).mode
        worst = max(worst, m[mode] / min(m[p] for p in FIXED))
    return worst


def test_pipelined_default_decides_best_and_predicts_better_than_cachews_sum():
    # recorded: mean |error| 18.6% pipelined, 20.3% summed, 13.8% at overlap 0.5 -- but 0.5
    # decides worse (worst regret 1.19 against 1.11), so the default stays the pipeline
    assert DEFAULT_OVERLAP == 1.0
    assert model_error(1.0) < model_error(0.0) < 0.25
    assert regret(1.0) < regret(0.5) and regret(1.0) < regret(0.0)
    assert regret(0.0) > 2  # Cachew's sum caches 8x outputs where the source wins (f=8, s=0.5)


def test_what_auto_measured_leads_to_a_near_best_option():
    # the costs the job itself measured in its first epoch (its read path, its workers)
    checked = 0
    for c in CELLS:
        if c.get("auto_costs"):
            m = c["measured"]
            mode = decide(costs_from_dict(c["auto_costs"])).mode
            assert m[mode] <= min(m[p] for p in FIXED) * (1 + NOISE), (c["f"], c["s_ms"], mode)
            checked += 1
    assert checked == len(CELLS)


@pytest.mark.parametrize("c", CELLS[:1])
def test_recorded_costs_are_valid(c):
    assert isinstance(costs_from_dict(c["costs"]), PipelineCosts)
