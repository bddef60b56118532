"""Cache manager: decides which datasets to cache, how (full, chunked, none),
and when each job's cache mode and chunk change; servers and clients carry it out."""
