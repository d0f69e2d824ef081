"""Resuming a run: which checkpoint to continue from, and whether the config still fits it.

Both checks run before the run writes anything (its config.yaml, tokenizer, caches), so a
refused resume leaves the run directory as it was:

- :func:`find_resume_checkpoint`: the newest checkpoint that verifies. When there are checkpoint
  directories but none verifies, the run is refused (exit 2) unless told to start over; starting
  over sets the damaged directories aside (renamed, never deleted).
- :func:`check_resume_config`: the config given now against the one the checkpoint was written
  with. A change of the model's shape, vocabulary or trained parameters (which the weights and
  the optimizer state depend on), of the optimizer, or of the seed (the data order's) is
  refused, listing every differing field; any other change (``optim.lr``,
  ``train.max_steps``, ...) is logged, and the run applies it from the resumed step on
  (:func:`asrforge.train.optim.follow_config`).

:func:`continue_epoch` then says where the checkpoint's epoch goes on with this run's processes
and batch size. Once the training split is prepared, :func:`check_resume_data` refuses training
utterances other than the checkpoint's (before the run's config.yaml is written).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

from asrforge.checkpoint.manager import CheckpointManager
from asrforge.checkpoint.manifest import verify
from asrforge.config import SHAPE_FIELDS, TrainConfig
from asrforge.config.yaml_limits import load_yaml
from asrforge.errors import CheckpointCorruptError, UserError
from asrforge.hub import hub_ref, resolve_model
from asrforge.run_layout import damaged_name

FIXED_MODEL_FIELDS = (
    *SHAPE_FIELDS,
    "pretrained",
    "tokenizer",
    "bpe_vocab_size",
    "vocab_size",
    "base_vocab_size",
    "freeze_encoder",
    "train_encoder_layers",
    # A checkpoint holds the adapters of exactly this LoRA setting, every field of it.
    "lora",
)
"""``model.*`` fields a resume may not change: the checkpoint's weights, tokenizer and optimizer
state (one entry per trained parameter) were made for them."""

FIXED_OPTIM_FIELDS = ("optimizer",)
"""``optim.*`` fields a resume may not change: the optimizer state's layout is the optimizer's
(fp32 moments or 8-bit codes with their scales)."""

FIXED_RUN_FIELDS = {
    "seed": "each epoch's order and packing, language sampling, replay picks and text-only "
    "passes are drawn from it: another would repeat some utterances and skip others"
}
"""Top-level fields a resume may not change, each with why."""

_PATH_FIELDS = ("model.pretrained", "model.tokenizer")
RESOLVED_FIELDS = ("model.vocab_size", "model.base_vocab_size")
"""Fields the checkpoint's config holds as resolved (filled in when the model was built) that a
config leaves unset: unset now is no change (building the model fills them in and checks them
against the weights then)."""


def find_resume_checkpoint(
    manager: CheckpointManager,
    *,
    resume: bool,
    start_over: bool = False,
    is_main: bool = True,
    log: logging.Logger | None = None,
) -> Path | None:
    """The checkpoint a run continues from, or None to train from step 0.

    Args:
        manager: the run's checkpoints directory.
        resume: ``--resume``: continue from the newest checkpoint that verifies.
        start_over: ``--start-over``: when checkpoint directories exist but none verifies, train
            from step 0 anyway; the checkpoints directory is set aside (renamed
            ``checkpoints.damaged-<time>``) by the main process, never deleted.
        is_main: only the main process renames.
        log: where the decision is reported.

    Raises:
        UserError: checkpoints exist without ``--resume`` (a valid one: pass ``--resume``), or
            none of them verifies and ``start_over`` is not set. Nothing is changed on disk.
    """
    log = log or logging.getLogger(__name__)
    root = manager.root
    # First: the step directories a pruned run keeps (its start, its last step) verify but
    # cannot be resumed.
    pruned = manager.pruned_result()
    if pruned is not None:
        raise UserError(
            f"{root.parent} holds a finished run whose checkpoints were pruned "
            f"(checkpoint.after_run: best; {pruned.name}/ kept for export): it cannot be "
            f"{'resumed' if resume else 'trained again in place'}. Choose another output_dir"
        )
    latest = manager.latest_valid()
    if latest is not None:
        if not resume:
            # --start-over is for a run that cannot resume, never a way to discard a healthy one.
            why = (
                f" (--start-over applies only when none of the checkpoints verifies; "
                f"{latest.name} does)"
                if start_over
                else ""
            )
            raise UserError(
                f"{root.parent} already holds checkpoints{why}: pass --resume to continue that "
                "run, or choose another output_dir"
            )
        return latest
    damaged = manager.step_dirs()
    if not damaged:
        if resume:
            log.warning("--resume: no checkpoint under %s yet; starting from step 0", root)
        return None
    if not start_over:
        reasons = "; ".join(_why_damaged(path) for _step, path in damaged[-3:])
        raise UserError(
            f"{'--resume: ' if resume else ''}none of the {len(damaged)} checkpoint(s) under "
            f"{root} verifies ({reasons}). Nothing was changed. Pass --start-over to train from "
            "step 0 (the checkpoints directory is kept, renamed), or repair them"
        )
    if is_main:
        aside = _set_aside(root)
        log.warning(
            "--start-over: none of the %d checkpoint(s) under %s verifies; they are kept in %s "
            "and the run starts from step 0",
            len(damaged),
            root,
            aside,
        )
    return None


def _why_damaged(path: Path) -> str:
    try:
        verify(path)
    except CheckpointCorruptError as e:
        return f"{path.name}: {e}"
    return f"{path.name}: changed while it was being checked"


def _set_aside(root: Path) -> Path:
    """Rename the checkpoints directory out of the way and make an empty one in its place."""
    aside = damaged_name(root, time.strftime("%Y%m%d-%H%M%S"))
    os.rename(root, aside)
    root.mkdir()
    return aside


def check_resume_config(
    cfg: TrainConfig, config_yaml: str, where: Path, log: logging.Logger | None = None
) -> list[str]:
    """Compare the config of a resumed run with the one its checkpoint was written with.

    Args:
        cfg: the config given now.
        config_yaml: the checkpoint's ``config.yaml`` text (empty: nothing to compare).
        where: the checkpoint directory (named in messages).
        log: where allowed changes are reported.

    Returns:
        The allowed changes, one ``path: old -> new`` line each (also logged).

    Raises:
        UserError: listing every field that may not change (see :data:`FIXED_MODEL_FIELDS`,
            :data:`FIXED_OPTIM_FIELDS`, :data:`FIXED_RUN_FIELDS`).
    """
    log = log or logging.getLogger(__name__)
    if not config_yaml.strip():
        log.warning("resume: %s has no config.yaml; the config cannot be compared", where)
        return []
    try:
        old = load_yaml(config_yaml)
    except ValueError as e:
        raise UserError(f"{where / 'config.yaml'}: {e}") from None
    if not isinstance(old, dict):
        raise UserError(f"{where / 'config.yaml'}: not a mapping")
    fixed, allowed = config_changes(cfg, old)
    if fixed:
        raise UserError(
            f"--resume: the config changes what the checkpoint {where} was trained with "
            f"({len(fixed)} field(s)): " + "; ".join(fixed) + ". Resume with the run's "
            "config.yaml, or start a new run in another output_dir"
        )
    if allowed:
        log.info("resume: config changed since %s: %s", where.name, "; ".join(allowed))
    return allowed


def config_changes(cfg: TrainConfig, old: dict[str, Any]) -> tuple[list[str], list[str]]:
    """How ``cfg`` differs from ``old`` (a run's ``config.yaml``, loaded): one
    ``path: old -> new`` line per field, those a resume may not change (what the checkpoint's
    weights were trained as, :data:`FIXED_MODEL_FIELDS`), then those it may."""
    before, now = _flatten(old), _flatten(cfg.to_plain())
    _fill_pretrained_shape(now, cfg)
    fixed, allowed = [], []
    for key in sorted(set(before) | set(now)):
        a, b = before.get(key, "(unset)"), now.get(key, "(unset)")
        if _same(key, a, b) or (key in RESOLVED_FIELDS and b in (None, "(unset)")):
            continue
        line = f"{key}: {_show(a)} -> {_show(b)}"
        if key in FIXED_RUN_FIELDS:
            fixed.append(f"{line} ({FIXED_RUN_FIELDS[key]})")
        elif _is_fixed(key, cfg, b):
            fixed.append(line)
        else:
            allowed.append(line)
    return fixed, allowed


def check_resume_steps(ckpt, max_steps: int, named: str) -> None:
    """Refuse a resume whose run would end before the step of ``ckpt`` (a
    :class:`TrainingCheckpoint`): it would end at once as if complete, and the end of the run
    (``checkpoint.after_run: best``) would delete the resume state of steps it never reached.

    Args:
        max_steps: the steps the resumed run would train to.
        named: what sets ``max_steps``, as the message names it (``train.max_steps``).

    Raises:
        UserError: naming both numbers.
    """
    step = ckpt.step or 0
    if max_steps < step:
        raise UserError(
            f"--resume: {named} is {max_steps}, below step {step} of the checkpoint {ckpt.path}, "
            f"which trained past it. Resume with a max_steps of {step} (to end the run there) or "
            "more; a run of fewer steps is a new run in another output_dir"
        )


def check_resume_epochs(ckpt, max_epochs: int | None) -> None:
    """Refuse a resume whose ``train.max_epochs`` the checkpoint (a :class:`TrainingCheckpoint`)
    already trained past, as :func:`check_resume_steps` refuses a smaller ``max_steps``: the run
    would end at once as complete and its end could delete the resume state.

    Raises:
        UserError: naming both numbers.
    """
    state = ckpt.train_state or {}
    epoch, into = state.get("epoch") or 0, state.get("batch_in_epoch") or 0
    # ``epoch`` epochs are done; batches taken into the next one count as training in it
    reached = epoch + (1 if into else 0)
    if max_epochs is not None and max_epochs < reached:
        raise UserError(
            f"--resume: train.max_epochs is {max_epochs}, below the {reached} epoch(s) the "
            f"checkpoint {ckpt.path} trained in. Resume with a train.max_epochs of {reached} or "
            "more; a run of fewer epochs is a new run in another output_dir"
        )


def keep_global_batch(cfg: TrainConfig, ckpt, processes: int, log: logging.Logger) -> None:
    """Keep the global batch a resumed checkpoint (a :class:`TrainingCheckpoint`) was trained
    with on ``processes`` processes: ``cfg.train.grad_accum`` becomes the micro-batches a step
    each process takes to keep it (the epoch's batches taken are shared anew among them by
    :func:`continue_epoch`).

    Raises:
        UserError: no ``grad_accum`` keeps it (its micro-batches a step do not divide by
            ``processes``) and ``train.keep_global_batch`` is on; a record of the wrong type.
    """
    recorded = ckpt.manifest.get("processes")
    micro = ckpt.manifest.get("micro_batches_per_step")
    if recorded is None or micro is None:  # an older checkpoint: nothing to compare with
        return
    for name, value in (("processes", recorded), ("micro_batches_per_step", micro)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(
                f"{ckpt.path / 'manifest.json'}: {name} must be a positive integer, got {value!r}"
            )
    bs, accum, where = cfg.data.batch_size, cfg.train.grad_accum, ckpt.path.name
    was = f"{micro} micro-batch(es) a step on {recorded} process(es)"
    if accum * processes != micro:
        if cfg.train.keep_global_batch and micro % processes == 0:
            cfg.train.grad_accum = micro // processes
            log.warning(
                "resume: %s was trained with %s; on %d process(es) train.grad_accum %d -> %d "
                "keeps its global batch of %d utterance(s) a step",
                where, was, processes, accum, micro // processes, micro * bs,
            )  # fmt: skip
        elif cfg.train.keep_global_batch:
            raise UserError(
                f"--resume: {ckpt.path} was trained with {was} ({micro * bs} utterance(s) a "
                f"step); on {processes} process(es) no train.grad_accum keeps that ({micro} does "
                f"not divide by {processes}). Resume on a number of processes that divides "
                f"{micro}, or set train.keep_global_batch: false to go on with {accum * processes} "
                f"micro-batch(es) a step ({accum * processes * bs} utterance(s))"
            )
        else:
            log.warning(
                "resume: %s was trained with %s; this run takes %d on %d process(es): the "
                "global batch changes from %d to %d utterance(s) a step "
                "(train.keep_global_batch: false)",
                where, was, accum * processes, processes, micro * bs, accum * processes * bs,
            )  # fmt: skip


def continue_epoch(cfg: TrainConfig, ckpt, processes: int, log: logging.Logger) -> None:
    """The checkpoint's data position (``batch_in_epoch``: the micro-batches of its epoch each
    process took) as this run takes the epoch: on ``processes`` processes, in batches of
    ``cfg.data.batch_size``.

    An epoch's batches are consecutive cuts of one order of its items (utterances, packed
    windows or streamed rows; a function of the seed and the epoch, not of the batch size),
    dealt to the processes in turn: the items taken are the first ``taken * batch_size``, and
    batches of another size continue exactly after them when that size divides them.

    Raises:
        UserError: ``data.batch_size`` changed and does not divide the items the epoch took.
    """
    state = ckpt.train_state
    recorded = ckpt.manifest.get("processes") or processes  # an older checkpoint: the same
    bs, was = cfg.data.batch_size, _recorded_batch_size(ckpt) or cfg.data.batch_size
    # Every process took its first batch_in_epoch of the epoch's batches, dealt in turn:
    # the epoch's first taken ones are gone, whichever process takes the rest.
    taken = int(state.get("batch_in_epoch") or 0) * recorded
    if bs != was:
        items, epoch = taken * was, state.get("epoch", 0)
        if items % bs:
            low = [d for d in range(1, math.isqrt(items) + 1) if items % d == 0]
            fits = low + [items // d for d in low]
            # the sizes dividing the items nearest the new one: below it (1 always), above it
            # when the epoch took more items than the new size
            above = [d for d in sorted(fits) if d > bs][:1]
            near = sorted({max(d for d in fits if d <= bs), *above})
            raise UserError(
                f"--resume: data.batch_size {was} -> {bs} mid-epoch: the checkpoint {ckpt.path} "
                f"took the first {items} item(s) of epoch {epoch} ({taken} batch(es) of {was}), "
                f"which batches of {bs} cannot continue from without skipping or repeating "
                f"some. Resume with data.batch_size={was}, or with one that divides {items} "
                f"({' or '.join(map(str, near))}), then change it at a later resume"
            )
        log.info(
            "resume: data.batch_size %d -> %d: the %d item(s) of epoch %d taken in %d batch(es) "
            "of %d are %d of %d", was, bs, items, epoch, taken, was, items // bs, bs,
        )  # fmt: skip
        taken = items // bs
    if (recorded, was) != (processes, bs):
        state["batch_in_epoch"] = taken // processes
        if taken % processes:
            log.warning(
                "resume: the %d batch(es) of this epoch taken on %d process(es) do not share "
                "out among %d: %d are taken again",
                taken, recorded, processes, taken % processes,
            )  # fmt: skip


def _recorded_batch_size(ckpt) -> int | None:
    """``data.batch_size`` of the checkpoint's config.yaml (None: it has none to read)."""
    try:
        old = load_yaml(ckpt.config_yaml) if ckpt.config_yaml.strip() else None
    except ValueError:
        return None  # check_resume_config reports it
    data = old.get("data") if isinstance(old, dict) else None
    value = data.get("batch_size") if isinstance(data, dict) else None
    ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
    return value if ok else None


