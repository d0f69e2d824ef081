"""Agreement between training processes: one stop for all, a placeholder pass for a process
whose micro-batch is empty, the evaluations and dropped clips of every process gathered, and
the process group closed at the end. With one process each of these returns at once, without a
collective."""

from __future__ import annotations

import gc
import signal
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from asrforge.errors import UserError
from asrforge.evaluation.evaluate import dropped_metrics, summarize


def main_process_first(acc, work: Callable[[], Any]) -> Any:
    """``work()`` on the main process, then, once it is done, on the others (which read what it
    cached). An error on the main process is raised on every process: they would otherwise wait
    for it at the barrier, then die on its lost connection with a traceback of their own. A
    UserError keeps its message; any other failure is named on the others as the main
    process's."""
    failure: Exception | None = None
    error: tuple[bool, str] | None = None
    result = None
    if acc.is_main_process:
        try:
            result = work()
        except Exception as e:
            failure, error = e, (isinstance(e, UserError), str(e))
    if acc.num_processes > 1:  # the barrier, and the main process's error to every process
        from accelerate.utils import broadcast_object_list

        error = broadcast_object_list([error])[0]
    if failure is not None:
        raise failure
    if error is not None:
        user, message = error
        raise UserError(message) if user else RuntimeError(f"the main process failed: {message}")
    return result if acc.is_main_process else work()


def close_process_group(wait: float = 10.0) -> bool:
    """End this process's part in a multi-process run, finished or stopped, while the
    interpreter still lives: destroy the process group and join gloo's worker threads now.

    A worker thread frees each finished collective's tensors, which takes the GIL. Left to the
    interpreter's exit, a late one does so after finalization began and aborts the process
    (SIGABRT, "terminate called without an active exception") instead of exiting with the
    run's code. Freed by the garbage that holds it (a DDP model's reducer), the group's
    destructor would keep the GIL while it waits for that worker, which waits for the GIL. So
    the garbage goes first, and the group's last reference is dropped here: its destructor
    releases the GIL.

    The destructor also waits for a collective still pending, up to the group's timeout (a
    rank that left in the middle of one while its peers live): it runs on a thread that this
    process waits ``wait`` seconds for.

    Returns:
        False when the group outlives this call, its threads with it: that thread still waits,
        or something else still holds the group (a sharded model's device mesh stays in
        torch's DTensor caches). The process should then leave without the interpreter's
        finalization (``os._exit``), which a late worker would abort. True otherwise, also in
        a process that has no group.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return True
    group = weakref.ref(dist.group.WORLD)
    last_reference = [dist.group.WORLD]
    dist.destroy_process_group()
    gc.collect()
    release = threading.Thread(target=last_reference.clear, name="asrforge-close-group", daemon=True)
    release.start()
    release.join(timeout=wait)
    return not release.is_alive() and group() is None


def agree_to_stop(
    acc, signal_name: str | None, stop_error: str | None, out_of_time: bool = False
) -> tuple[str | None, bool]:
    """The stop every process makes after this step, from each one's signal flag, data error
    and time budget: one small all-reduce when there are several processes (a launcher's signal
    reaches the ranks at different steps, a data error is met by one rank, each rank's clock
    started at its own moment), none with one.

    Returns:
        The name of the signal that stops the run, or None; and whether any process ran out
        of time (``train.max_time``). Both the same on every process.

    Raises:
        UserError: a process's data stopped the run (every process raises the lowest
            rank's error).
    """
    if acc.num_processes == 1:
        return signal_name, out_of_time
    import torch.distributed as dist

    signum = signal.Signals[signal_name].value if signal_name else 0
    flags = torch.tensor([signum, stop_error is not None, out_of_time], device=acc.device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    if flags[1]:
        from accelerate.utils import gather_object

        errors = [e for e in gather_object([stop_error]) if e is not None]
        raise UserError(errors[0])
    return signal.Signals(int(flags[0])).name if flags[0] else None, bool(flags[2])


def placeholder_batch(config, sot: int) -> dict:
    """A batch of one silent window and one decoder token, for a process whose micro-batch
    lost every clip: its zero-weighted pass takes the same parameters as a real batch."""
    features = torch.zeros(1, config.num_mel_bins, 2 * config.max_source_positions)
    return {
        "input_features": features,
        "decoder_input_ids": torch.full((1, 1), sot),
    }


def gather_dropped(acc, dropped: dict[str, list[str]]) -> list[dict[str, list[str]]]:
    """Every process's dropped clips by reason, in rank order, to merge into this process's
    (none with one process). Every process calls it at the same point."""
    if acc.num_processes == 1:
        return []
    from accelerate.utils import gather_object

    return gather_object([dropped])


def gather_eval(
    acc, metrics: dict, preds: list[dict], normalizer=None
) -> tuple[dict, list[dict]]:
    """Every process evaluated its shard: gather the predictions and recompute metrics
    (normalized as ``normalizer``, ``eval.normalizer``, says)."""
    if acc.num_processes == 1:
        return metrics, preds
    from accelerate.utils import gather_object

    allp = gather_object(preds)
    merged = summarize(allp, normalizer)
    n_tok = sum(p["n_label_tokens"] for p in allp)
    merged["loss"] = sum(p["loss"] * p["n_label_tokens"] for p in allp) / max(1, n_tok)
    dropped: dict[str, list[str]] = {}
    for part in gather_object([metrics.get("dropped_utterances", {})]):
        for reason, uids in part.items():
            dropped.setdefault(reason, []).extend(uids)
    merged.update(dropped_metrics(dropped, len(allp)))
    return merged, allp
