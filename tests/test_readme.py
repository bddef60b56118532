"""README's "Use" steps, run as written: its shell block in bash from the repository
root, its Python block saved where the shell block runs it. Only the example's
directory and port are moved (to a temporary directory and a free port)."""
import os
import re
import socket
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLE_DIR = "/tmp/mlcache-example"
PORT = "7070"


def _free_port_pair() -> int:
    """A port whose successor (the data plane's default) is free too, when the OS allows."""
    for _ in range(20):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                    return port
                except OSError:
                    continue
    return port


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def test_readme_use_steps_run_as_pasted(tmp_path):
    if not (REPO / ".venv" / "bin" / "activate").exists():
        pytest.skip("no .venv: README's steps follow `make test` or `make demo`")
    use = (REPO / "README.md").read_text().split("## Use", 1)[1].split("\n## ", 1)[0]
    shell, python = _blocks(use, "bash")[0], _blocks(use, "python")[0]
    where, port = str(tmp_path / "ex"), str(_free_port_pair())

    def moved(text: str) -> str:
        return text.replace(EXAMPLE_DIR, where).replace(f":{PORT}", f":{port}")

    script_path = python.splitlines()[0].removeprefix("# ").strip()
    assert script_path.startswith(EXAMPLE_DIR) and script_path in shell
    os.makedirs(where)
    Path(moved(script_path)).write_text(moved(python))
    # The shell block starts a server with '&': stop it when the steps end.
    steps = "set -e\ntrap 'kill $(jobs -p) 2>/dev/null' EXIT\n" + moved(shell)
    # PYTHONPATH: this checkout's code, whatever checkout .venv's editable install points at
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run(["bash", "-c", steps], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("epoch ")]
    assert len(lines) == 2 and lines[0].startswith("epoch 0: 120 items"), r.stdout + r.stderr[-3000:]
    # the second epoch reads from the cache server (all of it, unless the server that the
    # steps start in the background came up after the first epoch had begun)
    assert int(re.search(r"hit rate (\d+)%", lines[1]).group(1)) > 0, lines
