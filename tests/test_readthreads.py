"""How many store reads a process runs at once: capped on local disks, not on network mounts."""
import os

import fsspec
import pytest

from clients.readthreads import PER_CORE, mount_type, store_read_threads

MOUNTS = "\n".join([
    "/dev/vda / ext4 rw,relatime 0 0",
    "proc /proc proc rw 0 0",
    "tmpfs /tmp tmpfs rw 0 0",
    "nfs.example:/export /mnt/data nfs4 rw,vers=4.2 0 0",
    "gcsfuse /mnt/bucket fuse.gcsfuse rw 0 0",
    "/dev/nvme0n1 /mnt/database xfs rw 0 0",
    "/dev/sdb /mnt/my\\040disk ext4 rw 0 0",
    "/dev/sdc /srv/odd exfat rw 0 0",
    "server:/x /srv/odd nfs rw 0 0",  # mounted over the one before: the later line wins
    "weird /srv/unknown somefs rw 0 0",
    "short line",
])


@pytest.mark.parametrize("path, fstype", [
    ("/", "ext4"),
    ("/home/u/ds", "ext4"),
    ("/tmp/x/y", "tmpfs"),
    ("/tmp", "tmpfs"),
    ("/mnt/data/train", "nfs4"),
    ("/mnt/database/train", "xfs"),  # not inside /mnt/data: a mount point matches whole components
    ("/mnt/bucket/a/b", "fuse.gcsfuse"),
    ("/mnt/my disk/imgs", "ext4"),  # the kernel writes a space as \040
    ("/srv/odd/f", "nfs"),
    ("/srv/unknown", "somefs"),
])
def test_mount_type_takes_the_longest_then_the_latest_mount(path, fstype):
    assert mount_type(path, MOUNTS) == fstype


def test_mount_type_splits_lines_only_at_newlines():
    """A mount point may hold characters that str.splitlines() would split at (the kernel escapes
    only space, tab, newline and backslash)."""
    odd = "/mnt/a\x0cb"
    mounts = f"/dev/vda / ext4 rw 0 0\nserver:/x {odd} nfs rw 0 0\n"
    assert mount_type(odd + "/train", mounts) == "nfs"


def test_mount_type_without_a_matching_line():
    assert mount_type("/anything", "proc /proc proc rw 0 0") is None
    assert mount_type("/anything", "") is None


def local():
    return fsspec.filesystem("file")


@pytest.mark.parametrize("root, wanted, cores, expected", [
    ("/home/u/ds", 16, 2, 2 * PER_CORE),  # a local disk: PER_CORE per core
    ("/tmp/ds", 16, 2, 2 * PER_CORE),
    ("file:///home/u/ds", 16, 3, 3 * PER_CORE),  # a URL names the same path
    ("/home/u/ds", 3, 2, 3),  # fewer asked for than the cap: as asked
    ("/home/u/ds", 64, 16, 16 * PER_CORE),
    ("/mnt/data/train", 16, 2, 16),  # NFS waits on the network: every thread asked for
    ("/mnt/bucket/train", 16, 2, 16),  # FUSE (gcsfuse, s3fs ...) likewise
    ("/srv/unknown/train", 16, 2, 16),  # a type not known to be local: unchanged
])
def test_store_read_threads_caps_local_disks_only(root, wanted, cores, expected):
    assert store_read_threads(local(), root, wanted, mounts=MOUNTS, cores=cores) == expected


def test_store_read_threads_leaves_remote_stores_alone():
    assert store_read_threads(fsspec.filesystem("memory"), "memory://ds", 16, mounts=MOUNTS, cores=1) == 16
    http = fsspec.filesystem("http")
    assert store_read_threads(http, "http://127.0.0.1:1/ds", 16, mounts=MOUNTS, cores=1) == 16


def test_store_read_threads_on_this_machine(tmp_path):
    """The real /proc/self/mounts: a local temp dir of a known type is capped at PER_CORE per core."""
    with open("/proc/self/mounts") as f:
        fstype = mount_type(os.path.realpath(tmp_path), f.read())
    got = store_read_threads(local(), str(tmp_path), 1000)
    cores = len(os.sched_getaffinity(0))
    if fstype in ("ext4", "xfs", "btrfs", "tmpfs", "overlay"):
        assert got == PER_CORE * cores
    else:
        assert got in (1000, PER_CORE * cores)


def test_cached_dataset_reads_a_local_store_with_the_capped_pool(tmp_path):
    """A filling epoch through a capped pool returns every item, checked, in order; a
    fetch_threads below 1 is refused by name."""
    import hashlib
    import random

    from clients.dataset import CachedDataset
    from clients.digest import DigestBuilder

    root = tmp_path / "ds"
    root.mkdir()
    rng = random.Random(0)
    b, items = DigestBuilder(str(root), "files"), []
    for i in range(40):
        data = rng.randbytes(rng.randint(100, 5000))
        (root / f"f{i:03d}").write_bytes(data)
        b.add(hashlib.sha256(data).digest(), len(data), f"f{i:03d}")
        items.append(data)
    digest = str(tmp_path / "ds.digest")
    b.build().save(digest)
    with pytest.raises(ValueError, match="fetch_threads must be >= 1"):
        CachedDataset(digest, cache=False, fetch_threads=0)
    ds = CachedDataset(digest, cache=False, fetch_threads=64)
    try:
        order = list(range(40))
        rng.shuffle(order)
        assert ds.__getitems__(order) == [items[i] for i in order]
        st = ds._proc()
        assert st.read_threads == store_read_threads(st.fs, ds.digest.root, 64)
        assert st.pool._max_workers == st.read_threads
        with open("/proc/self/mounts") as f:
            if mount_type(os.path.realpath(root), f.read()) in ("ext4", "xfs", "btrfs", "tmpfs", "overlay"):
                assert st.read_threads == min(64, PER_CORE * len(os.sched_getaffinity(0)))
    finally:
        ds.close()
