"""AutoOrder (Pecan §5.2, Algorithm 2): deflating steps first, inflating ones last.

The pipeline is cut into sections at barriers: steps marked keep_position and
steps that change the item's type or rank (decoding, flattening), which stay
where they were written. Within a section steps move by their inflation factor
(bytes out / bytes in, measured on a sample): deflating (< 1 - EPS) before
neutral before inflating (> 1 + EPS).

Beyond the paper: Pecan assumes the steps of a section commute; a user's steps
often do not (normalising before scaling to [0, 1], resizing before cropping).
So a step moves by swapping with a neighbour only where the two give the same
output in either order on the sample items (measure.agree: same shapes and
dtypes, values within 1%), and steps of one class keep their written order
(Pecan prepends deflating steps, which would put a resize before its crop).
As in Pecan's footnote, casts to half precision go last although they deflate:
CPUs compute slowly on such types.
The first order is chosen before the first epoch; after it, the factors
measured over the whole epoch are checked and the order is revised if a step's
class changed. Swaps are checked pair by pair on the sample; before an order other
than the written one serves items, the whole order is checked against the written
one on other items (first_disagreement): the scheduler goes back to the written
order, with a warning, where any differs."""
from __future__ import annotations

from collections.abc import Callable, Sequence

from .measure import agree
from .pipeline import ItemContext, Pipeline, StepError
from .profile import Trace, private, trace

EPS = 0.05
VERIFY_ITEMS = 64  # other items than the sample's the whole order is checked on before it serves any
DEFLATE, NEUTRAL, INFLATE, LAST = 0, 1, 2, 3
Commutes = Callable[[tuple[int, ...], int, int], bool]


def inflation_class(factor: float) -> int:
    return DEFLATE if factor < 1 - EPS else INFLATE if factor > 1 + EPS else NEUTRAL


def sections(order: Sequence[int], fixed: set[int]) -> list[tuple[int, int]]:
    """[start, end) position ranges of the movable runs between fixed steps."""
    out, start = [], 0
    for pos, j in enumerate(order):
        if j in fixed:
            if pos > start:
                out.append((start, pos))
            start = pos + 1
    if start < len(order):
        out.append((start, len(order)))
    return out


def reorder(order: Sequence[int], fixed: set[int], factors: dict[int, float], commutes: Commutes,
            last: set[int] = frozenset()) -> tuple[tuple[int, ...], list[tuple[int, int]]]:
    """Stable bubble sort of each section by inflation class (steps in `last` after
    all), swapping neighbours (a, b) only when commutes(steps before them, a, b).
    Returns (order, swaps made)."""
    def rank(j: int) -> int:
        return LAST if j in last else inflation_class(factors[j])

    seq = list(order)
    swaps: list[tuple[int, int]] = []
    refused: set[tuple[int, int]] = set()
    for start, end in sections(seq, fixed):
        for _ in range(end - start):  # n passes sort n items
            moved = False
            for p in range(start, end - 1):
                a, b = seq[p], seq[p + 1]
                if rank(b) >= rank(a) or (a, b) in refused:
                    continue
                if commutes(tuple(seq[:p]), a, b):
                    seq[p], seq[p + 1] = b, a
                    swaps.append((a, b))
                    moved = True
                else:
                    refused.add((a, b))
            if not moved:
                break
    return tuple(seq), swaps


def sample_commutes(pipeline: Pipeline, tr: Trace) -> Commutes:
    """A commutes() that runs the steps on the traced sample items."""
    inputs: dict[tuple[int, ...], list] = {}

    def at(prefix: tuple[int, ...]) -> list:
        if prefix not in inputs:
            xs = list(tr.inputs[0])
            for j in prefix:
                xs = [pipeline.call_step(j, private(x), c) for x, c in zip(xs, tr.ctxs)]
            inputs[prefix] = xs
        return inputs[prefix]

    def commutes(prefix: tuple[int, ...], a: int, b: int) -> bool:
        try:
            for x, c in zip(at(prefix), tr.ctxs):
                # each order on its own copy: steps that change their input in place would
                # otherwise both return the same object, which always "agrees" with itself
                ab = pipeline.call_step(b, pipeline.call_step(a, private(x), c), c)
                ba = pipeline.call_step(a, pipeline.call_step(b, private(x), c), c)
                if not agree(ab, ba):
                    return False
        except Exception:  # b cannot even take a's input: they do not commute
            return False
        return True

    return commutes


def choose_order(pipeline: Pipeline, tr: Trace, factors: dict[int, float] | None = None) -> str:
    """Reorder `pipeline` (traced in its current order as `tr`) and say what was done."""
    factors = factors or tr.factors()
    fixed = pipeline.barriers() | tr.changes_kind()
    new, swaps = reorder(pipeline.order, fixed, factors, sample_commutes(pipeline, tr), tr.makes_half())
    names = [s.name for s in pipeline.steps]
    detail = ", ".join(f"{names[j]} x{factors[j]:.2f}" for j in pipeline.order)
    if new == pipeline.order:
        report = f"AutoOrder kept the order (inflation: {detail})"
    else:
        moved = "; ".join(f"{names[b]} before {names[a]}" for a, b in swaps)
        report = f"AutoOrder: {moved} (inflation: {detail})"
    pipeline.set_order(new, report)
    pipeline.auto_factors = dict(factors)
    return report


def revise(pipeline: Pipeline, epoch_bytes: dict[int, tuple[int, int]], tr: Trace) -> str | None:
    """After the first epoch: factors from the whole epoch's bytes in and out; if a
    step's class differs from what the order was chosen with, choose again (on a
    trace of the sample in the current order). Returns the new report, or None."""
    before = pipeline.auto_factors
    factors = {j: (o / i if i else 1.0) for j, (i, o) in epoch_bytes.items()}
    if len(factors) < len(pipeline.steps):
        return None
    if all(inflation_class(factors[j]) == inflation_class(before.get(j, factors[j])) for j in factors):
        return None
    return choose_order(pipeline, trace(pipeline, tr.inputs[0], tr.ctxs), factors)


def _outcome(pipeline: Pipeline, order: Sequence[int], x: object, ctx: ItemContext) -> tuple[bool, object]:
    """(True, output) of the steps in `order` on a copy of x, or (False, the error's type)."""
    x = private(x)
    try:
        for j in order:
            x = pipeline.call_step(j, x, ctx)
    except StepError as e:
        return False, type(e.error)
    return True, x


def first_disagreement(pipeline: Pipeline, written: Sequence[int], xs: Sequence[object],
                       ctxs: Sequence[ItemContext]) -> int | None:
    """The first item (its position in xs) whose output in the pipeline's order differs
    from the written order's (measure.agree, within 1% per swap between the two orders:
    each swap was accepted with that much rounding, and they add up; one order failing
    where the other does not differs too), or None."""
    order = pipeline.order
    swaps = sum(written.index(a) > written.index(b) for p, a in enumerate(order) for b in order[p + 1:])
    tol = 0.01 * max(1, swaps)
    for k, (x, c) in enumerate(zip(xs, ctxs)):
        ok_a, a = _outcome(pipeline, order, x, c)
        ok_b, b = _outcome(pipeline, written, x, c)
        if ok_a != ok_b or (ok_a and not agree(a, b, tol)) or (not ok_a and a is not b):
            return k
    return None
