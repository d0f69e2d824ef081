"""Events and the callback protocol: which events the loop calls, with what, and what a callback
may do.

The events and their payloads: docs/training.md, "Writing a callback (`train/events.py`)".
"""

from __future__ import annotations

import errno
import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asrforge.io.append import LinkRefused
from asrforge.io.records import MAPPING, record_problems
from asrforge.selection.selector import Decision
from asrforge.train.state import TrainState

log = logging.getLogger("asrforge.callbacks")

EVENTS = (
    "on_train_begin",
    "on_epoch_begin",
    "on_step_begin",
    "on_step_end",
    "on_eval_begin",
    "on_eval_end",
    "on_predict_end",
    "on_save",
    "on_epoch_end",
    "on_train_end",
    "on_exception",
)


DISK_ERRORS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EFBIG})
"""OSError numbers that mean the run's disk is full or failing."""


class CriticalCallbackError(RuntimeError):
    """A callback marked critical failed: the run stops."""


@dataclass
class RunInfo:
    """What ``on_train_begin`` tells callbacks about the run."""

    config: Any
    output_dir: Path
    model: Any
    tokenizer: Any
    n_params: int
    n_trainable: int
    precision: str
    device: str
    world_size: int
    is_main: bool
    n_train: int
    n_eval: int
    selection: str = ""
    max_steps: int = 0
    """The step the run trains to: ``train.max_steps`` or the selection group's lower cap."""
    loader_workers: int = 0
    """DataLoader workers per process: ``data.num_workers``, ``auto`` resolved."""
    resumed: bool = False
    """Whether the run continues a checkpoint (``--resume``): it logs the steps after the
    checkpoint's again."""
    extra: dict[str, Any] = field(default_factory=dict)


class Callback:
    """Base class: override the events you need. Every method gets ``state`` first.

    Attributes:
        name: the registered name (used in logs).
        id: the key of this callback's state in the checkpoint's ``callbacks.json``; None: the
            name, numbered from the second callback of that name on (see the module docstring).
        critical: a critical callback's failure stops the run (exit 1); an optional one's is
            logged, with its traceback, and the run goes on. No built-in callback is critical:
            each only observes, and what it writes is a log or can be rebuilt offline.
        rank_zero_only: called only on the main process (all file-writing callbacks).
    """

    name: str = "callback"
    id: str | None = None
    critical: bool = False
    rank_zero_only: bool = True

    def on_train_begin(self, state: TrainState, *, run: RunInfo) -> None: ...
    def on_epoch_begin(self, state: TrainState, *, epoch: int) -> None: ...
    def on_step_begin(self, state: TrainState, *, step: int) -> None: ...
    def on_step_end(self, state: TrainState, *, metrics: dict) -> None: ...
    def on_eval_begin(self, state: TrainState, *, split: str) -> None: ...
    def on_eval_end(self, state: TrainState, *, metrics: dict, decision: Decision) -> None: ...
    def on_predict_end(self, state: TrainState, *, predictions: list[dict]) -> None: ...
    def on_save(self, state: TrainState, *, path: Path, kind: str) -> None: ...
    def on_epoch_end(self, state: TrainState, *, epoch: int) -> None: ...
    def on_train_end(self, state: TrainState, *, result: Any) -> None: ...
    def on_exception(self, state: TrainState, *, error: BaseException) -> None: ...

    def state_dict(self) -> dict:
        """JSON-able state saved with every checkpoint (restored on resume)."""
        return {}

    def config_problems(self, cfg: Any) -> list[str]:
        """What this callback cannot work with in the run's ``TrainConfig``, one sentence each;
        :func:`~asrforge.callbacks.build_callbacks` refuses them before the run starts."""
        return []

    def run_entries(self) -> frozenset[str]:
        """Top-level names this callback creates in the run directory (a file, or the folder
        its files go in): a run stopped by bad input before it began removes the new ones."""
        return frozenset()

    def load_state_dict(self, state: dict) -> None:
        pass


