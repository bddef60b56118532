"""The operator docs against the commands they describe: every flag that a daemon's or
cachectl's --help lists appears in docs/operations.md, and a flag value the docs call bad
is refused at start (exit 2, one line) rather than served; the bounds a daemon enforces on
its numeric flags are stated in their rows; metric and event names match what is exported."""
from __future__ import annotations

import argparse
import contextlib
import io
import re
from pathlib import Path

import pytest

from procs import ROOT

OPERATIONS = Path(ROOT, "docs", "operations.md")


def _parsers() -> dict[str, argparse.ArgumentParser]:
    """Each command line's parser, by the docs/operations.md section that documents it."""
    from cacheserver import serverd
    from manager import ctl, managerd

    out = {"### Flags": serverd.build_parser(), "## The cache manager": managerd.build_parser()}
    subs = next(a for a in ctl.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    out.update({f"## cachectl {name}": p for name, p in subs.choices.items()})
    return out


def _section(doc: str, heading: str) -> str:
    """From the heading that starts with `heading` (cachectl's commands: its section) to the next
    heading of that level or above."""
    if heading.startswith("## cachectl "):
        heading = "## cachectl"
    level = heading.split()[0]
    m = re.search(rf"^{re.escape(heading)}.*$", doc, re.M)
    assert m, f"docs/operations.md has no section {heading!r}"
    rest = doc[m.end():]
    nxt = re.search(rf"^#{{1,{len(level)}}} ", rest, re.M)
    return rest[:nxt.start()] if nxt else rest


@pytest.mark.parametrize("heading", list(_parsers()))
def test_every_flag_is_in_its_section_of_operations_md(heading):
    parser = _parsers()[heading]
    flags = {o for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
    text = _section(OPERATIONS.read_text(), heading)
    missing = sorted(f for f in flags if not re.search(rf"`[^`]*{re.escape(f)}(?![a-z0-9-])", text))
    assert not missing, f"{heading}: flags not in docs/operations.md: {missing}"


# A flag whose 0 (or negative) value the daemon refuses says so in its own row of the table:
# the docs had left out that --heartbeat-seconds and --decision-seconds must be > 0, and that
# --reconcile-seconds and the manager's --drain-seconds must be >= 0, so an operator learnt the
# bounds from an exit 2.
_POSITIVE_WORDS = re.compile(r"> 0|positive|at least 1")
_NOT_NEGATIVE_WORDS = re.compile(r">= 0")


def _daemon(heading: str):
    """The daemon's module and the required flags it starts with."""
    from cacheserver import serverd
    from manager import managerd
    return {"### Flags": (serverd, ["--listen", "h:1", "--data-dir", "/d", "--capacity", "1GB"]),
            "## The cache manager": (managerd, ["--listen", "h:1", "--state-dir", "/d"])}[heading]


def _refuses(heading: str, flag: str, value: str) -> bool:
    """Whether the daemon refuses `flag value` at start: argparse's exit 2 or config_from_args'
    ValueError (both exit 2, naming the flag). Neither opens a port or a directory."""
    mod, required = _daemon(heading)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            mod.config_from_args(mod.build_parser().parse_args([*required, flag, value]))
    except (SystemExit, ValueError):
        return True
    return False


def _numeric_flags(heading: str) -> list[str]:
    """Flags taking a number of seconds or a count; sizes and ports (where "-1" is no size
    or port at all, not a value below a bound) are left out."""
    from cacheserver import serverd
    from cacheserver.sizes import parse_size, size_flag
    mod, _ = _daemon(heading)
    not_numbers = {parse_size, size_flag, serverd._port}
    return [a.option_strings[-1] for a in mod.build_parser()._actions
            if a.option_strings and a.type is not None and a.type not in not_numbers]


@pytest.mark.parametrize("heading", ["### Flags", "## The cache manager"])
def test_operations_md_states_the_bounds_the_daemons_enforce(heading):
    text = _section(OPERATIONS.read_text(), heading)
    wrong = []
    for flag in _numeric_flags(heading):
        rows = [r for r in text.splitlines() if re.match(rf"\|\s*`{re.escape(flag)}(?![a-z0-9-])", r)]
        assert len(rows) == 1, f"{heading}: {flag} has {len(rows)} rows of its own in docs/operations.md"
        if _refuses(heading, flag, "0"):
            if not _POSITIVE_WORDS.search(rows[0]):
                wrong.append(f"{flag} refuses 0 but its row does not say '> 0'")
        elif _refuses(heading, flag, "-1") and not _NOT_NEGATIVE_WORDS.search(rows[0]):
            wrong.append(f"{flag} refuses -1 but its row does not say '>= 0'")
    assert not wrong, f"docs/operations.md, {heading}: " + "; ".join(wrong)


def test_bounds_check_tells_refused_values_apart():
    """The probe the docs test relies on: refusals are seen, accepted values are not."""
    assert _refuses("## The cache manager", "--heartbeat-seconds", "0")
    assert not _refuses("## The cache manager", "--heartbeat-seconds", "0.5")
    assert _refuses("### Flags", "--drain-seconds", "-1") and not _refuses("### Flags", "--drain-seconds", "0")
    assert "--heartbeat-seconds" in _numeric_flags("## The cache manager")
    assert "--max-item-size" not in _numeric_flags("### Flags")


# ---- metric names -----------------------------------------------------------------
def _documented_metrics(text: str) -> set[str]:
    """Metric families a doc names, `mlcache_manager_{a,b}_total` written out, `_total` dropped
    (prometheus_client's family names have none)."""
    names = set()
    for prefix, brace, rest in re.findall(r"(mlcache_(?:server|manager)_)(?:\{([^}]*)\})?(\w*)", text):
        for part in brace.split(",") if brace else [""]:
            names.add((prefix + re.sub(r"\s", "", part) + rest).removesuffix("_total"))
    return names


def test_operations_md_names_every_server_event_and_no_other():
    from cacheserver.counters import SERVER_COUNTERS
    text = _section(OPERATIONS.read_text(), "## Metrics and health")
    table = text.split("Event names", 1)[1].split("\n\n", 2)[1]
    documented = {n for row in table.splitlines()[2:] for n in re.findall(r"`(\w+)`", row.split("|")[1])}
    assert documented == set(SERVER_COUNTERS), (f"undocumented: {sorted(set(SERVER_COUNTERS) - documented)}, "
                                                f"not counters: {sorted(documented - set(SERVER_COUNTERS))}")


def test_manager_md_names_every_manager_metric_and_event(tmp_path):
    """The families and event names a real manager state exports (manager/metrics.py) against
    the Operations section of docs/manager.md, which had left out three event names."""
    from cacheserver.counters import Counters
    from manager.metrics import MANAGER_COUNTERS, ManagerCollector, gather
    from manager.model import ManagerConfig
    from manager.state import StateStore
    store = StateStore(str(tmp_path / "state"), ManagerConfig(), fsync=False).open()
    try:
        families = {f.name: f for f in ManagerCollector(lambda: gather(store, Counters(MANAGER_COUNTERS))).collect()}
    finally:
        store.close(snapshot=False)
    doc = _section(Path(ROOT, "docs", "manager.md").read_text(), "## Operations")
    assert _documented_metrics(doc) == set(families), (
        f"undocumented: {sorted(set(families) - _documented_metrics(doc))}, "
        f"not exported: {sorted(_documented_metrics(doc) - set(families))}")
    events = {s.labels["name"] for s in families["mlcache_manager_events"].samples}
    assert any(n.startswith("rpc_") for n in events)
    missing = sorted(n for n in events if f"`{n}`" not in doc and not (n.startswith("rpc_") and "`rpc_<Method>`" in doc))
    assert not missing, f"docs/manager.md does not name the manager events {missing}"


def test_documented_metrics_expands_braces():
    assert _documented_metrics("`mlcache_manager_{a,\n  b}_total`, `mlcache_server_events_total{name=\"x\"}`, "
                               "`mlcache_manager_datasets{option}`") == {
        "mlcache_manager_a", "mlcache_manager_b", "mlcache_server_events", "mlcache_manager_datasets"}
