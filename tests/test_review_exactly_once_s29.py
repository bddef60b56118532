"""Every item exactly once per epoch, checked at random: real files, real CachedDatasets over
one embedded cache, real loaders. Each configuration (a fixed seed list) varies the item
count, batch size, ranks, drop_last, lookahead, which items are cached beforehand (so
substitution reorders), whether misses are inserted, and where a resume cuts an epoch (a
state_dict taken mid-epoch, loaded into a new loader over a new dataset); it runs each
rank through two epochs and a third after the resume, and checks per epoch and rank:
no item twice, the rank's share whole (less drop_last's short batch), the ranks' shares
disjoint and covering the dataset with DistributedSampler's padding (docs/client.md, DDP),
every rank as many batches as len() said, and that the resumed loader yields exactly the
rest of the cut epoch."""
import os
import random
import struct
import sys
from dataclasses import dataclass

import pytest

pytest.importorskip("torch")
sys.path.insert(0, os.path.dirname(__file__))

from clients.dataset import CachedDataset  # noqa: E402
from filedigest import write_files_digest  # noqa: E402

pytestmark = pytest.mark.timeout(300)
CONFIG_SEEDS = range(40)  # fixed; 1,700 more (and workers, threads, tar samples, transforms) passed once
EPOCHS = 2  # consecutive whole epochs per rank before the cut one


@dataclass
class Config:
    n: int
    batch: int
    world: int
    drop_last: bool
    lookahead: int
    seed: int
    cached: list[int]
    insert: bool
    cut_epoch: int  # the epoch whose iteration is stopped and resumed
    cut_at: float  # where, as a fraction of its batches (1.0: after its last batch)


def config(k: int) -> Config:
    r = random.Random(f"exactly-once/{k}")
    n = r.choice([r.randint(1, 12), r.randint(1, 300)])
    world = min(n, r.randint(1, 4))
    cached = r.sample(range(n), r.randint(0, n))
    return Config(n=n, batch=r.randint(1, 40) if r.random() < 0.5 else r.randint(1, 8), world=world,
                  drop_last=r.random() < 0.5, lookahead=r.randint(1, 12), seed=r.randint(0, 10**6),
                  cached=cached, insert=r.random() < 0.7, cut_epoch=r.randint(0, EPOCHS),
                  cut_at=r.choice([0.0, 1.0, r.random()]))


def index(x: bytes) -> int:
    return struct.unpack_from("<q", x)[0]


def run_epoch(loader, stop_after: int | None = None) -> list[list[int]]:
    """The batches of one iteration, as item indices; stopped after `stop_after` batches."""
    out: list[list[int]] = []
    it = iter(loader)
    while stop_after is None or len(out) < stop_after:
        try:
            out.append([index(x) for x in next(it)])
        except StopIteration:
            break
    it.close()
    return out


def check_batches(c: Config, batches: list[list[int]], want: int, what: str) -> list[int]:
    """len() said `want`; every batch full but for a last one without drop_last; no item twice."""
    assert len(batches) == want, f"{what}: {len(batches)} batches, len() said {want}"
    for b in batches[:-1]:
        assert len(b) == c.batch, f"{what}: a batch of {len(b)} before the last"
    if batches:
        assert 0 < len(batches[-1]) <= c.batch and not (c.drop_last and len(batches[-1]) < c.batch), \
            f"{what}: last batch of {len(batches[-1])}"
    items = [i for b in batches for i in b]
    assert len(set(items)) == len(items), f"{what}: items twice: {sorted(i for i in set(items) if items.count(i) > 1)}"
    return items


