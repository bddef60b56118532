"""tools/digest: an error reading the digest file names that file, never 'None'."""

from __future__ import annotations

import os

import pytest

from clients.digest_tool import main


@pytest.mark.skipif(not os.path.exists("/proc/self/mem"), reason="needs Linux /proc/self/mem")
@pytest.mark.parametrize("command", ["info", "verify"])
def test_read_error_names_the_digest_file(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    # /proc/self/mem opens but fails its first read (EIO): an OSError without a filename.
    assert main([command, "/proc/self/mem"]) == 1
    err = capsys.readouterr().err
    assert err == "digest: error: Input/output error: /proc/self/mem\n", err  # was ': None'
