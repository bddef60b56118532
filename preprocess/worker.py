"""A preprocessing worker process (forked from a fork server: startctx.py) and its background thread.

The main thread takes tasks (a few item indices) from the shared task queue,
reads the items through the dataset (cache, then store) and runs each through
the pipeline. A step cannot be pre-empted, so after each step it checks the
item's time against the timeout the scheduler sent: once over, the partly done
item moves to this process's background thread (MinatoLoader's temp queue) and
the main thread goes on with fresh items. Items the cost memory knows to be slow
go to the background thread at once. Every finished item is sent back alone;
the scheduler builds batches from whatever finishes.

Messages to the scheduler: ("done", run, wid, index, item, records, moved),
("error", run, wid, index, step, step name, text, records) when a step raised or the
item failed otherwise (its output cannot be pickled, ...), ("fatal", run, wid,
indices, text) when reading the items failed, ("moved", run, wid, index) when an
item goes to the background, ("exit", wid, None) on a clean stop.

`running` (shared memory, two stall.Slots: the main thread's, the background
thread's) holds the index of the item each thread is running (NOT_RUNNING between
items), the run it was sent in, the step running on it and since when: if the process dies (a segfault in a
decoder, the OOM killer) the scheduler names the item it died on
(pool.WorkerPool.death), and it warns about a step stuck on an item, or stops the
process once the step is over step_timeout (engine.py, stall.py)."""
from __future__ import annotations

import copy
import multiprocessing
import os
import queue
import threading
import time
import traceback
from typing import Any

from .channel import ChannelWriter
from .feed import PlainFeed, run_item
from .items import item_digest, pairs
from .pipeline import ItemContext, Pipeline, StepError
from .stall import FIELDS, NOT_RUNNING, READ, Slot, bind

EXIT_WAIT_S = 60.0  # at most, after the last message, for the scheduler to take it
PARENT_CHECK_S = 1.0  # an idle worker checks this often that the scheduler's process still lives
NO_TARGET = object()  # the item is not a (sample, target) pair
MAIN, BACKGROUND = 0, 1  # the `running` slots
SLOTS = 2 * FIELDS  # the size of `running`: the two threads' slots

# task (on this worker's own queue): ("task", run, epoch, order, timeout seconds or None,
# [(index, to_background), ...]); None: stop


def worker_main(wid: int, n_workers: int, ds: Any, pipeline: Pipeline, job_seed: int,
                task_q: Any, results: Any, feed: Any = None, running: Any = None) -> None:
    """task_q: this worker's own task queue; results: the write end of its own result
    channel (channel.py); feed: where items come from (preprocess/feed.py; default: ds.read);
    running: the two slots of the items in flight (shared memory; None: not kept)."""
    out = ChannelWriter(results)
    running = [NOT_RUNNING] * SLOTS if running is None else running
    slot = Slot(running, MAIN)
    bind(slot)  # the steps this thread runs mark their progress in it (Pipeline.call_step)
    _set_worker_info(wid, n_workers, job_seed, ds)
    feed = PlainFeed(ds) if feed is None else feed
    bgq: queue.Queue = queue.Queue()
    bg = threading.Thread(target=_background, args=(wid, bgq, out, feed, running), name="slow-items",
                          daemon=True)
    bg.start()
    with_target = pairs(ds)
    pipe = pipeline
    while True:
        task = _next_task(task_q, feed)
        if task is None:
            break
        _, run, epoch, order, t_out, items = task
        pipe = in_order(pipe, order)
        try:  # reading the items, and taking them apart: a failure is the task's, named (never a crash)
            slot.item(items[0][0], run)
            slot.at(READ)  # a hung read is watched as a stuck step is (engine.EpochRun._watch)
            fed = feed.fetch([i for i, _ in items], epoch)
            slot.idle()
            parts = [(i, to_bg, f, *_unpack(ds, epoch, job_seed, i, f, with_target))
                     for (i, to_bg), f in zip(items, fed, strict=True)]
        except Exception:
            out.send(("fatal", run, wid, [i for i, _ in items], traceback.format_exc()))
            continue
        for i, to_bg, f, x, tgt, ctx in parts:
            job = (run, i, x, tgt, ctx, f.start, [], time.perf_counter(), f.keep, f.token)
            if to_bg:
                bgq.put((pipe, job))
                continue
            slot.item(i, run)
            _advance(wid, pipe, job, t_out, out, bgq, feed)
            slot.idle()
    bgq.put(None)
    bg.join()
    feed.close()
    out.send(("exit", wid, None))
    out.finish(EXIT_WAIT_S)  # the scheduler may still be unpickling our tensors: stay until it has read


