"""The double buffer's configuration is checked where the daemon takes it: flags,
--policy-config and the journaled ``configure`` event."""
from __future__ import annotations

import json

import pytest

from manager.managerd import build_parser, config_from_args
from manager.model import ManagerConfig, ManagerModel, Rejected
from manager.policy import BufferConfig


def args_for(tmp_path, *extra: str, policy: dict | None = None):
    argv = ["--listen", "127.0.0.1:0", "--state-dir", str(tmp_path / "s"), *extra]
    if policy is not None:
        f = tmp_path / "policy.json"
        f.write_text(json.dumps(policy))
        argv += ["--policy-config", str(f)]
    return build_parser().parse_args(argv)


def test_flags_and_policy_config_set_the_buffer(tmp_path):
    cfg = config_from_args(args_for(tmp_path, "--straggler-seconds", "30", "--max-marked-seconds", "90",
                                    policy={"buffer": {"pass_history": 4, "min_straggler_s": 5}}))
    assert cfg.model.buffer == BufferConfig(straggler_timeout_s=30.0, max_marked_s=90.0, pass_history=4,
                                            min_straggler_s=5)


@pytest.mark.parametrize("flag, value, field", [
    ("--straggler-seconds", "0", "straggler_timeout_s"),
    ("--straggler-min-seconds", "-1", "min_straggler_s"),
    ("--max-marked-seconds", "0", "max_marked_s"),
])
def test_a_bad_flag_is_refused_naming_the_flag_and_the_field(tmp_path, flag, value, field):
    with pytest.raises(ValueError, match=rf"^{flag}: buffer config: {field} must be"):
        config_from_args(args_for(tmp_path, flag, value))


@pytest.mark.parametrize("buffer, field", [
    ({"pass_history": 0}, "pass_history"), ({"load_threshold": 0}, "load_threshold"),
    ({"straggler_timeout_s": -5}, "straggler_timeout_s"), ({"max_straggler_s": 1}, "max_straggler_s"),
])
def test_a_bad_policy_config_value_is_refused_naming_the_file_section_and_field(tmp_path, buffer, field):
    with pytest.raises(ValueError, match=rf'^--policy-config "buffer": buffer config: {field} must be'):
        config_from_args(args_for(tmp_path, policy={"buffer": buffer}))


def test_an_unknown_or_malformed_buffer_section_is_refused(tmp_path):
    with pytest.raises(ValueError, match='--policy-config "buffer": .*pass_histroy'):
        config_from_args(args_for(tmp_path, policy={"buffer": {"pass_histroy": 4}}))
    with pytest.raises(ValueError, match='--policy-config "buffer" must be an object'):
        config_from_args(args_for(tmp_path, policy={"buffer": [1]}))


def test_a_configure_event_with_a_bad_buffer_is_rejected_before_anything_changes():
    m = ManagerModel(ManagerConfig(budget=100))
    before = m.to_dict()
    bad = ManagerConfig(budget=200).to_dict()
    bad["buffer"]["pass_history"] = 0
    with pytest.raises(Rejected, match="pass_history") as e:
        m.apply({"type": "configure", "config": bad, "now": 1.0})
    assert e.value.code == "INVALID_ARGUMENT" and m.to_dict() == before
