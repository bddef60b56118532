"""The shipped deployment files start `cacheserver` with flags it accepts.

systemd: the unit's ExecStart with the example env file substituted the way
systemd does (`${VAR}` one argument, `$VAR` split at whitespace).
Kubernetes: the DaemonSet container's args with `$(VAR)` taken from its env
(ConfigMap keys). Both go through cacheserver.serverd.build_parser(), so an
unknown or misspelt flag fails here, not on a node. Then both command lines are
run (addresses, ports and the store moved to loopback and tmp_path): they serve,
and drain on SIGTERM within the supervisor's stop timeout.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import time

import pytest

from cacheserver.serverd import build_parser
from procs import Daemon, cachemanager, free_port, wait_ring

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


def container_env(container: dict, manifests: dict, host_ip: str = "10.0.0.11") -> dict[str, str]:
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
            env[e["name"]] = host_ip  # status.hostIP and friends
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
    # A server registers with the manager under --listen (a wildcard one: the host name).
    assert args.listen in args.peers.split(","), f"--listen {args.listen} is not this node's PEERS entry"
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


# ---- what the files and deploy/README.md's install steps must agree on ----------------------
DEPLOY_README = os.path.join(ROOT, "deploy", "README.md")


def test_systemd_paths_and_user_agree_with_the_install_steps(unit):
    """The store is the unit's only writable path, on the mount it waits for; the binary, the
    user, the env file and the TLS files are where deploy/README.md's steps put them."""
    with open(DEPLOY_README) as f:
        readme = f.read()
    svc, env = unit["Service"], read_env_file(ENV)
    assert env["DATA_DIR"] == "/var/lib/" + svc["StateDirectory"][0]  # ProtectSystem=strict: else read-only
    assert any(env["DATA_DIR"].startswith(p) for p in unit["Unit"]["RequiresMountsFor"])
    venv = shlex.split(svc["ExecStart"][0])[0].rsplit("/bin/", 1)[0]
    assert f"python3 -m venv {venv}" in readme and f"{venv}/bin/pip install" in readme, venv
    user = svc["User"][0]
    assert svc["Group"] == [user] and re.search(rf"useradd --system .*\b{user}$", readme, re.M), user
    assert f"cacheserver.env {svc['EnvironmentFile'][0]}" in readme
    for key, name in (("TLS_CERT", "server.pem"), ("TLS_KEY", "server-key.pem"), ("TLS_CA", "ca.pem")):
        where = os.path.dirname(env[key])
        assert os.path.basename(env[key]) == name and re.search(rf"install .*{re.escape(name)}.* {where}/", readme), key


def test_daemonset_ids_paths_and_ports_agree_with_the_readme(manifests):
    """One uid/gid for the server, its data dir's owner, the image's USER and same-host
    clients' group; the scrape annotation names the metrics port the server binds."""
    with open(DEPLOY_README) as f:
        readme = f.read()
    spec, c, argv, _ = _daemonset(manifests)
    args = parse_flags(argv[1:])
    uid, gid = spec["securityContext"]["runAsUser"], spec["securityContext"]["runAsGroup"]
    (init,) = spec["initContainers"]
    assert f"chown {uid}:{gid} {args.data_dir}" in init["command"][-1]
    assert f"USER {uid}:{gid}" in readme and f"supplementalGroups: [{gid}]" in readme
    annotations = manifests[("DaemonSet", "cacheserver")]["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == args.metrics_port
    host_path = {v["name"]: v for v in spec["volumes"]}["data"]["hostPath"]["path"]
    assert f"`{host_path}`" in readme and f"{args.data_dir}/data.sock" in readme


# ---- the daemons, started as the files start them ---------------------------------
# What names the machine (addresses, ports, the store's directory and size, TLS files) is
# replaced by loopback, free ports and tmp_path; every other argument is the file's own.
def _start(argv: list[str], log_dir) -> Daemon:
    """`cacheserver` with a deploy file's arguments (its console script is serverd.main)."""
    assert os.path.basename(argv[0]) == "cacheserver", argv[0]
    return Daemon(["cacheserver.serverd", *argv[1:]], log_path=str(log_dir / "server.log")).start(timeout=60)


def _health(address: str, tls=None, service: str = "") -> int:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from cacheserver.tls import grpc_channel
    with grpc_channel(address, tls) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                    timeout=10).status