def check_resume_commits(recorded: dict, now: dict, where: Path) -> None:
    """Refuse a resume whose Hub model or data set now resolves to another commit than the one
    the checkpoint was trained from (its branch moved), unless the config names that new commit
    as its revision: the person chose it.

    Args:
        recorded: the checkpoint's ``hub_commits`` (config field -> ``{id, revision, commit}``).
        now: the same, resolved for the config given now.

    Raises:
        UserError: naming each field, both commits, and the two ways on.
    """
    moved = []
    for key, then in sorted(recorded.items()):
        current = now.get(key)
        if current is None or then.get("commit") == current.get("commit"):
            continue
        if current.get("revision") is not None and current.get("revision") == current["commit"]:
            continue
        name, old, new = current.get("id"), then.get("commit"), current.get("commit")
        moved.append(
            f"{key} {name} is at commit {new} now, the checkpoint was trained from {old} (pin "
            f"it: {key}={name}@{old}; or continue on the new one: {key}={name}@{new})"
        )
    if moved:
        raise UserError(f"--resume: {where}: " + "; ".join(moved))


def check_resume_data(
    recorded: dict | None,
    now: dict,
    where: Path,
    data: str,
    log: logging.Logger | None = None,
    *,
    compared: str,
) -> None:
    """Refuse a resume on training utterances other than the ones the checkpoint trained on:
    its data position (batches of an epoch's order) would skip some and repeat others, and an
    edited transcript is other data.

    Args:
        recorded: the checkpoint's ``train_data`` (``utterances``, ``sha256``, ``keys``); empty
            in one saved before it was recorded, which resumes as before, unchecked.
        now: the same for the training split prepared now, made from the same keys.
        data: the training data, as messages name it.
        compared: what the digests tell utterances apart by, as the message says it.

    Raises:
        UserError: naming ``data``, the checkpoint, and what changed (the count, else the
            utterances or their order).
    """
    if not recorded:
        (log or logging.getLogger(__name__)).info(
            "resume: %s records no fingerprint of the training utterances (an earlier asrforge, "
            "or a streamed run saved it): %s is not compared with them", where, data
        )  # fmt: skip
        return
    before, after = recorded.get("utterances"), now.get("utterances")
    if before != after:
        changed = f"{before} usable utterance(s) then, {after} now"
    elif recorded.get("sha256") != now.get("sha256"):
        changed = (
            f"the same count ({after}), but other utterances, another order or other "
            f"transcripts ({compared})"
        )
    else:
        return
    raise UserError(
        f"--resume: {data} is not the training data the checkpoint {where} was trained on: "
        f"{changed}, so the resumed epoch would skip or repeat utterances. Resume on the data "
        "the run started with, or start a new run in another output_dir"
    )


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists are values."""
    if not isinstance(tree, dict):
        return {prefix[:-1]: tree}
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out.update(_flatten(v, f"{prefix}{k}."))
    return out


def _fill_pretrained_shape(now: dict[str, Any], cfg: TrainConfig) -> None:
    """A pretrained run's shape is its directory's: read it, so a replaced model shows up."""
    if cfg.model.pretrained is None:
        return
    try:
        hf = json.loads((resolve_model(cfg.model.pretrained).path / "config.json").read_text())
    except (OSError, ValueError, UserError):
        return  # building the model reports it
    for name in SHAPE_FIELDS:
        if f"model.{name}" not in now and isinstance(hf, dict) and name in hf:
            now[f"model.{name}"] = hf[name]


def _same(key: str, a: Any, b: Any) -> bool:
    if key in _PATH_FIELDS and isinstance(a, str) and isinstance(b, str):
        # A Hub id pinned to a revision is the same model: its commit is checked apart.
        ref_a, ref_b = hub_ref(a), hub_ref(b)
        if ref_a is not None and ref_b is not None:
            return ref_a.repo_id == ref_b.repo_id
        return os.path.normpath(a) == os.path.normpath(b)
    return a == b


def _is_fixed(key: str, cfg: TrainConfig, now: Any) -> bool:
    section, _, name = key.partition(".")
    if section == "optim":
        return name in FIXED_OPTIM_FIELDS
    if section != "model" or name.partition(".")[0] not in FIXED_MODEL_FIELDS:
        return False
    if name == "bpe_vocab_size":  # only a from-scratch model trains its BPE
        return cfg.model.pretrained is None and cfg.model.tokenizer is None
    return True


def _show(value: Any) -> str:
    return value if value == "(unset)" else json.dumps(value)