class CallbackList:
    """Calls an event on every callback, in order, isolating optional failures."""

    def __init__(self, callbacks: list[Callback], *, is_main: bool = True):
        # Keys come from the whole list, so every process agrees on them.
        keyed = zip(state_keys(callbacks), callbacks, strict=True)
        self.keyed = [(k, c) for k, c in keyed if is_main or not c.rank_zero_only]
        self.callbacks = [c for _, c in self.keyed]
        self.failures: Counter[str] = Counter()
        """Failures of optional callbacks by ``callback.event``."""

    def call(self, event: str, state: TrainState, **payload: Any) -> None:
        for cb in self.callbacks:
            stopping = state.should_stop
            try:
                getattr(cb, event)(state, **payload)
                if state.should_stop and not stopping and not state.stop_reason:
                    # the run's end names who stopped it, when the callback did not say why
                    state.stop_reason = f"stopped by the callback {cb.name!r} in {event}"
            except Exception as e:  # noqa: BLE001 - a callback must not kill the run unless critical
                if isinstance(e, OSError) and e.errno in DISK_ERRORS and event != "on_exception":
                    raise
                # a link in the run dir must be removed by the user, not written around
                if isinstance(e, LinkRefused) and event != "on_exception":
                    raise
                if cb.critical:
                    raise CriticalCallbackError(
                        f"critical callback {cb.name!r} failed in {event}: {type(e).__name__}: {e}"
                    ) from e
                key = f"{cb.name}.{event}"
                self.failures[key] += 1
                log.error(
                    "callback %r failed in %s (%s: %s); the run goes on",
                    cb.name,
                    event,
                    type(e).__name__,
                    e,
                    exc_info=self.failures[key] == 1 and not isinstance(e, OSError),
                )
        if event == "on_train_end" and self.failures:
            # the errors may be thousands of lines up: repeat them where the run's end is read
            log.error(
                "optional callbacks failed during this run (callback.event: times): %s",
                ", ".join(f"{k}: {n}" for k, n in self.failures.items()),
            )

    def state_dict(self) -> dict[str, dict]:
        """Each callback's state for ``callbacks.json``, by key. An optional callback whose
        state fails or is no JSON object is left out with an error naming it, as its failing
        events are, and the checkpoint is written; a critical one's stops the run."""
        states = {}
        for key, cb in self.keyed:
            try:
                state = cb.state_dict()
                json.dumps(state)  # as the checkpoint writes callbacks.json
                if not isinstance(state, dict):
                    raise TypeError(f"a {type(state).__name__}, not a dict")
            except Exception as e:  # noqa: BLE001 - one callback's state must not cost the save
                why = f"{type(e).__name__}: {e}"
                if cb.critical:
                    raise CriticalCallbackError(
                        f"critical callback {cb.name!r}: its state_dict() cannot be saved ({why})"
                    ) from e
                self.failures[f"{cb.name}.state_dict"] += 1
                log.error("callback %r: its state_dict() cannot be saved (%s); the checkpoint "
                          "is written without it, and a resume starts it afresh", cb.name,
                          why)  # fmt: skip
                continue
            states[key] = state
        return states

    def load_state_dict(self, states: dict[str, dict]) -> None:
        """Each callback's state from ``callbacks.json`` (``states``: by key).

        Raises:
            ValueError: ``states`` is not an object of objects, or a callback refused its state
                (a damaged or altered record): the key and the reason.
        """
        problems = record_problems(states, {key: MAPPING for key, _ in self.keyed})
        if problems:
            raise ValueError("; ".join(problems))
        for key, cb in self.keyed:
            if key in states:
                try:
                    cb.load_state_dict(states[key])
                except (KeyError, TypeError, ValueError, AttributeError) as e:
                    # a callback's own fields are its to check; any it cannot take is named here
                    raise ValueError(f"{key}: cannot be restored ({type(e).__name__}: {e})") from None


def state_keys(callbacks: list[Callback]) -> list[str]:
    """Each callback's key in ``callbacks.json``: its ``id``, else its name, then ``name#2``,
    ``name#3``, ... for later callbacks of the same name. The first keeps the bare name, so a
    checkpoint written when state was keyed by name alone still resumes it.

    Raises:
        ValueError: two callbacks would share a key (an ``id`` given twice, or equal to another
            callback's key).
    """
    keys: list[str] = []
    seen: dict[str, int] = {}
    for cb in callbacks:
        if cb.id is not None:
            key = cb.id
        else:
            seen[cb.name] = seen.get(cb.name, 0) + 1
            key = cb.name if seen[cb.name] == 1 else f"{cb.name}#{seen[cb.name]}"
        if key in keys:
            raise ValueError(f"two callbacks would save their state under {key!r}: give each an id")
        keys.append(key)
    return keys


def eval_metric_names() -> tuple[str, ...]:
    """The scalar metrics every evaluation produces (the ``on_eval_end`` payload's numbers): what
    an early-stopping ``monitor``, an averaging ``metric`` or a ``checkpoint.keep_best`` metric
    may name. Read from the evaluation code itself, by summarizing one probe prediction."""
    # The evaluation code imports torch; the callbacks (the matrix's plan) import this module
    # without it.
    from asrforge.evaluation.evaluate import dropped_metrics, summarize
    from asrforge.text import repetition_flags

    probe = {
        "uid": "probe",
        "language": "en",
        "ref": "a",
        "hyp": "a",
        "n_tokens": 1,
        "loss": 0.0,
        "n_label_tokens": 1,
        **repetition_flags("a", n_tokens=1, max_new_tokens=2),
    }
    produced = {**summarize([probe]), **dropped_metrics({}, 1)}
    return tuple(
        sorted(
            k for k, v in produced.items() if isinstance(v, int | float) and not isinstance(v, bool)
        )
    )
