"""`cachectl status --manager ADDR [--json]`: the manager's view of the cluster.

``add_status_parser`` (called by manager/ctl.py's build_parser) sets ``func``/``subparser`` the way ctl.main calls them;
``run_status(args)`` can also be called directly and returns the exit code
(0 ok, 1 manager unreachable or refused).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, TextIO

from cacheserver.proto import cache_pb2 as pb
from cacheserver.proto import manager_pb2 as mpb
from cacheserver.roles import read_token
from cacheserver.tls import add_tls_flags, tls_from_args
from cacheserver.vocab import CacheMode, Option

from .ctlcommon import HelpFormatter, seconds
from .tables import table

PROG = "cachectl"


def add_status_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "status", formatter_class=HelpFormatter,
        help="show the manager's servers, datasets, options, chunks, jobs and measured benefits",
        description="Ask a cache manager for its Status: the ring, every dataset's cache option "
                    "and chunk states (who reads which chunk), every job's probe phase and "
                    "measured benefit, and recent allocation decisions.")
    p.add_argument("--manager", required=True, metavar="ADDR", help="cache manager gRPC address HOST:PORT")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    add_tls_flags(p, serves=False, peers="the manager")
    p.add_argument("--cluster-token-file", default=None, metavar="FILE",
                   help="the manager's --cluster-token-file: without it (or a manager certificate under mTLS) "
                        "other tenants' jobs and datasets are left out, only counted")
    p.add_argument("--timeout", type=seconds, default=5.0,
                   help="seconds to wait for the answer (connecting again meanwhile: a manager still starting)")
    p.set_defaults(func=lambda args, parser=None: run_status(args), subparser=p)
    return p


def run_status(args: argparse.Namespace, out: TextIO | None = None) -> int:
    from .manager_client import ManagerClient, ManagerError

    out = out or sys.stdout
    try:
        tls = tls_from_args(args)
        token = read_token(args.cluster_token_file) if args.cluster_token_file else None
    except ValueError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    try:
        with ManagerClient(args.manager, tls=tls, timeout=args.timeout, cluster_token=token) as mc:
            doc = mc.status_dict(wait=True)  # one command: --timeout bounds it, not the first connect
    except ManagerError as e:
        print(f"{PROG}: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    if args.json:
        json.dump(doc, out, indent=2, sort_keys=True)
        out.write("\n")
    else:
        out.write(render(doc, args.manager))
    return 0


# ---------------------------------------------------------------- rendering
def _size(n: Any) -> str:
    from cacheserver.sizes import format_size
    return format_size(int(n or 0))


def _num(v: Any, fmt: str = "{:.3g}") -> str:
    return "-" if v is None else fmt.format(float(v))


def _short(s: str, n: int = 16) -> str:
    return s if len(s) <= n else s[:n - 1] + "…"


def _ds(name: str) -> str:
    """A dataset name for a table: a transformed set (<dataset>+t<fp>) keeps its suffix."""
    base, plus, fp = name.partition("+t")
    return _short(base, 10) + "+t" + fp[:6] if plus else _short(name)


def _opt(v: str) -> str:
    """A proto enum name (the manager's JSON) in the shared words: "chunked"."""
    return Option.of_code(mpb.CacheOption.Value(v)).value


def _mode(v: str) -> str:
    return CacheMode.of_code(pb.CacheMode.Value(v)).value


def _chunk(v: Any) -> str:
    return "-" if v is None or int(v) < 0 else str(v)


def render(d: dict[str, Any], address: str = "") -> str:
    servers = d.get("servers", [])
    alive = sum(1 for s in servers if s.get("alive"))
    src = "servers' capacity" if d.get("budget_from_capacity") else "--budget"
    lines = [f"manager {address}  ring v{d.get('ring_version', 0)} ({alive} of {len(servers)} servers alive)  "
             f"budget {_size(d.get('budget'))} ({src})  allocated {_size(d.get('allocated'))}  "
             f"journal seq {d.get('journal_seq', 0)}"]
    lines += ["", "SERVERS", *_servers(servers), "", "DATASETS", *_datasets(d.get("datasets", [])),
              "", "JOBS", *_jobs(d.get("jobs", []))]
    if d.get("other_jobs") or d.get("other_datasets"):
        lines += ["", f"  ({d.get('other_jobs', 0)} other jobs and {d.get('other_datasets', 0)} other datasets "
                      "not shown: they are other tenants'; --cluster-token-file shows them)"]
    if d.get("pipelines"):
        lines += ["", "AUTOCACHE (per dataset and pipeline)", *_pipelines(d["pipelines"])]
    decisions = d.get("decisions", [])
    if decisions:
        lines += ["", "RECENT DECISIONS"]
        for x in decisions[-10:]:
            at = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(x.get("at", 0)))
            lines.append(f"  {at}Z {_ds(x['dataset'])} -> {_opt(x['option'])}: {x.get('reason', '')}")
    return "\n".join(lines) + "\n"


