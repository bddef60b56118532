"""Client-side pieces of mlcache: digest files, capabilities and data readers.

Deliberately imports nothing heavy (no torch, no numpy, no TensorFlow) so that
tools and worker processes can import submodules cheaply.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .dataset import CachedDataset
    from .tf_source import tf_dataset

__all__ = ["CachedDataset", "tf_dataset"]


def __getattr__(name: str) -> Any:
    # `from clients import CachedDataset` loads the dataset module (and torch) only then;
    # `from clients import tf_dataset` loads the tf.data front end (TensorFlow at first call).
    if name == "CachedDataset":
        from .dataset import CachedDataset

        return CachedDataset
    if name == "tf_dataset":
        from .tf_source import tf_dataset

        return tf_dataset
    raise AttributeError(f"module 'clients' has no attribute {name!r}")