def _serves(d: Daemon, data_dir, metrics_port: int, tls=None) -> None:
    """A put and a get round trip, SERVING health, data.sock in the data dir, metrics."""
    import hashlib
    import urllib.request
    from grpc_health.v1 import health_pb2
    from cacheserver.client.server_client import ServerClient
    value = b"deploy" * 100
    key = hashlib.sha256(value).digest()
    with ServerClient(d.address, tls=tls) as c:
        info = c.info()
        assert info.tls == (tls is not None)
        assert info.unix_socket == os.path.join(str(data_dir), "data.sock")
        c.put([(key, value)])
        assert bytes(c.get([key])[0]) == value
    assert _health(d.address, tls) == health_pb2.HealthCheckResponse.SERVING
    host = d.address.rsplit(":", 1)[0]
    with urllib.request.urlopen(f"http://{host}:{metrics_port}/metrics", timeout=10) as r:
        assert b"mlcache_server_items 1.0" in r.read()


def _stopped_within(d: Daemon, limit: float) -> None:
    t0 = time.monotonic()
    assert d.stop(timeout=limit + 30) == 0
    took = time.monotonic() - t0
    assert took < limit, f"SIGTERM took {took:.1f} s, the supervisor kills after {limit} s"


def test_systemd_execstart_starts_serves_and_drains(unit, tmp_path):
    """The unit's command line with the example env file, TLS on: it serves on LISTEN,
    with metrics on METRICS_PORT and the store in DATA_DIR, and exits 0 on SIGTERM
    within TimeoutStopSec."""
    from cacheserver.certs import write_bundle
    from cacheserver.tls import TlsFiles
    b = write_bundle(tmp_path / "tls")
    env = read_env_file(ENV)
    assert env["TLS_CERT"] and env["METRICS_PORT"], "the example runs with TLS and metrics"
    port, metrics, data = free_port(), free_port(), tmp_path / "data"
    env.update(LISTEN=f"127.0.0.1:{port}", DATA_DIR=str(data), CAPACITY="256MB", PEERS=f"127.0.0.1:{port}",
               METRICS_PORT=str(metrics), TLS_CERT=str(b.server_cert), TLS_KEY=str(b.server_key), TLS_CA=str(b.ca))
    d = _start(systemd_argv(unit["Service"]["ExecStart"][0], env), tmp_path)
    try:
        assert d.address == env["LISTEN"]
        _serves(d, data, metrics, TlsFiles(str(b.client_cert), str(b.client_key), str(b.ca)))
    finally:
        _stopped_within(d, float(unit["Service"]["TimeoutStopSec"][0]))


def _daemonset(manifests, **env_over: str) -> tuple[dict, dict, list[str], dict[str, str]]:
    """The pod spec, the container, its argv (env expanded; the node's IP is 127.0.0.1) and env."""
    spec = manifests[("DaemonSet", "cacheserver")]["spec"]["template"]["spec"]
    (c,) = [c for c in spec["containers"] if c["name"] == "cacheserver"]
    env = {**container_env(c, manifests, host_ip="127.0.0.1"), **env_over}
    return spec, c, [k8s_expand(a, env) for a in c["command"] + c["args"]], env


def _relocated(argv: list[str], port: int, metrics: int, data_dir: str) -> list[str]:
    """argv with the gRPC and metrics ports and --data-dir moved (`--flag=value` args)."""
    out = []
    for a in argv:
        flag, _, value = a.partition("=")
        if flag == "--listen":
            a = f"--listen={value.rsplit(':', 1)[0]}:{port}"
        elif flag == "--metrics-port":
            a = f"--metrics-port={metrics}"
        elif flag == "--data-dir":
            a = f"--data-dir={data_dir}"
        out.append(a)
    return out


