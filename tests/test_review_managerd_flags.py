"""cachemanager refuses flags and --policy-config values that would silently break it:
a --job-timeout-seconds of 0 unregisters every job at each decision round, a
--server-timeout of 0 fails every call to the servers, and a NaN grace period (Python's
json reads NaN) never forgets a dataset. Each is refused at start, naming what is wrong."""
from __future__ import annotations

import subprocess

import pytest

from procs import manager_once


def start(tmp_path, *extra: str) -> subprocess.CompletedProcess:
    return manager_once(str(tmp_path / "st"), *extra)


@pytest.mark.parametrize("flag, value, says", [
    ("--job-timeout-seconds", "0", "--job-timeout-seconds must be > 0"),
    ("--job-timeout-seconds", "-1", "--job-timeout-seconds must be > 0"),
    ("--server-timeout", "0", "--server-timeout must be > 0"),
    ("--dataset-grace-seconds", "-5", "--dataset-grace-seconds must be >= 0"),
    ("--chunk-size", "0", "--chunk-size must be > 0"),  # 1-byte chunks, about one per item
    ("--snapshot-every", "0", "--snapshot-every must be > 0"),
    ("--metrics-port", "-1", "--metrics-port must be a port"),
])
def test_a_flag_out_of_range_is_refused_at_start(tmp_path, flag, value, says):
    r = start(tmp_path, flag, value)
    assert r.returncode == 2 and not r.stdout.startswith("READY"), r.stdout
    assert says in r.stderr, r.stderr


@pytest.mark.parametrize("text, says", [
    ('{"dataset_grace_s": NaN}', "NaN is not a number"),
    ('{"alloc": {"min_benefit": Infinity}}', "Infinity is not a number"),
    ('{"dataset_grace_s": -1}', '"dataset_grace_s" must be >= 0'),
    ('[1, 2]', "expected an object of sections"),
])
def test_a_policy_config_value_no_policy_can_use_is_refused(tmp_path, text, says):
    f = tmp_path / "policy.json"
    f.write_text(text)
    r = start(tmp_path, "--policy-config", str(f))
    assert r.returncode == 2 and not r.stdout.startswith("READY"), r.stdout
    assert says in r.stderr, r.stderr


def test_the_defaults_and_a_zero_grace_still_start(tmp_path):
    r = start(tmp_path, "--dataset-grace-seconds", "0", "--reconcile-seconds", "0")
    assert r.stdout.startswith("READY"), r.stderr