def check_shares(c: Config, shares: list[list[int]], what: str) -> None:
    """DistributedSampler's split: rank r holds positions r, r+W, ... of a permutation padded
    with its first items to a multiple of W (cut to one with drop_last)."""
    size = len(shares[0])
    assert all(len(s) == size for s in shares), f"{what}: share sizes {[len(s) for s in shares]}"
    total = size * c.world
    seq = [shares[k % c.world][k // c.world] for k in range(total)]
    if c.world == 1 or not c.drop_last:
        assert size == -(-c.n // c.world), f"{what}: share of {size}, want ceil({c.n}/{c.world})"
        assert sorted(seq[:c.n]) == list(range(c.n)), f"{what}: the shares do not cover the dataset once"
        assert seq[c.n:] == seq[:total - c.n], f"{what}: padding is not the permutation's start"
    else:
        assert size == c.n // c.world and len(set(seq)) == total and set(seq) <= set(range(c.n)), \
            f"{what}: drop_last shares {shares}"


def check_epoch(c: Config, share: list[int], items: list[int], what: str) -> None:
    """A whole epoch of one rank: its share, less drop_last's short batch."""
    assert set(items) <= set(share), f"{what}: items outside the share: {sorted(set(items) - set(share))}"
    want = len(share) // c.batch * c.batch if c.drop_last else len(share)
    assert len(items) == want, f"{what}: {len(items)} items of a share of {len(share)}, want {want}"


class Run:
    """One configuration's datasets over the shared embedded cache."""

    def __init__(self, c: Config, path: str, cache_dir: str) -> None:
        self.c, self.path, self.cache_dir = c, path, cache_dir
        self.open: list = []

    def dataset(self, insert: bool):
        ds = CachedDataset(self.path, cache_dir=self.cache_dir, capacity="256MB", insert=insert)
        self.open.append(ds)
        return ds

    def loader(self, rank: int):
        c = self.c
        return self.dataset(c.insert).loader(c.batch, seed=c.seed, lookahead=c.lookahead, drop_last=c.drop_last,
                                             rank=rank, world_size=c.world)

    def close(self) -> None:
        for ds in self.open:
            ds.close()

    def precache(self) -> int:
        """Reads the configuration's cached items through a dataset that inserts them;
        returns how many a lookup then finds."""
        ds = self.dataset(True)
        for k in range(0, len(self.c.cached), 64):
            ds.__getitems__(self.c.cached[k:k + 64])
        return sum(code == 1 for code in ds.lookup_codes(list(range(self.c.n))))

    def rank(self, r: int) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
        """Rank r's epochs 0..EPOCHS (the cut one resumed by a new loader): the items each
        yielded, and the rank's share of each."""
        c, ld = self.c, self.loader(r)
        got: dict[int, list[int]] = {}
        cut = False
        while ld.batch_sampler.epoch <= EPOCHS:
            e, want = ld.batch_sampler.epoch, len(ld)
            what = f"{c} rank {r} epoch {e}"
            if e != c.cut_epoch or cut:
                got[e] = check_batches(c, run_epoch(ld), want, what)
                continue
            cut, k = True, round(c.cut_at * want)
            first = run_epoch(ld, k)
            assert len(first) == k and all(len(b) == c.batch for b in first[:want - 1]), f"{what}: cut at {k}"
            state = ld.state_dict()
            ld = self.loader(r)
            ld.load_state_dict(state)
            if k == want and k > 0:  # saved at its last batch: the next epoch, whole
                assert ld.batch_sampler.epoch == e + 1, f"{what}: a state at the last batch resumed {state}"
                got[e] = check_batches(c, first, want, what)
                continue
            assert ld.batch_sampler.epoch == e, f"{what}: resumed into epoch {ld.batch_sampler.epoch}"
            rest_want = len(ld)
            rest = run_epoch(ld)
            check_batches(c, rest, rest_want, what + f" resumed after {k} batches")
            got[e] = check_batches(c, first + rest, want, what + f" cut after {k} batches")
        share = ld.batch_sampler.share
        shares = {e: share.items(e) or list(range(c.n)) for e in got}
        return got, shares


def check_config(c: Config, tmp, cache_dir: str) -> int:
    """Runs every rank of `c`; returns how many items were cached beforehand."""
    path = write_files_digest(tmp, (struct.pack("<q", i) + os.urandom(8) for i in range(c.n)))
    run = Run(c, path, cache_dir)
    try:
        found = run.precache()
        assert found >= len(c.cached), f"{c}: {found} cached, {len(c.cached)} read"
        ranks = [run.rank(r) for r in range(c.world)]
    finally:
        run.close()
    for e in range(EPOCHS + 1):
        shares = [shares[e] for _, shares in ranks]
        check_shares(c, shares, f"{c} epoch {e}")
        for r, (got, _) in enumerate(ranks):
            check_epoch(c, shares[r], got[e], f"{c} rank {r} epoch {e}")
    return found


def test_every_item_exactly_once_per_epoch_and_rank_across_random_configurations(tmp_path):
    anchor = CachedDataset(write_files_digest(tmp_path / "anchor", [b"x"]), cache_dir=str(tmp_path / "emb"),
                           capacity="256MB")  # holds the embedded cache open across configurations
    try:
        cached = [check_config(config(k), tmp_path / f"c{k}", str(tmp_path / "emb")) for k in CONFIG_SEEDS]
    finally:
        anchor.close()
    assert sum(1 for f in cached if f) > len(CONFIG_SEEDS) // 2  # substitution was exercised


def damaged(state: dict, **change) -> dict:
    return {"sampler": {**state["sampler"], **change}}


def test_a_damaged_resume_state_is_refused_naming_the_field(tmp_path):
    """A state whose delivered bitmap was cut short (a truncated checkpoint) loaded: numpy
    padded the bitmap with zeros, so the resumed epoch yielded the items past the cut again
    (20 items, 3 delivered, all 20 again). Other damage was a bare KeyError or a numpy error."""
    path = write_files_digest(tmp_path / "ds", (struct.pack("<q", i) + os.urandom(8) for i in range(20)))
    ds = CachedDataset(path, cache_dir=str(tmp_path / "emb"), capacity="16MB")
    try:
        ld = ds.loader(3, seed=1)
        first = run_epoch(ld, 2)
        state = ld.state_dict()
        bitmap = state["sampler"]["delivered"]
        padded = bitmap[:2] + bytes([bitmap[2] | 0x0f])  # bits of items 20..23, which do not exist
        cut = bitmap[:1]  # a truncated checkpoint
        for bad, says in [(damaged(state, delivered=cut), "'delivered' bitmap has 1 bytes; one of 20 items has 3"),
                          (damaged(state, delivered=bitmap + b"\0"), "'delivered' bitmap has 4 bytes"),
                          (damaged(state, delivered=padded), "marks items past the last \\(19\\)"),
                          (damaged(state, delivered=bitmap.hex()), "'delivered' must be bytes"),
                          (damaged(state, items_delivered=5), "'items_delivered' 5 does not match"),
                          (damaged(state, epoch="one"), "'epoch' must be an integer, got 'one'"),
                          (damaged(state, batches_delivered=-1), "'batches_delivered' must be >= 0"),
                          ({"sampler": {k: v for k, v in state["sampler"].items() if k != "epoch"}}, "no 'epoch'")]:
            with pytest.raises(ValueError, match=says):
                ds.loader(3, seed=1).load_state_dict(bad)
        again = ds.loader(3, seed=1)
        again.load_state_dict(state)  # the state itself still resumes exactly the rest
        items = [i for b in first + run_epoch(again) for i in b]
        assert sorted(items) == list(range(20))
    finally:
        ds.close()
