"""``TrainState``: everything about progress that a resumed run must get back exactly."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from asrforge.io.records import (
    COUNT,
    INTEGER,
    MAPPING,
    NUMBER,
    TEXT,
    either,
    list_of,
    mapping_of,
    optional,
    record_problems,
)


@dataclass
class TrainState:
    """Progress of a run. Saved in every checkpoint as ``train_state.json``.

    Callbacks read it and may raise the two flags; only the loop changes the rest.
    """

    step: int = 0
    """Optimizer steps taken."""
    epoch: int = 0
    """Current epoch (0-based)."""
    batch_in_epoch: int = 0
    """Micro-batches of the current epoch already consumed (the data-loader position); speech
    batches only, text-only ones are not part of an epoch."""
    text_position: dict[str, int] = field(default_factory=dict)
    """Where the text-only batches stand in ``data.text_path`` (pass, byte offset of the block,
    lines of it taken); empty without text-only batches."""
    stream_position: dict[str, int | str] = field(default_factory=dict)
    """With ``data.stream.enabled``: the streamed split's fingerprint (its shard list; a resume
    on other shards is refused) and the last batch taken (epoch, batch of the epoch, rows before
    its end); ``epoch`` and ``batch_in_epoch`` are the position a resume starts from."""
    train_data: dict[str, int | str] = field(default_factory=dict)
    """Without ``data.stream``: the training split's usable utterances the run trains on, their
    count (``utterances``), a sha256 of their rows' keys in order (``sha256``) and which keys
    (``keys``: 2, id or file name and text; absent, an older checkpoint's: ids alone); a resume
    on other ones is refused. Empty in a checkpoint saved before it was recorded."""
    samples_seen: int = 0
    skipped_steps: int = 0
    """Optimizer steps skipped because the loss or a gradient was inf/nan."""
    consecutive_nonfinite: int = 0
    dropped: dict[str, list[str]] = field(default_factory=dict)
    """Ids of the training clips the workers dropped, by reason, each once however many epochs,
    as ``skipped-<split>.json`` lists them (all processes' after a checkpoint): failed to decode,
    NaN/inf samples, and on a lazily prepared split what preparation would have skipped."""
    running_loss: float | None = None
    """Exponential moving average of the training loss (0.98)."""
    best: dict[str, float] = field(default_factory=dict)
    """The evaluation of the checkpoint the selection policy chose (``wer``, ``cer``, ``loss``,
    ``n``, ...), at ``best_step``; the policy's own bests are in ``selection``."""
    best_step: int | None = None
    """Step of the checkpoint the selection policy chose."""
    last_eval_step: int | None = None
    selection: dict[str, Any] = field(default_factory=dict)
    """The selection policy's own state (bests, patience counter)."""
    stop_reason: str | None = None
    should_stop: bool = False
    """Raised by the loop or a callback: stop before the next step."""
    should_save: bool = False
    """Raised by the loop or a callback: save a checkpoint after this step."""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("should_stop")
        d.pop("should_save")
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainState:
        """The state :meth:`to_dict` gave, or an older checkpoint's (see :func:`_migrate`).

        Raises:
            ValueError: a field is missing or not of its kind, each named.
        """
        problems = record_problems(d, _FIELD_KINDS, required=("step",))
        if problems:
            raise ValueError("; ".join(problems))
        d = _migrate(d)
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**known)


_FIELD_KINDS = {
    **dict.fromkeys(
        ("step", "epoch", "batch_in_epoch", "samples_seen", "skipped_steps",
         "consecutive_nonfinite"), COUNT),
    "text_position": mapping_of(COUNT),
    "stream_position": mapping_of(either(INTEGER, TEXT)),
    "train_data": mapping_of(either(INTEGER, TEXT)),
    "dropped": mapping_of(list_of(TEXT)),
    "running_loss": optional(NUMBER),
    "best": MAPPING,
    "best_step": optional(COUNT),
    "last_eval_step": optional(COUNT),
    "selection": MAPPING,
    "stop_reason": optional(TEXT),
    "dropped_utterances": optional(list_of(TEXT)),
}  # fmt: skip
"""What each field of ``train_state.json`` may hold (an older one's too)."""


OLD_DROP_REASON = "failed to decode"
"""The reason of every clip a worker dropped when checkpoints listed the ids without reasons."""


def _migrate(d: dict[str, Any]) -> dict[str, Any]:
    """An older checkpoint's state in the current shape: its ``dropped_utterances`` (the dropped
    ids once more, flat, beside ``dropped``; or alone, before reasons were kept) fold into
    ``dropped``, where an id listed only there gets the one reason workers then had."""
    if "dropped_utterances" not in d:
        return d
    d = dict(d)
    flat = d.pop("dropped_utterances") or []
    dropped = {reason: list(uids) for reason, uids in (d.get("dropped") or {}).items()}
    listed = {u for uids in dropped.values() for u in uids}
    unlisted = [u for u in dict.fromkeys(flat) if u not in listed]
    if unlisted:
        dropped.setdefault(OLD_DROP_REASON, []).extend(unlisted)
    d["dropped"] = dropped
    return d
