"""Client-side pieces of mlcache: digest files, capabilities and data readers.

Deliberately imports nothing heavy (no torch, no numpy) so that tools and
worker processes can import submodules cheaply.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .dataset import CachedDataset

__all__ = ["CachedDataset"]


def __getattr__(name: str) -> Any:
    # `from clients import CachedDataset` loads the dataset module (and torch) only then.
    if name == "CachedDataset":
        from .dataset import CachedDataset

        return CachedDataset
    raise AttributeError(f"module 'clients' has no attribute {name!r}")