def test_daemonset_args_start_serve_and_drain(manifests, tmp_path):
    """The container's args: the probes' gRPC health answers SERVING on the probe port, the
    store is in the volume mounted at --data-dir, and SIGTERM exits 0 within the pod's grace."""
    port, metrics, data = free_port(), free_port(), tmp_path / "data"
    peers = f"127.0.0.1:{port}"
    spec, c, argv, _ = _daemonset(manifests, CAPACITY="256MB", PEERS=peers)
    args = parse_flags(argv[1:])
    d = _start(_relocated(argv, port, metrics, str(data)), tmp_path)
    try:
        assert d.address == peers
        probe_ports = {c[p]["grpc"]["port"] for p in ("readinessProbe", "livenessProbe", "startupProbe")}
        assert probe_ports == {int(args.listen.rsplit(":", 1)[1])}
        _serves(d, data, metrics)
    finally:
        _stopped_within(d, float(spec["terminationGracePeriodSeconds"]))


def test_daemonset_server_joins_the_manager_ring_under_its_peers_address(manifests, tmp_path):
    """With MANAGER set, the ring the manager hands out (and the server's Info.peers) names
    the server by its PEERS address. It listened on 0.0.0.0 and registered as
    socket.getfqdn(): "localhost:7400" on a host whose /etc/hosts maps its name there,
    the same ring member for every node."""
    from cacheserver.client.server_client import ServerClient
    from manager.manager_client import ManagerClient
    m = cachemanager(str(tmp_path / "mgr")).start()
    try:
        port, metrics = free_port(), free_port()
        peers = f"127.0.0.1:{port}"
        _, _, argv, _ = _daemonset(manifests, CAPACITY="256MB", PEERS=peers, MANAGER=m.address)
        d = _start(_relocated(argv, port, metrics, str(tmp_path / "data")), tmp_path)
        try:
            wait_ring(m.address, 1)
            with ManagerClient(m.address, timeout=5) as mc:
                assert list(mc.get_ring().addresses) == [peers]
            deadline = time.monotonic() + 10
            with ServerClient(peers) as c:
                while list(c.info().peers) != [peers] and time.monotonic() < deadline:
                    time.sleep(0.1)
                assert list(c.info().peers) == [peers]
        finally:
            assert d.stop() == 0
    finally:
        assert m.stop() == 0


def test_a_wildcard_listen_address_joins_the_ring_as_an_address_others_can_dial(tmp_path, monkeypatch):
    """The systemd default (LISTEN=0.0.0.0) with MANAGER: a wildcard listen address registered
    as socket.getfqdn(), "localhost" where /etc/hosts maps the host name to 127.0.0.1 (as
    here), so every node joined the ring as the same unreachable member. Such a name gives
    way to the host's address on its route to the manager (here loopback)."""
    import socket

    from cacheserver import registration
    from manager.manager_client import ManagerClient

    monkeypatch.setattr(socket, "getfqdn", lambda *a: "localhost")
    assert registration.advertised("0.0.0.0:7400", "127.0.0.1:9") == "127.0.0.1:7400"
    assert registration.advertised("[::]:7400", "127.0.0.1:9") == "127.0.0.1:7400"
    assert registration.advertised("10.1.2.3:7400", "127.0.0.1:9") == "10.1.2.3:7400"
    m = cachemanager(str(tmp_path / "mgr")).start()
    try:
        port = free_port()
        d = Daemon(["cacheserver.serverd", "--listen", f"0.0.0.0:{port}", "--data-dir", str(tmp_path / "data"),
                    "--capacity", "256MB", "--manager", m.address, "--log-format", "text"],
                   log_path=str(tmp_path / "server.log")).start()
        try:
            wait_ring(m.address, 1)
            with ManagerClient(m.address, timeout=5) as mc:
                (member,) = mc.get_ring().addresses
            host, _, got_port = member.rpartition(":")
            assert int(got_port) == port
            infos = socket.getaddrinfo(host.strip("[]"), None)  # the real resolver, not the patched getfqdn
            assert any(not (a[4][0].startswith("127.") or a[4][0] == "::1") for a in infos) or host == "127.0.0.1", member
        finally:
            assert d.stop() == 0
    finally:
        assert m.stop() == 0
