"""tools/digest verify through a store that ignores Range (python -m http.server): the
few records of a file read back are reported as the store's fault, not as items whose
size changed."""

from __future__ import annotations

from pathlib import Path

import pytest
import test_digest_edges

from clients import digest_tool
from clients.digest import Digest
from clients.tfrecord import encode_record

no_range_store = test_digest_edges.no_range_store  # the fixture: a loopback http.server


def test_verify_names_a_store_ignoring_range(tmp_path: Path, no_range_store: tuple[Path, str],
                                             capsys: pytest.CaptureFixture[str]) -> None:
    root, url = no_range_store
    (root / "a.tfrecord").write_bytes(b"".join(encode_record(bytes([k]) * (50 + k)) for k in range(3)))
    assert digest_tool.main([str(root), "-o", str(tmp_path / "l.dig"), "--format", "tfrecord", "-q"]) == 0
    d = Digest.load(tmp_path / "l.dig")  # made locally, verified through the HTTP server
    Digest.from_arrays(url, d.kind, d.hashes, d.sizes, d.offsets, d.path_index, d.paths, d.meta,
                       blake3=d.blake3).save(tmp_path / "r.dig")
    capsys.readouterr()
    assert digest_tool.main(["verify", str(tmp_path / "r.dig"), "-q"]) == 1
    err = capsys.readouterr().err
    assert ("verify: item 1: a.tfrecord @ 78+51: the store ignores range requests (asked for bytes 78-128, "
            "got 201 bytes" in err), err
    assert "size mismatch" not in err, err