def _servers(servers: list[dict[str, Any]]) -> list[str]:
    if not servers:
        return ["  (none registered)"]
    rows = []
    for s in servers:
        age = s.get("last_heartbeat_age", -1)
        rows.append([s["address"], s["server_id"][:12], "alive" if s.get("alive") else "down",
                     _size(s.get("capacity")), _size(s.get("used")), str(s.get("items", 0)),
                     "none yet" if age < 0 else f"{age:.1f}s ago"])
    return table(rows, header=["ADDRESS", "SERVER ID", "STATE", "CAPACITY", "USED", "ITEMS", "HEARTBEAT"]).splitlines()


def _datasets(datasets: list[dict[str, Any]]) -> list[str]:
    if not datasets:
        return ["  (none)"]
    rows = [[_ds(x["dataset"]), _size(x.get("bytes")), str(x.get("n_items", 0)),
             _opt(x["option"]) + ("+spare" if x.get("spare") else ""),
             _size(x.get("allocated_bytes")), str(x.get("k", 0) or "-"), _chunk(x.get("active")),
             _chunk(x.get("loading")), _chunk(x.get("marked")), _num(x.get("gain")), _num(x.get("value"))]
            for x in datasets]
    lines = table(rows, header=["DATASET", "SIZE", "ITEMS", "OPTION", "ALLOCATED", "K", "ACTIVE", "LOADING",
                                "MARKED", "G", "VALUE"]).splitlines()
    for x in datasets:
        lines.append(f"  {_ds(x['dataset'])}: {x.get('reason', '')}")
        for c in x.get("chunks", []):
            lines.append(f"    chunk {c['chunk']} {c['state']}: {', '.join(c.get('jobs', [])) or '(no readers)'}")
        if x.get("waiting"):
            lines.append(f"    waiting: {', '.join(x['waiting'])}")
    return lines


def _pipelines(pipelines: list[dict[str, Any]]) -> list[str]:
    """Each pipeline's decision, its projected epoch times and the measured costs behind them."""
    rows, why = [], []
    for p in pipelines:
        x, c = p.get("decision", {}), p.get("measured", {})
        costs = x.get("costs", {})
        rows.append([_short(x.get("dataset", "")), _short(x.get("fingerprint", ""), 12), x.get("mode", "") or "-",
                     *(_num(costs.get(m)) for m in ("compute", "source", "transformed")),
                     str(len(x.get("jobs", []))), _num(c.get("store_read_s", 0) * 1e3),
                     _num(c.get("prefix_s", 0) * 1e3), _num(c.get("rest_s", 0) * 1e3),
                     _num(float(c.get("marker_bytes", 0)) / max(1.0, float(c.get("source_bytes", 0) or 1)))])
        why.append(f"  {_short(x.get('dataset', ''))}/{_short(x.get('fingerprint', ''), 12)}: {x.get('reason', '')}")
    return table(rows, header=["DATASET", "PIPELINE", "MODE", "COMPUTE S", "SOURCE S", "TRANSF S", "JOBS",
                               "STORE MS", "PREFIX MS", "REST MS", "INFLATE"]).splitlines() + why + [
        "  (projected seconds per remaining epoch; measured per-item costs of the jobs' first epoch)"]


def _jobs(jobs: list[dict[str, Any]]) -> list[str]:
    if not jobs:
        return ["  (none)"]
    rows = [[j["job"], _short(j["dataset"]), str(j.get("n_gpus", 0)), _mode(j["mode"]), j.get("phase", ""),
             _num(j.get("benefit"), "{:.2f}") + ("?" if j.get("inconclusive") else ""),
             _num(j.get("t_miss")), _num(j.get("t_hit")), _num(j.get("hit_ratio"), "{:.2f}"),
             _chunk(j.get("chunk")), str(j.get("batches", 0))]
            for j in jobs]
    return table(rows, header=["JOB", "DATASET", "GPUS", "MODE", "PHASE", "BENEFIT", "T_MISS", "T_HIT", "HIT",
                               "CHUNK", "BATCHES"]).splitlines() + [
        "  (benefit b = t_miss / t_hit; '?' = lower bound, measured with too few cache hits)"]
