"""The command lines' help and error texts against the code: each flag of `cacheserver`,
`cachemanager` and `cachectl` states its default once, as "(default: X)", and X is what the
parser gives; `tools/digest verify --help` names every check verify makes; Digest.name says
why a digest has no names; `cachectl ring ADDR` does not call a ring the server learnt from
the manager its --peers."""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from cacheserver.client.server_client import ServerClient
from clients.digest import Digest
from procs import ROOT, manager_with_server, wait_until

# The required flags each daemon parses with, to read the defaults the code really uses.
DAEMONS = {
    "cacheserver.serverd": ["--listen", "h:1", "--data-dir", "/d", "--capacity", "1GB"],
    "manager.managerd": ["--listen", "h:1", "--state-dir", "/d"],
}
# A default with no value (a switch's is False): the help may say what the flag's absence
# means, never "None", "" or "False".
NO_VALUE = (None, "")


def run(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    # COLUMNS: argparse wraps at the terminal's width; 80 is what a plain terminal shows.
    return subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, COLUMNS="80"))


def help_entries(text: str) -> dict[str, str]:
    """Each option's help text from --help output, by its option strings, wrapped lines joined."""
    body = text.split("\noptions:\n", 1)[1]
    out: dict[str, str] = {}
    for block in re.split(r"\n(?=  -)", body):
        block = block.strip("\n")
        first, _, rest = block.partition("\n")
        m = re.match(r"\s*(\S.*?)(?:\s{2,}(.*))?$", first)
        invocation, same_line = m.group(1), m.group(2) or ""
        words = " ".join([same_line, *(line.strip() for line in rest.splitlines())])
        for flag in re.findall(r"(?:^|, )(--?[A-Za-z][\w-]*)", invocation):
            out[flag] = " ".join(words.split())
    return out


def stated_defaults(help_text: str) -> list[str]:
    """Every default a flag's help states, in whatever style: "(default: X)" or "(default X)"."""
    return re.findall(r"\(default\b:?\s*([^()]*)\)", help_text)


def default_problems(help_out: str, parser: argparse.ArgumentParser, required: list[str]) -> list[str]:
    """What is wrong with the defaults the --help output states, against what `parser` parses."""
    entries = help_entries(help_out)
    parsed = vars(parser.parse_args(required))
    problems = []
    for a in parser._actions:
        if not a.option_strings or a.default is argparse.SUPPRESS:
            continue
        flag = a.option_strings[-1] if a.option_strings[-1].startswith("--") else a.option_strings[0]
        text = entries[flag]
        said = stated_defaults(text)
        if len(said) > 1:
            problems.append(f"{flag} states {len(said)} defaults: {text!r}")
        if len(re.findall(r"\(default\b", text)) != len(re.findall(r"\(default: ", text)):
            problems.append(f"{flag}: a default not written '(default: X)': {text!r}")
        has_value = not a.required and a.default not in NO_VALUE and a.default is not False
        if has_value and not said:
            problems.append(f"{flag} does not state its default {parsed[a.dest]!r}")
        if not said:
            continue
        if a.default in NO_VALUE or a.default is False:
            if said[0] in ("None", "", "False"):
                problems.append(f"{flag} states its default as {said[0]!r}, which says nothing")
            continue
        value = a.type(said[0]) if a.type is not None else said[0]
        if value != parsed[a.dest]:
            problems.append(f"{flag} states default {said[0]!r}, the parser's is {parsed[a.dest]!r}")
    return problems


@pytest.mark.parametrize("module", list(DAEMONS))
def test_daemon_help_states_each_default_once_and_truly(module):
    import importlib
    r = run("-m", module, "--help")
    assert r.returncode == 0, r.stderr
    problems = default_problems(r.stdout, importlib.import_module(module).build_parser(), DAEMONS[module])
    assert not problems, "\n".join(problems)


