"""Client-side pieces of mlcache: digest files, capabilities and data readers.

Deliberately imports nothing heavy (no torch, no numpy) so that tools and
worker processes can import submodules cheaply.
"""
