"""`cachectl`: operator tool for cache servers and the cache manager.

  cachectl certs --out DIR [--server-names ...] [--ips ...] [--clients N]
  cachectl stats ADDR [--json] [--cluster-token-file F] [--tls-cert C --tls-key K --tls-ca CA]
  cachectl ring [ADDR ... | --peers a,b,c] [--vnodes N] [--check]
  cachectl local-cluster --servers 3 --capacity 1GB [--base-port P] [--data-dir DIR]
  cachectl status --manager ADDR [--json] [--tls-cert C --tls-key K --tls-ca CA]

Exit codes: 0 success, 1 failure (unreachable server, files in the way, a
local server that died), 2 bad usage.
"""
from __future__ import annotations

import os

# Keep gRPC's C core from writing its own log lines over our one-line errors.
os.environ.setdefault("GRPC_VERBOSITY", "NONE")

import argparse  # noqa: E402
import json  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from typing import Any  # noqa: E402

from cacheserver.tls import add_tls_flags, tls_from_args  # noqa: E402

from .ctlcommon import PROG, CtlError, HelpFormatter, seconds  # noqa: E402
from .localcluster import add_local_cluster_parser  # noqa: E402
from .status import add_status_parser  # noqa: E402
from .tables import table  # noqa: E402



# ---------------------------------------------------------------- helpers ---
def _oneline(text: str) -> str:
    return " ".join(str(text).split())


def _check_addr(addr: str) -> str:
    from cacheserver.runtime import split_hostport
    try:
        split_hostport(addr, "address")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return addr


def _split_list(values: Sequence[str] | None) -> list[str]:
    """Accept both `--ips a b` and `--ips a,b`."""
    out: list[str] = []
    for v in values or ():
        out += [x.strip() for x in v.split(",") if x.strip()]
    return out


def _tls_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace):
    try:
        return tls_from_args(args)
    except ValueError as e:
        parser.error(str(e))


def _rpc(addr: str, what: str, call, tls=None):
    """Run one gRPC call; connection problems become a CtlError naming the address."""
    import grpc
    try:
        return call()
    except grpc.RpcError as e:
        code = e.code() if hasattr(e, "code") else None
        details = _oneline(e.details() if hasattr(e, "details") else e) or str(code)
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                details = f"no answer in time ({details})"
            elif tls is None and _accepts_connections(addr):  # listening, yet no plain gRPC
                details += " (does it require TLS? pass --tls-cert, --tls-key and --tls-ca)"
            raise CtlError(f"cannot reach {addr}: {details}") from None
        name = code.name if code is not None else "ERROR"
        raise CtlError(f"{addr}: {what} failed: {name}: {details}") from None


def _accepts_connections(addr: str) -> bool:
    from cacheserver.runtime import split_hostport
    host, port = split_hostport(addr, "address")
    try:
        socket.create_connection((host, port), timeout=1.0).close()
        return True
    except OSError:
        return False


def _client(addr: str, tls, timeout: float, token: bytes | None = None):
    from cacheserver.client.server_client import ServerClient
    return ServerClient(addr, tls=tls, timeout=timeout, use_dataplane=False,
                        prefer_unix=False, local_read=False, control_token=token)


