"""RocksDB options of the read path, shared by the store and same-host followers (client/localread.py)."""
from __future__ import annotations

import rocksdict


BLOOM_BITS_PER_KEY = 10  # ~1% false positives; ~125 KB of filters per 100k values


def filtered(opts: rocksdict.Options) -> rocksdict.Options:
    """A bloom filter in every table file: a get skips each file (an L0 file, an upper
    level) whose range spans the id but which lacks it, where it read and checked a whole
    block there, a ~100 KB value (a get with one L0 file over a compacted store:
    18.4 -> 12.1 us)."""
    table = rocksdict.BlockBasedOptions()
    table.set_bloom_filter(BLOOM_BITS_PER_KEY, False)
    opts.set_block_based_table_factory(table)
    return opts


def tuned_for_reads(opts: rocksdict.Options) -> rocksdict.Options:
    # mmap'd SST reads skip one copy per value (measured 2.0 -> 2.8 GB/s alone).
    opts.set_allow_mmap_reads(True)
    return filtered(opts)


def hot_read_options() -> rocksdict.ReadOptions:
    """Read options of the hit path (2.0 -> 5+ GB/s with mmap, measured in-process).

    Block checksums are skipped because every value carries its own xxh3
    trailer (record.py) that is checked on every read; the block cache is not
    filled because ~100 KB values only churn it, the OS page cache holds them."""
    ro = rocksdict.ReadOptions()
    ro.set_verify_checksums(False)
    ro.fill_cache(False)
    return ro


def plain_read_options() -> rocksdict.ReadOptions:
    """Read options of a plain store's hit path (datadir.py): its values carry no
    trailer, so RocksDB checks every block it reads against its checksum; a 110 KB
    value read this way cost no more than one without in tools/bench/hitfloor."""
    ro = hot_read_options()
    ro.set_verify_checksums(True)
    return ro
