"""The double buffer's configuration is checked where the daemon takes it (flags and
--policy-config); a state journaled before the checks still opens."""
from __future__ import annotations

import json

import pytest

from manager.managerd import build_parser, config_from_args
from manager.model import ManagerConfig
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
    ({"straggler_timeout_s": -5}, "straggler_timeout_s"), ({"max_straggler_s": 1}, "min_straggler_s"),
])
def test_a_bad_policy_config_value_is_refused_naming_the_file_section_and_field(tmp_path, buffer, field):
    with pytest.raises(ValueError, match=rf'^--policy-config "buffer": buffer config: {field} must be'):
        config_from_args(args_for(tmp_path, policy={"buffer": buffer}))


def test_an_unknown_or_malformed_buffer_section_is_refused(tmp_path):
    with pytest.raises(ValueError, match='--policy-config "buffer": .*pass_histroy'):
        config_from_args(args_for(tmp_path, policy={"buffer": {"pass_histroy": 4}}))
    with pytest.raises(ValueError, match='--policy-config "buffer" must be an object'):
        config_from_args(args_for(tmp_path, policy={"buffer": [1]}))


def test_a_state_written_with_a_config_now_refused_still_opens(tmp_path):
    """Before the checks, --straggler-min-seconds 7200 was taken (and clamped to the max
    where used). Upgraded, the manager must still open that state; the flags' config,
    checked, then replaces the journaled one."""
    from manager.state import StateStore

    old = ManagerConfig(budget=100, buffer=BufferConfig(min_straggler_s=7200.0, pass_history=0))
    StateStore(str(tmp_path / "s"), old, fsync=False).open().close()
    new = ManagerConfig(budget=100, buffer=BufferConfig(min_straggler_s=3000.0).check())
    st = StateStore(str(tmp_path / "s"), new, fsync=False).open()
    try:
        assert st.model.config == new
    finally:
        st.close()
    with pytest.raises(ValueError, match="--straggler-min-seconds: .*min_straggler_s must be <= max_straggler_s"):
        config_from_args(args_for(tmp_path, "--straggler-min-seconds", "7200"))
