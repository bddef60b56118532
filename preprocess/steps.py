"""A pipeline step: a picklable callable plus the flags the scheduler and AutoOrder
read (keep_position: a barrier nothing moves across; random: draws random numbers,
so the cacheable prefix ends before it, unless per_epoch=False: seeded per item the
same in every epoch, so its output can be kept under the job's seed)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .reads import declared


@dataclass(frozen=True)
class Step:
    fn: Callable[[Any], Any]
    name: str = ""
    keep_position: bool = False
    random: bool = False
    per_epoch: bool = True  # a random step's draws change each epoch (False: the same every epoch)
    # files and directories the step reads whose names its fingerprint cannot see (built at run
    # time): their content enters its key (reads.py)
    reads: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.fn, Step):
            raise TypeError("Step(Step(...)): pass the callable, not a Step")
        if not callable(self.fn):
            raise TypeError(f"pipeline step {self.fn!r} ({type(self.fn).__name__}) is not callable")
        if not self.name:
            object.__setattr__(self, "name", step_name(self.fn))
        object.__setattr__(self, "reads", declared(self.reads, f"pipeline step {self.name}"))

    def __call__(self, x: Any) -> Any:
        return self.fn(x)


def step(fn: Callable[[Any], Any], *, name: str = "", keep_position: bool = False,
         random: bool = False, per_epoch: bool = True, reads: Any = None) -> Step:
    """Wrap a callable with flags: `step(crop, random=True)`; `per_epoch=False` seeds a
    random step per item alike in every epoch (a fixed augmentation); `reads`: a path or
    paths (files, directories) the step reads whose content enters its fingerprint."""
    return Step(fn, name, keep_position, random, per_epoch, reads)


def as_step(x: Any) -> Step:
    """A Step as given, or one made from a callable; a callable may carry the flags as
    attributes (`keep_position`, `random`, `reads`), as transform classes can."""
    if isinstance(x, Step):
        return x
    return Step(x, keep_position=bool(getattr(x, "keep_position", False)),
                random=bool(getattr(x, "random", False)), per_epoch=bool(getattr(x, "per_epoch", True)),
                reads=getattr(x, "reads", None))


def step_name(fn: Any) -> str:
    qual = getattr(fn, "__qualname__", None)
    if qual is None:
        inner = getattr(fn, "func", None)  # functools.partial
        qual = f"partial({step_name(inner)})" if inner is not None else type(fn).__name__
    return qual
