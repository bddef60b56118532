"""Examples in the docs, run as written, and what the docs promise an operator can see:
the port a `--metrics-port 0` picked (in either log format, for server and manager), the
preprocessing pipelines and Autocache block of docs/preprocess.md, tools/digest's flags in
digest-format.md, and README's `make test` time against the Makefile's."""
from __future__ import annotations

import io
import json
import os
import re
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from procs import ROOT, cacheserver, cachemanager


def _started(log_path: Path, msg: str) -> str:
    lines = [ln for ln in log_path.read_text().splitlines() if msg in ln]
    assert lines, f"no {msg!r} line in {log_path}"
    return lines[0]


def _scrape(address: str) -> bytes:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        return r.read()


def test_text_log_names_the_metrics_port_zero_picked(tmp_path):
    """--log-format text (what docs/manager.md suggests for humans, `cachectl local-cluster`'s
    default) dropped every field of an event: `cacheserver started` said nothing more, so the
    port --metrics-port 0 picked, which docs/operations.md says that line names, was unknowable."""
    s = cacheserver(str(tmp_path / "a"), "64MB", 0, "--metrics-port", "0").start()
    try:
        line = _started(tmp_path / "a" / "server.log", "cacheserver started")
        m = re.search(r" metrics=(\S+)", line)
        assert m, line
        assert f" listen={s.address}" in line, line
        assert b"mlcache_server_items" in _scrape(m.group(1))
    finally:
        assert s.stop() == 0
    stopped = _started(tmp_path / "a" / "server.log", "cacheserver stopped")
    counters = json.loads(re.search(r" counters=(\{.*\})", stopped).group(1))  # a dict: JSON, spaces and all
    assert counters["gets"] == 0


def test_manager_log_names_the_metrics_port_zero_picked(tmp_path):
    """docs/operations.md: the manager's --metrics-port 0 picks a free port; no log line said
    which, so nothing could scrape it."""
    m = cachemanager(str(tmp_path / "m"), 0, "--metrics-port", "0", "--log-format", "json").start()
    try:
        started = json.loads(_started(tmp_path / "m" / "manager.log", '"cachemanager started"'))
        assert started["metrics"] and not started["metrics"].endswith(":0"), started
        assert b"mlcache_manager_ring_size" in _scrape(started["metrics"])
    finally:
        assert m.stop() == 0
    off = cachemanager(str(tmp_path / "off"), 0, "--log-format", "json").start()
    try:
        assert json.loads(_started(tmp_path / "off" / "manager.log", '"cachemanager started"'))["metrics"] is None
    finally:
        assert off.stop() == 0


def _jpeg() -> bytes:
    from PIL import Image
    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (300, 280, 3), dtype=np.uint8)).save(out, "JPEG")
    return out.getvalue()


def _doc_pipelines() -> list[str]:
    """Every `Pipeline([...])` expression in docs/preprocess.md's Python blocks."""
    text = Path(ROOT, "docs", "preprocess.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    found = []
    for b in blocks:
        for m in re.finditer(r"Pipeline\(\[", b):
            depth, end = 0, m.start()
            for end in range(m.start(), len(b)):  # to the call's closing parenthesis, over lines
                depth += {"(": 1, ")": -1}.get(b[end], 0)
                if depth == 0 and b[end] == ")":
                    break
            found.append(b[m.start():end + 1])
    assert len(found) >= 2, found
    return found


@pytest.mark.parametrize("expr", _doc_pipelines())
def test_preprocess_md_pipelines_run_on_an_item(expr):
    """docs/preprocess.md's autocache example wrote RandomCrop(224), torchvision's spelling;
    ours takes an area scale, so pasted it failed on the first item with `argument after *
    must be an iterable, not int`."""
    from preprocess import Pipeline, autocache, vision
    names = {n: getattr(vision, n) for n in dir(vision) if not n.startswith("_")}
    pipe = eval(expr, {**names, "Pipeline": Pipeline, "autocache": autocache})
    out = pipe.apply(_jpeg())
    assert out.shape[:2] == (224, 224), (expr, out.shape)


@pytest.mark.parametrize("bad", [dict(scale=224), dict(scale=(224,)), dict(scale=(1.0, 0.5)), dict(ratio=(0, 1))])
def test_random_crop_refuses_a_size_where_it_takes_a_scale(bad):
    from preprocess.vision import RandomCrop
    with pytest.raises(ValueError, match=rf"RandomCrop\({next(iter(bad))}=.*Resize\(size\)"):
        RandomCrop(**bad)


def test_digest_format_md_names_every_digest_flag():
    """Each of tools/digest's option strings, long and short, appears in digest-format.md."""
    from clients import digest_tool
    text = Path(ROOT, "docs", "digest-format.md").read_text()
    missing = []
    for make in (digest_tool._create_parser, digest_tool._info_parser, digest_tool._verify_parser):
        for a in make("digest")._actions:
            missing += [o for o in a.option_strings if o not in ("-h", "--help")
                        and not re.search(rf"{re.escape(o)}(?![A-Za-z0-9-])", text)]
    assert not missing, f"docs/digest-format.md does not name {sorted(set(missing))}"


def test_preprocess_md_autocache_block_runs_the_pipeline_it_builds(tmp_path, monkeypatch, capsys):
    """docs/preprocess.md's Autocache block built a pipeline with the `autocache` marker and then
    called `ds.loader(..., autocache="auto")` on a `ds` it never gave that pipeline: pasted, it
    either ran an earlier transform without the marker or, on its own, raised ValueError (no
    transform=). Run as written after the first block's imports, on an embedded cache."""
    from filedigest import write_files_digest
    text = Path(ROOT, "docs", "preprocess.md").read_text()
    first = re.findall(r"```python\n(.*?)```", text, re.S)[0]
    block = re.search(r"## Autocache\n+```python\n(.*?)```", text, re.S).group(1)
    os.replace(write_files_digest(tmp_path / "train", [_jpeg() for _ in range(4)]), tmp_path / "train.dig")
    monkeypatch.chdir(tmp_path)  # the block reads "train.dig"; the embedded cache and costs go under tmp
    monkeypatch.setenv("MLCACHE_DIR", str(tmp_path / "mlcache"))
    ns: dict = {"__name__": "docs_example"}
    exec("\n".join(ln for ln in first.splitlines() if ln.startswith(("from ", "import "))), ns)
    try:
        exec(block, ns)
        assert ns["ds"].transform is ns["pipe"]  # the loader runs the block's pipeline, marker and all
        assert ns["loader"].autocache.mode in ("source", "compute", "transformed")
        assert capsys.readouterr().out.startswith(ns["loader"].autocache.mode + " ")
    finally:
        for name in ("loader", "ds"):
            if name in ns:
                ns[name].close()


def test_readme_states_the_suite_time_the_makefile_measured():
    """README said `make test` takes about 13 minutes on 2 cores; the Makefile's measurement
    (the suite as it is now) says 14-16."""
    make = re.search(r"about (\d+)-(\d+) min on a 2-core", Path(ROOT, "Makefile").read_text())
    readme = re.search(r"`make test` runs the suite in two\s+pytest-xdist workers \(about (\d+) minutes on 2 cores\)",
                       Path(ROOT, "README.md").read_text())
    assert make and readme, "README's or the Makefile's suite time is no longer where this test reads it"
    assert int(make.group(1)) <= int(readme.group(1)) <= int(make.group(2)), (readme.group(0), make.group(0))