def _pct(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "-"


# ------------------------------------------------------------------ certs ---
def cmd_certs(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from cacheserver import certs
    names = _split_list(args.server_names) or list(certs.DEFAULT_SERVER_NAMES)
    ips = _split_list(args.ips) or list(certs.DEFAULT_IPS)
    if args.clients < 0:
        parser.error("--clients must be >= 0")
    try:
        certs.parse_ips(ips)
    except ValueError as e:
        parser.error(f"--ips: {e}")
    try:
        bundle = certs.write_bundle(args.out, server_names=names, ips=ips, clients=args.clients,
                                    force=args.force, days=args.days, key_type=args.key_type)
    except FileExistsError as e:
        if e.filename is not None:  # mkdir of --out hit a file: --force would not help
            raise CtlError(f"certs: --out {args.out} exists and is not a directory") from None
        raise CtlError(f"certs: {e}; pass --force to replace them") from None
    except ValueError as e:
        parser.error(str(e))
    except OSError as e:
        raise CtlError(f"certs: cannot write to {args.out}: {e.strerror or e}") from None
    out = bundle.out_dir
    print(f"wrote {len(bundle.files)} files to {out}:")
    for p in bundle.files:
        print(f"  {p.name:<18} {oct(p.stat().st_mode & 0o777)}")
    print(f"server certificate valid for: {', '.join(names + ips)}")
    print(f"server: cacheserver ... --tls-cert {out / 'server.pem'} --tls-key {out / 'server-key.pem'}"
          f" --tls-ca {out / 'ca.pem'}")
    print(f"manager: cachemanager ... --tls-cert {out / 'manager.pem'} --tls-key {out / 'manager-key.pem'}"
          f" --tls-ca {out / 'ca.pem'}  (the manager role on servers)")
    if args.clients:
        print(f"client: cachectl stats ADDR --tls-cert {out / 'client.pem'} --tls-key {out / 'client-key.pem'}"
              f" --tls-ca {out / 'ca.pem'}")
    print("keep ca-key.pem offline; it signs new certificates and is not needed by servers or clients")
    return 0


# ------------------------------------------------------------------ stats ---
def stats_dict(addr: str, r) -> dict:
    from cacheserver.counters import SERVER_COUNTERS
    counters = dict(r.counters)
    ordered = {n: counters.pop(n) for n in SERVER_COUNTERS if n in counters}
    ordered.update(sorted(counters.items()))
    return {
        "address": addr, "server_id": r.server_id,
        "capacity_bytes": r.capacity_bytes, "used_bytes": r.used_bytes,
        "free_bytes": max(0, r.capacity_bytes - r.used_bytes), "items": r.items,
        "counters": ordered,
        "chunks": [{"dataset": c.dataset, "chunk": c.chunk, "items": c.items, "bytes": c.bytes,
                    "refs": c.refs, "jobs": list(c.jobs)} for c in r.chunks],
        "active_chunks": dict(sorted(r.active_chunks.items())),
        "job_modes": {j: _mode_name(m) for j, m in sorted(r.job_modes.items())},
        "tenants_hidden": r.tenants_hidden,
    }


def _mode_name(code: int) -> str:
    from cacheserver.vocab import CacheMode
    try:
        return CacheMode.of_code(code).value
    except ValueError:
        return str(code)


# A server with --cluster-token-file or TLS leaves job and dataset names out of the Stats
# of callers without the manager's role (cacheserver/roles.py) and says so (tenants_hidden).
_HIDDEN = ("  (hidden: this server shows them only to the manager's role: "
           "pass its --cluster-token-file, or manager.pem as --tls-cert)")
_HIDDEN_WRONG_TOKEN = ("  (hidden: the server did not accept --cluster-token-file as the manager's role; "
                       "is it the token file the server runs with?)")


def format_stats(d: dict, token_given: bool = False) -> str:
    """The table of stats_dict's `d`; `token_given`: the caller sent a cluster token (so a
    server that hid names refused it)."""
    from cacheserver.sizes import format_size
    cap, used = d["capacity_bytes"], d["used_bytes"]
    c = d["counters"]
    hidden = _HIDDEN_WRONG_TOKEN if token_given else _HIDDEN
    out = [f"server {d['address']}  id {d['server_id']}",
           table([["capacity", format_size(cap), f"{cap:,} bytes"],
                   ["used", format_size(used), f"{used:,} bytes", _pct(used, cap)],
                   ["free", format_size(d["free_bytes"]), f"{d['free_bytes']:,} bytes"],
                   ["items", f"{d['items']:,}"]])]
    gets = c.get("gets", 0)
    if gets:
        out.append(f"  hit ratio {_pct(c.get('get_hits', 0), gets)} of {gets:,} gets")
    out += ["", "counters", table([[n, f"{v:,}"] for n, v in c.items()])]
    out += ["", "chunks"]
    if d["chunks"]:
        active = d["active_chunks"]
        out.append(table([[ch["dataset"], ch["chunk"], f"{ch['items']:,}", format_size(ch["bytes"]),
                            ch["refs"], ",".join(ch["jobs"]) or "-",
                            "yes" if active.get(ch["dataset"]) == ch["chunk"] else ""]
                           for ch in d["chunks"]],
                          header=["DATASET", "CHUNK", "ITEMS", "BYTES", "REFS", "JOBS", "ACTIVE"]))
    else:
        out.append(hidden if d["tenants_hidden"] else "  (no tagged chunks)")
    listed = {ch["dataset"] for ch in d["chunks"]}
    extra = {ds: ch for ds, ch in d["active_chunks"].items() if ds not in listed}
    if extra:
        out += ["", "active chunks", table([[ds, ch] for ds, ch in extra.items()])]
    out += ["", "job modes"]
    out.append(table([[j, m] for j, m in d["job_modes"].items()]) if d["job_modes"]
               else hidden if d["tenants_hidden"] else "  (all jobs normal)")
    return "\n".join(out)


def cmd_stats(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from cacheserver.roles import read_token
    tls = _tls_from_args(parser, args)
    try:
        token = read_token(args.cluster_token_file) if args.cluster_token_file else None
    except ValueError as e:
        parser.error(str(e))
    with _client(args.addr, tls, args.timeout, token) as c:
        r = _rpc(args.addr, "Stats", c.stats, tls)
    d = stats_dict(args.addr, r)
    print(json.dumps(d, indent=2) if args.json else format_stats(d, token_given=token is not None))
    return 0


# ------------------------------------------------------------------- ring ---
def cmd_ring(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from cacheserver.client.hashring import HashRing
    if args.vnodes < 1:
        parser.error("--vnodes must be >= 1")
    tls = _tls_from_args(parser, args)
    members, source, note = _ring_members(args, parser, tls)
    ring = HashRing(members, vnodes=args.vnodes)
    share = ring.describe()
    checks = _ring_checks(list(ring.nodes), tls, args.timeout) if args.check else {}
    if args.json:
        doc = {"source": source, "vnodes": args.vnodes, "members": list(ring.nodes), "share": share}
        if checks:
            doc["check"] = checks
        print(json.dumps(doc, indent=2))
    else:
        _print_ring(list(ring.nodes), share, checks, source, args.vnodes, note)
    return 0 if all(v == "ok" for v in checks.values()) else 1


def _ring_members(args: argparse.Namespace, parser: argparse.ArgumentParser, tls) -> tuple[list[str], str, str]:
    """(members, where they came from, a note): --peers, several ADDRs, or one ADDR's ring."""
    peers = _split_list([args.peers] if args.peers else [])
    for p in peers:
        try:
            _check_addr(p)
        except argparse.ArgumentTypeError as e:
            parser.error(f"--peers: {e}")
    if peers and args.addrs:
        parser.error("give either ADDR ... or --peers, not both")
    if not peers and not args.addrs:
        parser.error("give ADDR ... or --peers a,b,c")
    if peers:
        return peers, "--peers", ""
    if len(args.addrs) > 1:
        return list(args.addrs), "arguments", ""
    addr = args.addrs[0]
    with _client(addr, tls, args.timeout) as c:
        info = _rpc(addr, "Info", c.info, tls)
    # Info.peers is the server's --peers, or the manager's ring once a server run with --manager
    # has one (cacheserver/server.py): Info does not say which, so the label names both.
    members, source = list(info.peers), f"the ring of {addr} (its --peers, or its manager's ring)"
    if not members:
        return [addr], source, (f"{addr} reports no ring (started without --peers, and no ring from a "
                                "manager yet): it is a ring of one")
    return members, source, "" if addr in members else f"note: {addr} is not in its own ring"


def _ring_checks(nodes: list[str], tls, timeout: float) -> dict[str, str]:
    """Per member: "ok" if it answers Info with the same ring (its --peers or its manager's),
    else what differs."""
    checks: dict[str, str] = {}
    for m in nodes:
        try:
            with _client(m, tls, timeout) as c:
                info = _rpc(m, "Info", c.info, tls)
            mine = sorted(set(info.peers))
            checks[m] = "ok" if mine == nodes else ("no --peers" if not mine else f"peers differ: {','.join(mine)}")
        except CtlError as e:
            checks[m] = _oneline(str(e))
    return checks


def _print_ring(nodes: list[str], share: dict[str, float], checks: dict[str, str], source: str,
                vnodes: int, note: str) -> None:
    n = len(nodes)
    print(f"ring: {n} member{'s' if n != 1 else ''} from {source}, {vnodes} vnodes each")
    rows = []
    for m in nodes:
        s = share[m]
        row = [m, f"{100 * s:.1f}%", "#" * max(1, round(40 * s))]
        if checks:
            row.append(checks[m])
        rows.append(row)
    header = ["MEMBER", "SHARE", "", "STATUS"] if checks else ["MEMBER", "SHARE", ""]
    print(table(rows, header=header))
    if n > 1:
        lo, hi = min(share.values()), max(share.values())
        print(f"ideal share {100 / n:.1f}%; largest/smallest {hi / lo:.2f}")
    if note:
        print(note)


# ------------------------------------------------------------------- main ---
def _add_tls(p: argparse.ArgumentParser) -> None:
    add_tls_flags(p, serves=False, peers="the servers")
    p.add_argument("--timeout", type=seconds, default=5.0, help="seconds per RPC")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in (_add_certs, _add_stats, _add_ring, add_local_cluster_parser, add_status_parser):
        add(sub)  # add_status_parser: the manager's own view, `cachectl status`
    return p


def _add_certs(sub: Any) -> None:
    from cacheserver import certs
    c = sub.add_parser("certs", formatter_class=HelpFormatter,
                       help="create a CA and server/client certificates for mutual TLS",
                       description="Create ca.pem, ca-key.pem, server.pem, server-key.pem, manager.pem, "
                                   "manager-key.pem, client.pem and client-key.pem (client-N.pem for N >= 2) "
                                   "in DIR. Keys are mode 0600. Only manager.pem has the manager role on "
                                   "servers (docs/security.md).")
    c.add_argument("--out", required=True, metavar="DIR", help="output directory (created if missing)")
    c.add_argument("--server-names", nargs="+", metavar="NAME",
                   help="DNS names for the server certificate's SubjectAltName (default: localhost)")
    c.add_argument("--ips", nargs="+", metavar="IP",
                   help="IP addresses for the SubjectAltName; list every address clients dial "
                        "(default: 127.0.0.1)")
    c.add_argument("--clients", type=int, default=1, help="number of client certificates")
    c.add_argument("--days", type=int, default=certs.CERT_DAYS,
                   help=f"validity in days of the server, manager and client certificates (the CA's: "
                        f"{certs.CA_DAYS})")
    c.add_argument("--key-type", choices=certs.KEY_TYPES, default="ec", help="EC P-256 or RSA 2048")
    c.add_argument("--force", action="store_true", help="replace existing files")
    c.set_defaults(func=cmd_certs, subparser=c)


def _add_stats(sub: Any) -> None:
    s = sub.add_parser("stats", formatter_class=HelpFormatter, help="show a server's Stats (capacity, usage, counters)")
    s.add_argument("addr", metavar="ADDR", type=_check_addr, help="server gRPC address HOST:PORT")
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")
    s.add_argument("--cluster-token-file", default=None, metavar="FILE",
                   help="the servers' --cluster-token-file: without it (or manager.pem under TLS) a server "
                        "leaves tagged chunks, active chunks and job modes out")
    _add_tls(s)
    s.set_defaults(func=cmd_stats, subparser=s)


def _add_ring(sub: Any) -> None:
    from cacheserver.client.hashring import DEFAULT_VNODES
    r = sub.add_parser("ring", formatter_class=HelpFormatter, help="show ring members and their share of the key space",
                       description="Members come from --peers, from several ADDRs, or, with one ADDR, "
                                   "from that server's ring (its Info): its --peers, or the manager's ring "
                                   "when it runs with --manager.")
    r.add_argument("addrs", metavar="ADDR", nargs="*", type=_check_addr, help="server gRPC address(es)")
    r.add_argument("--peers", default="", help="comma-separated ring members")
    r.add_argument("--vnodes", type=int, default=DEFAULT_VNODES, help="virtual nodes per member (as clients use)")
    r.add_argument("--check", action="store_true",
                   help="also ask every member for its Info: reachable, and the same ring")
    r.add_argument("--json", action="store_true", help="print JSON")
    _add_tls(r)
    r.set_defaults(func=cmd_ring, subparser=r)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args, args.subparser)
    except CtlError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `cachectl stats ... | head`
        try:
            sys.stdout.close()
        except OSError:
            pass
        return 0
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
