"""The shipped deployment files start `cacheserver` with flags it accepts.

systemd: the unit's ExecStart with the example env file substituted the way
systemd does (`${VAR}` one argument, `$VAR` split at whitespace).
Kubernetes: the DaemonSet container's args with `$(VAR)` taken from its env
(ConfigMap keys). Both go through cacheserver.serverd.build_parser(), so an
unknown or misspelt flag fails here, not on a node.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import shlex

import pytest

from cacheserver.serverd import build_parser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UNIT = os.path.join(ROOT, "deploy", "systemd", "cacheserver.service")
ENV = os.path.join(ROOT, "deploy", "systemd", "cacheserver.env")
DAEMONSET = os.path.join(ROOT, "deploy", "k8s", "cacheserver-daemonset.yaml")
OPERATIONS = os.path.join(ROOT, "docs", "operations.md")


def parse_flags(argv: list[str]):
    """build_parser().parse_args, turning argparse's exit into a test failure with its message.
    Abbreviations are refused: a deploy file spells every flag out (`--evict` would pass
    argparse's prefix matching today and break when another --evict* flag appears)."""
    parser = build_parser()
    parser.allow_abbrev = False
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parser.parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"cacheserver rejects {argv!r} (exit {e.code}): {err.getvalue().strip()}")


# ---- systemd -----------------------------------------------------------------
def read_unit(path: str) -> dict[str, dict[str, list[str]]]:
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    with open(path) as f:
        for raw in f:
            line = raw.strip()
            if not line or line.startswith(("#", ";")):
                continue
            if line.startswith("["):
                current = sections.setdefault(line.strip("[]"), {})
                continue
            key, _, value = line.partition("=")
            current.setdefault(key.strip(), []).append(value.strip())
    return sections


def read_env_file(path: str) -> dict[str, str]:
    env = {}
    with open(path) as f:
        for raw in f:
            line = raw.strip()
            if not line or line.startswith(("#", ";")):
                continue
            key, sep, value = line.partition("=")
            assert sep and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key), f"bad env line: {raw!r}"
            words = shlex.split(value)
            env[key] = " ".join(words)
    return env


def systemd_argv(exec_start: str, env: dict[str, str]) -> list[str]:
    """Split ExecStart and substitute variables as systemd does."""
    words = shlex.split(exec_start)
    exe = words[0].lstrip("-@:+!")
    out = [exe]
    for w in words[1:]:
        m = re.fullmatch(r"\$([A-Za-z_][A-Za-z0-9_]*)", w)
        if m:  # $VAR alone: split at whitespace, zero or more arguments
            out += env.get(m.group(1), "").split()
            continue
        out.append(re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", lambda m: env.get(m.group(1), ""), w))
    return out


@pytest.fixture(scope="module")
def unit():
    return read_unit(UNIT)


def test_systemd_unit_settings(unit):
    svc = unit["Service"]
    assert svc["EnvironmentFile"] == ["/etc/mlcache/cacheserver.env"]
    assert svc["Type"] == ["simple"]  # foreground process
    assert svc["Restart"] == ["on-failure"]
    assert svc["KillSignal"] == ["SIGTERM"]
    assert svc["TimeoutStopSec"] == ["15"]
    assert int(svc["LimitNOFILE"][0]) >= 65536
    assert svc["NoNewPrivileges"] == ["yes"]
    assert svc["ProtectSystem"] == ["strict"]
    assert "multi-user.target" in unit["Install"]["WantedBy"]
    assert "StartLimitBurst" not in svc  # belongs to [Unit]; systemd ignores it in [Service]


def test_systemd_execstart_is_accepted(unit):
    env = read_env_file(ENV)
    for key in ("LISTEN", "DATA_DIR", "CAPACITY", "PEERS", "MANAGER", "METRICS_PORT", "TLS_CERT", "TLS_KEY",
                "TLS_CA", "DRAIN_SECONDS", "EXTRA_ARGS"):
        assert key in env, f"{ENV} does not document {key}"
    (exec_start,) = unit["Service"]["ExecStart"]
    argv = systemd_argv(exec_start, env)
    assert os.path.basename(argv[0]) == "cacheserver"
    args = parse_flags(argv[1:])
    assert args.listen == env["LISTEN"]
    assert args.data_dir == env["DATA_DIR"]
    assert args.peers == env["PEERS"]
    assert args.manager == env["MANAGER"]
    assert args.metrics_port == int(env["METRICS_PORT"])
    assert (args.tls_cert, args.tls_key, args.tls_ca) == (env["TLS_CERT"], env["TLS_KEY"], env["TLS_CA"])
    assert args.drain_seconds < int(unit["Service"]["TimeoutStopSec"][0])
    assert args.log_format == "json"


def test_systemd_execstart_variants(unit):
    """TLS off (empty TLS_*), no peers, a manager, and several EXTRA_ARGS still parse."""
    from cacheserver.serverd import config_from_args
    env = read_env_file(ENV)
    env.update(TLS_CERT="", TLS_KEY="", TLS_CA="", PEERS="", MANAGER="10.0.0.5:7500",
               EXTRA_ARGS="--eviction none --sync-writes --log-level debug")
    (exec_start,) = unit["Service"]["ExecStart"]
    args = parse_flags(systemd_argv(exec_start, env)[1:])
    cfg = config_from_args(args)
    assert cfg.tls is None and cfg.peers == [] and cfg.manager == "10.0.0.5:7500"
    assert args.eviction == "none" and args.sync_writes and args.log_level == "debug"

    env.update(MANAGER="", EXTRA_ARGS="")
    cfg = config_from_args(parse_flags(systemd_argv(exec_start, env)[1:]))
    assert not cfg.manager and cfg.capacity == 1500 * 10**9


# ---- Kubernetes ----------------------------------------------------------------
@pytest.fixture(scope="module")
def manifests():
    import yaml  # PyYAML, from the dev extra; a missing one fails these tests rather than skipping them
    with open(DAEMONSET) as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def container_env(container: dict, manifests: dict) -> dict[str, str]:
    env = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = str(e["value"])
            continue
        src = e["valueFrom"]
        if "configMapKeyRef" in src:
            ref = src["configMapKeyRef"]
            cm = manifests.get(("ConfigMap", ref["name"]))
            assert cm is not None, f"env {e['name']}: no ConfigMap {ref['name']} in the manifest"
            assert ref["key"] in cm["data"], f"env {e['name']}: ConfigMap has no key {ref['key']}"
            env[e["name"]] = str(cm["data"][ref["key"]])
        elif "fieldRef" in src:
            env[e["name"]] = "10.0.0.11"  # status.hostIP and friends
        else:
            pytest.fail(f"env {e['name']}: unsupported source {src}")
    return env


def k8s_expand(arg: str, env: dict[str, str]) -> str:
    def sub(m):
        assert m.group(1) in env, f"arg {arg!r} names $({m.group(1)}), which the container env lacks"
        return env[m.group(1)]
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, arg)