def _next_task(task_q: Any, feed: Any) -> tuple | None:
    """The next task; None: stop, also once the scheduler's process is gone (killed: it
    sent no stop, and our copy of the queue's write end means no end of file either)."""
    try:
        return task_q.get_nowait()
    except queue.Empty:
        feed.idle()  # nothing to do: what the feed buffered goes out now
    parent = multiprocessing.parent_process()
    while True:
        try:
            return task_q.get(timeout=PARENT_CHECK_S)
        except queue.Empty:
            if parent is not None and not parent.is_alive():
                return None


def in_order(pipe: Pipeline, order: Any) -> Pipeline:
    """The pipeline to run a task's items with: `pipe` if it runs in the task's order, else
    a copy in it (sharing the steps). Never pipe itself reordered: an item of an earlier
    epoch (exactly_once=False) may still run on it in the background, and must finish in
    the order it started in (a step run twice, another skipped, would be kept under the
    old order's key by autocache)."""
    order = tuple(order)
    if order == pipe.order:
        return pipe
    view = copy.copy(pipe)
    view.order = order
    return view


def _unpack(ds: Any, epoch: int, job_seed: int, i: int, f: Any, with_target: bool) -> tuple:
    """(sample, target or NO_TARGET, context) of a fed item."""
    x, tgt = f.item if with_target else (f.item, NO_TARGET)
    return x, tgt, ItemContext(job_seed, epoch, item_digest(ds, i))


def _advance(wid: int, pipeline: Pipeline, job: tuple, t_out: float | None, out: Any,
             bgq: queue.Queue | None, feed: Any) -> None:
    """Run an item's remaining steps; job = (run, index, data, target, context, next
    step, records, start time, caching point to hand it to the feed at or None, the
    feed's token). With a background queue, stop once over t_out. Whatever fails on
    the item is sent as its error: an item never answered holds up its epoch for ever."""
    run, i, x, tgt, ctx, pos, records, started, keep, token = job
    deadline = None if t_out is None or bgq is None else started + t_out
    ran = len(records)
    try:
        x, pos = run_item(pipeline, feed, keep, token, x, ctx, pos, deadline, records)
    except StepError as e:
        _send_error(out, run, wid, i, e.position, e.name, e.error, records)
        return
    except BaseException as e:  # not a step's Exception: SystemExit in a step, feed.passed, nbytes
        at = pipeline.order[min(pos + len(records) - ran, len(pipeline.order) - 1)]  # the step it was at
        _send_error(out, run, wid, i, at, pipeline.steps[at].name, e, records)
        if isinstance(e, KeyboardInterrupt) and bgq is not None:
            raise  # Ctrl-C stops the worker (main thread only: the background thread gets no signals)
        return
    if pos < len(pipeline.order):  # over its time: the rest runs in the background
        out.send(("moved", run, wid, i))
        bgq.put((pipeline, (run, i, x, tgt, ctx, pos, records, started, keep, token)))
        return
    try:
        out.send(("done", run, wid, i, x if tgt is NO_TARGET else (x, tgt), records, bgq is None))
    except OSError:
        raise  # the channel itself failed (pickling raises no OSError): this worker cannot report
    except Exception as e:  # pickling the output: the item's error; a crash would only repeat on retry
        last = pipeline.order[-1]
        _send_error(out, run, wid, i, last, pipeline.steps[last].name, e, records,
                    f"{type(e).__name__}: its output cannot be pickled (to send it to the loader): {e}\n")


def _send_error(out: Any, run: int, wid: int, i: int, j: int, name: str, error: BaseException,
                records: list, last_line: str = "") -> None:
    """The item's error message; the scheduler names the item, step j and the text's last line."""
    text = "".join(traceback.format_exception(error)) + last_line
    out.send(("error", run, wid, i, j, name, text, records))


def _background(wid: int, bgq: queue.Queue, out: Any, feed: Any, running: Any) -> None:
    """Items over their time, each run on in the pipeline (the order) it started with."""
    slot = Slot(running, BACKGROUND)
    bind(slot)
    while True:
        entry = bgq.get()
        if entry is None:
            return
        pipeline, job = entry
        try:
            slot.item(job[1], job[0])  # with its run: it may be an earlier epoch's (engine._watch)
            _advance(wid, pipeline, job, None, out, None, feed)
            slot.idle()
        except BaseException:  # only the channel failing gets here (_advance sends every item's error)
            os._exit(1)  # this worker can no longer report: dying has the scheduler re-run its items


def _set_worker_info(wid: int, n_workers: int, seed: int, ds: Any) -> None:
    """Look like a torch DataLoader worker: get_worker_info() works in user steps,
    and the dataset counts this process's reads in its own row."""
    try:
        import torch
        from torch.utils.data._utils import worker as tw
    except ImportError:  # pragma: no cover
        return
    torch.set_num_threads(1)  # as DataLoader workers: one core each
    tw._worker_info = tw.WorkerInfo(id=wid, num_workers=n_workers, seed=seed, dataset=ds)
