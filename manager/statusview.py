"""What a caller of Status may see (issue 12 item 7, docs/security.md).

Job names and dataset fingerprints are tenants' data: a dataset's fingerprint
is the capability to read it. The manager's role (the cluster token, or a
manager certificate under mTLS: cacheserver/roles.py) sees everything; any
other caller sees the jobs whose tokens it sent (jobtokens.TOKEN_HEADER, one
value per job) and their datasets (with those datasets' transformed tags), and
of the rest only how many there are (other_jobs, other_datasets) and the
aggregates: ring, servers, budget, allocated. A job from a state written before
tokens has no token, so only the manager's role sees it."""
from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import Any

from cacheserver.proto import manager_pb2 as mpb
from cacheserver.vocab import source_tag

from . import jobtokens


def presented_tokens(context: Any) -> list[str]:
    """Every job token a gRPC caller sent."""
    try:
        md = context.invocation_metadata() or ()
    except Exception:  # a context without metadata (in-process calls)
        return []
    return [v for k, v in md if k == jobtokens.TOKEN_HEADER]


def visible_jobs(jobs: Mapping[str, Any], tokens: Iterable[str]) -> set[str]:
    """The jobs (name -> record with token_hash) whose token is among ``tokens``."""
    hashes = {jobtokens.token_hash(t) for t in tokens}
    return {name for name, rec in jobs.items() if rec.token_hash and rec.token_hash in hashes}


def _of_jobs(dataset: str, roots: Collection[str]) -> bool:
    return source_tag(dataset) in roots  # a transformed tag is its source dataset's


def _keep(repeated: Any, keep: Any) -> None:
    kept = [x for x in repeated if keep(x)]
    del repeated[:]
    repeated.extend(kept)


def restrict(r: mpb.StatusResponse, jobs: set[str], roots: set[str]) -> mpb.StatusResponse:
    """``r`` without the jobs not in ``jobs`` and the datasets not of ``roots`` (their source fingerprints)."""
    n_jobs, n_datasets = len(r.jobs), len(r.datasets)
    _keep(r.jobs, lambda j: j.job in jobs)
    kept = [d for d in r.datasets if _of_jobs(d.dataset, roots)]
    del r.datasets[:]
    for d in kept:
        _keep(d.jobs, lambda j: j in jobs)
        _keep(d.waiting, lambda j: j in jobs)
        for c in d.chunks:
            _keep(c.jobs, lambda j: j in jobs)
        r.datasets.append(d)
    _keep(r.decisions, lambda x: _of_jobs(x.dataset, roots))
    kept_p = [p for p in r.pipelines if _of_jobs(p.decision.dataset, roots)]
    del r.pipelines[:]
    for p in kept_p:
        _keep(p.decision.jobs, lambda j: j in jobs)
        _keep(p.decision.fixed, lambda j: j in jobs)
        r.pipelines.append(p)
    r.other_jobs, r.other_datasets = n_jobs - len(r.jobs), n_datasets - len(r.datasets)
    return r