def test_daemonset_args_are_accepted(manifests):
    ds = manifests[("DaemonSet", "cacheserver")]
    spec = ds["spec"]["template"]["spec"]
    (c,) = [c for c in spec["containers"] if c["name"] == "cacheserver"]
    env = container_env(c, manifests)
    argv = [k8s_expand(a, env) for a in c.get("command", [])[1:] + c["args"]]
    assert c["command"][0] == "cacheserver"
    args = parse_flags(argv)

    # The ports the probes, the container and the Service use are the ones the server binds.
    grpc_port = int(args.listen.rsplit(":", 1)[1])
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["grpc"] == grpc_port
    assert ports["data"] == grpc_port + 1  # --data-listen auto
    assert ports["metrics"] == args.metrics_port
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert c[probe]["grpc"]["port"] == grpc_port, probe
    assert all(p["hostPort"] == p["containerPort"] for p in c["ports"])
    assert spec["hostNetwork"] is True
    assert spec["terminationGracePeriodSeconds"] > args.drain_seconds
    assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]

    # --data-dir is the hostPath volume.
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert args.data_dir in mounts, f"--data-dir {args.data_dir} is not a volume mount"
    vols = {v["name"]: v for v in spec["volumes"]}
    assert "hostPath" in vols[mounts[args.data_dir]]

    svc = manifests[("Service", "cacheserver")]
    assert svc["spec"]["selector"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    assert {p["port"] for p in svc["spec"]["ports"]} == set(ports.values())


def test_daemonset_tls_variant_is_accepted(manifests):
    """The commented-out TLS flags parse and point into the commented-out Secret mount."""
    with open(DAEMONSET) as f:
        text = f.read()
    tls_args = re.findall(r"^\s*#\s*- (--tls-\S+)$", text, re.M)
    assert len(tls_args) == 3
    c = manifests[("DaemonSet", "cacheserver")]["spec"]["template"]["spec"]["containers"][0]
    env = container_env(c, manifests)
    args = parse_flags([k8s_expand(a, env) for a in c["args"]] + tls_args)
    mount = re.search(r"#\s*mountPath: (\S+)", text.split("- name: tls", 1)[1]).group(1)
    for path in (args.tls_cert, args.tls_key, args.tls_ca):
        assert path.startswith(mount + "/")


@pytest.mark.parametrize("flag", ["--no-such-flag", "--evict"])
def test_parse_flags_fails_on_unknown_flag(flag):
    with pytest.raises(pytest.fail.Exception, match=f"unrecognized arguments: {flag}"):
        parse_flags(["--listen", "h:1", "--data-dir", "/d", "--capacity", "1GB", flag, "lru"])


# ---- docs ----------------------------------------------------------------------
def test_operations_doc_lists_every_flag():
    with open(OPERATIONS) as f:
        text = f.read()
    flags = [s for a in build_parser()._actions for s in a.option_strings if s.startswith("--") and s != "--help"]
    missing = [f for f in flags if f"`{f}" not in text]
    assert not missing, f"docs/operations.md does not document {missing}"


def test_daemonset_tls_secret_is_readable_by_the_server(manifests):
    """A Secret volume's files belong to root, group fsGroup (root without one): with
    defaultMode 0440 and no fsGroup, the server (uid 10001) could not read its key."""
    with open(DAEMONSET) as f:
        text = f.read()
    mode = int(re.search(r"#\s*defaultMode: (0[0-7]+)", text.split("secretName: cacheserver-tls", 1)[1]).group(1), 8)
    pod = manifests[("DaemonSet", "cacheserver")]["spec"]["template"]["spec"]["securityContext"]
    c = manifests[("DaemonSet", "cacheserver")]["spec"]["template"]["spec"]["containers"][0]
    uid = c.get("securityContext", {}).get("runAsUser", pod.get("runAsUser"))
    assert uid != 0
    group_reads = mode & 0o040 and pod.get("fsGroup") is not None
    assert group_reads or mode & 0o004, f"defaultMode {mode:o}, fsGroup {pod.get('fsGroup')}"
