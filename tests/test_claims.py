"""Fetch claims (cacheserver/claims.py): the pure table, then over a real server."""
import time

import pytest
from procs import cacheserver, without_features

from cacheserver.claims import ClaimTable
from cacheserver import ops
from cacheserver.vocab import FETCH, PENDING, PRESENT, WAIT
from cacheserver.client.server_client import ServerClient

A, B, C = b"a" * 32, b"b" * 32, b"c" * 32


class Clock:
    def __init__(self):
        self.t = 50.0

    def __call__(self):
        return self.t


def test_first_claimant_fetches_the_others_wait_present_items_are_got():
    t = ClaimTable(ttl=5, clock=Clock())
    assert t.claim("j1", [A, B, C], [0, 0, 1]) == bytes([FETCH, FETCH, PRESENT])
    assert t.claim("j2", [A, B, C], [0, 0, 1]) == bytes([WAIT, WAIT, PRESENT])
    assert t.claim("j1", [A], [0]) == bytes([FETCH])  # a retry renews its own claim


def test_lookups_see_others_claims_as_pending_but_not_their_own():
    t = ClaimTable(ttl=5, clock=Clock())
    t.claim("j1", [A], [0])
    assert t.pending("j2", [A, B, C], bytes([0, 0, 1])) == bytes([PENDING, 0, 1])
    assert t.pending("j1", [A, B], bytes([0, 0])) == bytes([0, 0])


def test_release_and_expiry_end_a_claim():
    clock = Clock()
    t = ClaimTable(ttl=5, clock=clock)
    t.claim("j1", [A, B], [0, 0])
    t.release([A])
    assert t.claim("j2", [A, B], [0, 0]) == bytes([FETCH, WAIT])
    clock.t += 5.01  # j1 died holding B: after the ttl another job reads it
    assert t.claim("j3", [B], [0]) == bytes([FETCH])
    assert t.pending("j1", [B], bytes([0])) == bytes([PENDING])  # j3 holds it now


def test_a_full_table_sweeps_expired_claims_and_never_refuses_a_fetch():
    clock = Clock()
    t = ClaimTable(ttl=1, max_entries=2, clock=clock)
    t.claim("j1", [A, B], [0, 0])
    assert t.claim("j1", [C], [0]) == bytes([FETCH]) and len(t) == 2  # granted, not recorded
    assert t.claim("j2", [C], [0]) == bytes([FETCH])  # so nobody waits for it
    clock.t += 2
    assert t.claim("j2", [C], [0]) == bytes([FETCH]) and len(t) == 1  # swept, then recorded
    assert t.claim("j3", [C], [0]) == bytes([WAIT])


def test_ttl_must_be_positive():
    with pytest.raises(ValueError, match="ttl"):
        ClaimTable(ttl=0)


@pytest.fixture
def server(tmp_path):
    d = cacheserver(str(tmp_path / "s"), "64MB", 0, "--claim-ttl", "1")
    d.start()
    yield d
    d.kill()


@pytest.mark.parametrize("transport", [dict(), dict(prefer_unix=False), dict(use_dataplane=False)])
def test_claims_over_the_data_plane(server, transport):
    ids = [bytes([i]) * 32 for i in range(1, 5)]
    with ServerClient(server.address, **transport) as one, ServerClient(server.address, **transport) as two:
        assert one.claim(ids[:3], "j1") == bytes([FETCH] * 3)
        assert two.claim(ids, "j2") == bytes([WAIT, WAIT, WAIT, FETCH])
        assert two.lookup(ids, "j2", pending=True) == bytes([PENDING, PENDING, PENDING, 0])
        assert two.lookup(ids, "j2") == bytes(4)  # plain look-ups are unchanged
        one.put([(ids[0], b"x" * 10)], "j1")  # the insert releases the claim
        assert two.claim(ids[:2], "j2") == bytes([PRESENT, WAIT])
        time.sleep(1.2)  # --claim-ttl 1: j1 never inserted ids[1]
        assert two.claim(ids[1:2], "j2") == bytes([FETCH])
        s = one.stats().counters
        assert s["claims_granted"] == 5 and s["claims_waited"] == 4 and s["claims_present"] == 1


def test_a_bypassing_job_claims_nothing(server):
    ids = [bytes([9]) * 32]
    with ServerClient(server.address) as c:
        c.set_job_mode("bulk", 1)
        assert c.claim(ids, "bulk") == bytes([FETCH])
        assert c.claim(ids, "other") == bytes([FETCH])  # nothing was recorded


@pytest.mark.parametrize("bad,why", [("0", "must be positive"), ("-1", "must be positive"),
                                     ("soon", "expected seconds")])
def test_claim_ttl_flag_refuses_bad_values_clearly(bad, why, capsys):
    from cacheserver.serverd import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["--data-dir", "d", "--capacity", "1MB", "--claim-ttl", bad])
    err = capsys.readouterr().err
    assert "--claim-ttl" in err and why in err


def test_a_server_from_before_claims_makes_the_client_read_everything_itself(server):
    # A ring mid-upgrade: the old server's Info announces no claims; the client
    # then never asks and claims answer FETCH, so nothing waits and nothing fails.
    ids = [bytes([5]) * 32]
    for dataplane in (True, False):
        with without_features(ServerClient(server.address, use_dataplane=dataplane), ops.CLAIM.feature) as c:
            before = c.stats().counters.get("claims_granted", 0)
            assert c.claim(ids, "j") == bytes([FETCH])
            assert c.claim(ids, "j") == bytes([FETCH])
            assert c.stats().counters.get("claims_granted", 0) == before  # never asked
    with ServerClient(server.address) as c:
        assert c.claim(ids, "j") == bytes([FETCH])  # the real op: recorded this time
        assert c.claim(ids, "k") == bytes([WAIT])
