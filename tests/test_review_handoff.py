"""The batch handoff (clients/handoff.py) under the ways a loop leaves it: batches kept across
iterations, epochs left early while workers run ahead, a worker killed mid-epoch, items of
size 0. Real spawned DataLoader workers; the region's file descriptor and mapping are looked
up in /proc."""
import gc
import os
import random
import signal
import time

import pytest
from torch.utils.data import DataLoader

from clients.dataset import CachedDataset
from clients.handoff import MIN_SLOT, Handoff
from filedigest import write_files_digest
from test_handoff import Blobs, blobs


def region_fds() -> list[str]:
    """What this process's file descriptors on a handoff's region link to."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # closed since the listing
            pass
    return [link for link in out if "mlcache-shm-" in link]


def region_maps() -> int:
    with open("/proc/self/maps") as f:
        return sum("mlcache-shm-" in line for line in f)


class Jittery(Blobs):
    """Items that now and then take a while: workers finish out of order."""

    def __getitem__(self, i: int):
        if i % 7 == 3:
            time.sleep(0.01)
        return self.items[i]


@pytest.mark.parametrize("prefetch", [1, 3])
def test_batches_stay_whole_and_in_order_when_epochs_end_early(prefetch):
    expect = blobs(160, 1000, 60_000, seed=7)
    handoff = Handoff(workers=2, slots=prefetch + 1, slot=MIN_SLOT)
    loader = DataLoader(Jittery(expect), batch_size=8, num_workers=2, collate_fn=handoff, persistent_workers=True,
                        prefetch_factor=prefetch, multiprocessing_context="spawn")
    rng = random.Random(prefetch)
    kept = []  # batches held across iterations and epochs, as a training loop may keep them
    for stop in (2, None, 0, 9, None):
        for k, batch in enumerate(loader):
            assert batch == expect[8 * k:8 * k + 8], (stop, k)
            kept.append((k, batch))
            if rng.random() < 0.3:  # the consumer falls behind: workers fill their slots, then pipe
                time.sleep(0.02)
            if k == stop:
                break
    assert all(batch == expect[8 * k:8 * k + 8] for k, batch in kept)  # none overwritten since
    assert handoff.handed > 0 and handoff.free_slots() == handoff.workers * handoff.slots


def test_a_worker_killed_mid_epoch_leaves_no_shared_memory_behind(tmp_path):
    items = blobs(64, 150_000, 160_000)
    ds = CachedDataset(write_files_digest(tmp_path / "ds", items), cache=False)
    try:
        assert not region_fds() and not region_maps()
        loader = ds.loader(batch_size=8, num_workers=2)
        assert loader.handoff is not None
        it = iter(loader)
        first = next(it)
        os.kill(loader._iterator._workers[0].pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="DataLoader worker"):
            for _ in it:
                pass
        assert all(x in items for x in first)  # what was handed over stays intact
        assert region_fds() and all(link.endswith("(deleted)") for link in region_fds())  # no name in /dev/shm
        del it, loader
        gc.collect()
        assert not region_fds() and not region_maps()  # nothing of the region is left open or mapped
    finally:
        ds.close()


def test_items_of_size_zero_travel_through_slots(tmp_path):
    rng = random.Random(3)
    items = [b"" if i % 4 == 0 else rng.randbytes(rng.randint(150_000, 200_000)) for i in range(48)]
    items[5:13] = [b""] * 8  # a batch may be empty bytes throughout
    ds = CachedDataset(write_files_digest(tmp_path / "ds", items), cache=False)
    try:
        loader = ds.loader(batch_size=8, num_workers=2, substitute=False)
        for _ in range(2):
            got = [x for batch in loader for x in batch]
            assert sorted(got) == sorted(items) and all(type(x) is bytes for x in got)
        assert loader.handoff.handed == 12 and loader.handoff.free_slots() == 6
    finally:
        ds.close()


def test_a_batch_lost_to_a_ctrl_c_frees_its_slot_by_the_next_epoch(tmp_path, monkeypatch):
    """A Ctrl-C between the pipe's read of a worker's message and its unpickling loses the
    batch and left its slot filled for the loader's life (its worker's batches then went
    down the pipe). The next epoch frees it once torch's reset has read the messages before."""
    import clients.handoff as module

    items = blobs(64, 150_000, 160_000)
    ds = CachedDataset(write_files_digest(tmp_path / "ds", items), cache=False)
    loader = ds.loader(batch_size=8, num_workers=2)
    try:
        h, real, lost = loader.handoff, module._unpack, []
        assert h is not None

        def interrupted(token, slot, ends):
            if not lost:
                lost.append(slot)
                raise KeyboardInterrupt  # where a Ctrl-C lands: the message read, its slot not yet copied out
            return real(token, slot, ends)

        monkeypatch.setattr(module, "_unpack", interrupted)
        with pytest.raises(KeyboardInterrupt):
            for _ in loader:
                pass
        monkeypatch.setattr(module, "_unpack", real)
        assert lost and h._mem[lost[0]] != 0
        for _ in range(2):
            got = [x for b in loader for x in b]
            assert sorted(got) == sorted(items)
            assert h.free_slots() == h.workers * h.slots
    finally:
        loader.close()
        ds.close()


def test_a_ctrl_c_inside_torchs_reset_of_the_workers_costs_them_not_the_next_epoch(tmp_path, monkeypatch):
    """A Ctrl-C (caught, as a notebook does) while torch's reset of persistent workers reads
    the last epoch's batches left the reset half done: the next epoch took its stray
    acknowledgements for batches (KeyError: _ResumeIteration). The loader now shuts such an
    iterator down, and the next epoch starts its workers afresh, every item once."""
    import clients.handoff as module

    items = blobs(64, 150_000, 160_000)
    ds = CachedDataset(write_files_digest(tmp_path / "ds", items), cache=False)
    loader = ds.loader(batch_size=8, num_workers=2)
    try:
        for _ in loader:  # left early: the workers' batches ahead are read by the next reset
            break
        real, hits = module._unpack, []

        def interrupted(token, slot, ends):
            hits.append(slot)
            raise KeyboardInterrupt

        monkeypatch.setattr(module, "_unpack", interrupted)
        with pytest.raises(KeyboardInterrupt):
            iter(loader).__next__()
        monkeypatch.setattr(module, "_unpack", real)
        assert hits
        for _ in range(2):
            got = [x for b in loader for x in b]
            assert sorted(got) == sorted(items)
            assert loader.handoff.free_slots() == loader.handoff.workers * loader.handoff.slots
    finally:
        loader.close()
        ds.close()