def test_cachectl_help_states_each_default_once_and_truly():
    """Every cachectl command, in one layout: `status` said "(default: None)" and "(default:
    False)", `ring --peers` "(default: )"."""
    from manager import ctl
    sub = next(a for a in ctl.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    required = {"certs": ["--out", "/d"], "stats": ["h:1"], "ring": [], "local-cluster": [],
                "status": ["--manager", "h:1"]}
    assert set(sub.choices) == set(required)
    problems = []
    for name, parser in sub.choices.items():
        r = run("-m", "manager.ctl", name, "--help")
        assert r.returncode == 0, r.stderr
        problems += [f"cachectl {name}: {p}" for p in default_problems(r.stdout, parser, required[name])]
    assert not problems, "\n".join(problems)


def test_the_help_reader_sees_defaults_and_flags():
    # The checks above pass on a reader that found nothing: it reads these.
    r = run("-m", "cacheserver.serverd", "--help")
    e = help_entries(r.stdout)
    assert stated_defaults(e["--claim-ttl"]) == ["10.0"] and stated_defaults(e["--max-item-size"]) == ["64MiB"]
    assert "--help" in e and "--tls-ca" in e and not stated_defaults(e["--sync-writes"])
    assert stated_defaults("a (default: x) (default y)") == ["x", "y"]


def test_size_defaults_shown_as_sizes_parse_to_the_old_values():
    from cacheserver import serverd
    from manager import managerd
    s = vars(serverd.build_parser().parse_args(DAEMONS["cacheserver.serverd"]))
    assert (s["max_item_size"], s["max_batch_size"], s["max_inflight_bytes"]) == (64 << 20, 256 << 20, 1 << 30)
    assert vars(managerd.build_parser().parse_args(DAEMONS["manager.managerd"]))["chunk_size"] == 15 * 10**9


# ---- tools/digest ----------------------------------------------------------------------
def test_digest_verify_help_names_every_check():
    """verify compares sizes, SHA-256 and, in a format-3 digest, BLAKE3 (clients/digest_verify.py,
    docs/digest-format.md); its help said SHA-256 alone."""
    r = run("tools/digest", "verify", "--help")
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    assert "size" in text and "SHA-256" in text and "BLAKE3" in text, text


def _digest(tmp_path: Path, *args: str) -> Digest:
    out = tmp_path / "d.dig"
    r = run("tools/digest", str(tmp_path / "src"), "-o", str(out), "-q", *args)
    assert r.returncode == 0, r.stderr
    return Digest.load(out)


def test_name_of_a_files_digest_says_files_have_no_names(tmp_path):
    """A files digest from tools/digest is format 3: "made before format version 2" was false.
    Only tar digests record names; a files item is a whole file, named by its location."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.jpg").write_bytes(b"x")
    d = _digest(tmp_path)
    assert d.version == 3 and not d.has_names
    with pytest.raises(LookupError) as e:
        d.name(0)
    msg = str(e.value)
    assert "before format version" not in msg and "files digest" in msg and "'a.jpg'" in msg, msg
    with pytest.raises(IndexError, match="item 5 out of range"):
        d.name(5)


def test_name_of_a_tar_digest_is_its_member_and_a_version_1_tar_digest_says_why_not(tmp_path):
    (tmp_path / "src").mkdir()
    member = tmp_path / "k.cls"
    member.write_bytes(b"3")
    with tarfile.open(tmp_path / "src" / "s.tar", "w", format=tarfile.USTAR_FORMAT) as t:
        t.add(member, "000.cls")
    d = _digest(tmp_path, "--format", "tar")
    assert d.name(0) == "000.cls"
    old = Digest.from_arrays(d.root, "tar", d.hashes, d.sizes, d.offsets, d.path_index, d.paths)
    assert old.version == 1
    with pytest.raises(LookupError, match=r"tar digest records no item names \(format version 1"):
        old.name(0)
    rec = Digest.from_arrays("file:///x", "tfrecord", bytes(32), [3], [12], [0], ["r.tfrecord"])
    with pytest.raises(LookupError, match="tfrecord digest records no item names: item 0 is the record "
                                          "at byte 12 of 'r.tfrecord'"):
        rec.name(0)


# ---- cachectl ring -------------------------------------------------------------------
def test_ring_learnt_from_the_manager_is_not_called_the_servers_peers(tmp_path):
    """A server run with --manager and no --peers serves the manager's ring in Info.peers;
    `cachectl ring ADDR` said "from --peers of ADDR", a flag the server was never given."""
    with manager_with_server(str(tmp_path)) as (_, srv):
        with ServerClient(srv.address, local_read=False) as c:
            wait_until(lambda: list(c.info().peers), "the server's ring from the manager", timeout=20)
        r = run("-m", "manager.ctl", "ring", srv.address)
        assert r.returncode == 0, r.stderr
        header = r.stdout.splitlines()[0]
        assert "--peers of" not in header and "manager's ring" in header, header
        assert "not in its own" not in r.stdout, r.stdout
        r = run("-m", "manager.ctl", "ring", srv.address, "--json")
        source = json.loads(r.stdout)["source"]
        assert "--peers of" not in source and "manager's ring" in source, source
