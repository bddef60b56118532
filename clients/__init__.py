"""Client-side pieces of mlcache: digest files, capabilities and data readers.

Deliberately imports nothing heavy (no torch, no numpy, no TensorFlow) so that
tools and worker processes can import submodules cheaply.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .dataset import CachedDataset
    from .tf_source import InexactStateWarning, tf_dataset

__all__ = ["CachedDataset", "InexactStateWarning", "tf_dataset"]


def __getattr__(name: str) -> Any:
    # `from clients import CachedDataset` loads the dataset module (and torch) only then;
    # `from clients import tf_dataset` loads the tf.data front end (TensorFlow at first call).
    if name == "CachedDataset":
        from .dataset import CachedDataset

        return CachedDataset
    if name in ("tf_dataset", "InexactStateWarning"):  # the warning a read-ahead state's resume gives
        from . import tf_source

        return getattr(tf_source, name)
    raise AttributeError(f"module 'clients' has no attribute {name!r}")
