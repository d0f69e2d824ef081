"""One optimizer step: each micro-batch forward (autocast), loss and backward
(:func:`micro_batch_backward`; with distillation toward the start its term), the losses they
add up (:class:`StepTally`), then unscale -> clip -> step, skipped on a non-finite loss or
gradient -> L2-SP's pull toward the start -> zero grads -> LR step -> EMA (:func:`finish_step`).
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch
from torch.distributed.tensor import DTensor

from asrforge.evaluation.evaluate import token_loss
from asrforge.train.forgetting import StartingModel
from asrforge.train.forward import labelled_positions
from asrforge.train.sharding import is_sharded


def micro_batch_backward(
    acc,
    model,
    batch: dict,
    *,
    accum: int,
    sync: bool,
    placeholder: bool = False,
    start: StartingModel | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """Forward ``batch`` under autocast, its token loss, and backward of the loss / ``accum``;
    gradients are synchronized across processes only when ``sync`` (the step's last one).

    With ``placeholder`` the pass adds nothing (:func:`asrforge.train.ranks.placeholder_batch`):
    the other processes' gradient sync waits for this one's, so every process syncs the same
    buckets each step. With ``start`` distilling (``train.distill_weight``) its term joins the
    loss that is back-propagated, not the loss returned.

    Returns:
        (the token loss, detached; the (n,) labelled positions' labels; the distillation term,
        detached, or None), or None for a placeholder.
    """
    # A sharded model reduce-scatters every micro-batch's gradients: no_sync would keep each
    # layer's whole gradients until the step's last one.
    skip_sync = not sync and not is_sharded(model)
    with acc.no_sync(model) if skip_sync else nullcontext(), acc.autocast():
        distill = None
        if placeholder:
            loss = model(batch).float().sum() * 0.0
        else:
            positions, labels = labelled_positions(batch["labels"], acc.device)
            logits = model(batch, positions)
            loss = token_loss(logits, labels)
            distill = None if start is None else start.distill_loss(batch, logits, positions)
    acc.backward((loss if distill is None else loss + distill) / accum)
    if placeholder:
        return None
    return loss.detach(), labels, None if distill is None else distill.detach()


def finish_step(
    acc,
    optimizer,
    scheduler,
    ema,
    whisper,
    clip: float,
    tally: StepTally,
    start: StartingModel | None = None,
) -> tuple[float, str | None, bool]:
    """The step's end once its micro-batches are back-propagated: :func:`optimizer_step`, the
    pull toward ``start``'s weights (``optim.l2sp``), zero grads, LR step, and the EMA of
    ``whisper``'s weights; no pull or EMA when the step was skipped.

    Returns:
        As :func:`optimizer_step`.
    """
    params = [p for p in whisper.parameters() if p.requires_grad]
    grad_norm, skip, diverging = optimizer_step(acc, optimizer, params, clip, tally)
    if start is not None and skip is None:
        start.pull(optimizer)
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    if ema is not None and skip is None:
        ema.update(whisper)
    return grad_norm, skip, diverging


class StepTally:
    """What one optimizer step's micro-batches add up to. Their losses stay on the device until
    :meth:`read`, so the step waits for the device once, not once per micro-batch."""

    def __init__(self) -> None:
        self.loss = 0.0  # the mean over the step's micro-batches, once read
        self.samples = 0
        self.tokens = 0
        self.task_losses: dict[str, list[float]] = {"asr": [], "lm": []}
        self._pending: list[tuple[str, torch.Tensor]] = []
        self._accum = 1
        self.distill: list[float] = []
        """The distillation terms of the micro-batches that had one (``train.distill_weight``)."""
        self._pending_distill: list[torch.Tensor] = []

    def add(
        self,
        batch: dict,
        loss: torch.Tensor,
        labels: torch.Tensor,
        accum: int,
        distill: torch.Tensor | None = None,
    ) -> None:
        """Count a micro-batch: its mean ``loss`` over ``labels``, the (n,) labelled positions,
        and its distillation term when it had one."""
        self._pending.append((batch.get("task", "asr"), loss))
        if distill is not None:
            self._pending_distill.append(distill)
        self._accum = accum
        self.samples += batch["size"]
        self.tokens += labels.numel()

    def read(self, grad_norm: torch.Tensor | float) -> float:
        """Read the micro-batch losses and ``grad_norm`` off the device in one transfer, and
        return the gradient norm as a float."""
        norm = torch.as_tensor(grad_norm, dtype=torch.float32)
        if self._pending:
            losses = [loss.float() for _, loss in self._pending]
            terms = [t.float() for t in self._pending_distill]
            read = torch.stack([*losses, *terms, norm.to(losses[0].device)]).tolist()
            values, self.distill, norm_value = read[: len(losses)], read[len(losses) : -1], read[-1]
        else:
            values, norm_value = [], norm.item()
        for (task, _), value in zip(self._pending, values, strict=True):
            self.loss += value / self._accum
            self.task_losses[task].append(value)
        self._pending, self._pending_distill = [], []
        return norm_value


def optimizer_step(
    acc, optimizer, params, clip: float, tally: StepTally
) -> tuple[float, str | None, bool]:
    """unscale -> clip -> step, or skip the step on a non-finite loss or gradient; the step's
    losses (``tally``) and gradient norm are read off the device together, once.

    Returns:
        (the gradient norm before clipping, why the step was skipped or None, whether the skip
        counts towards ``train.max_consecutive_nonfinite``). Under fp16 a gradient overflow
        while the loss scale is above 1 does not count: that is the scaler finding its scale
        (the first steps overflow at 65536), not the run diverging (DeepSpeed's
        ``min_loss_scale`` is 1 for the same reason).
    """
    scaler = acc.scaler
    # clip_grad_norm_ unscales the gradients under fp16.
    norm = acc.clip_grad_norm_(params, clip)
    # Sharded gradients give the norm as a DTensor of per-shard parts: full_tensor() sums them.
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    grad_norm = tally.read(norm)
    loss = tally.loss
    if math.isfinite(loss) and math.isfinite(grad_norm):
        # Under fp16 this is scaler.step and scaler.update.
        optimizer.step()
        skipped = acc.optimizer_step_was_skipped
        return grad_norm, "the loss scaler skipped it" if skipped else None, False
    if scaler is None:
        return grad_norm, f"non-finite {'loss' if not math.isfinite(loss) else 'gradient'}", True
    # fp16: the optimizer must not step, and the scaler must still update: its unscale_ above
    # found the inf/nan, update() lowers the scale and ends the step (the next unscale_ raises
    # otherwise). Calling optimizer.step() for the scaler to skip would not do: the fused AdamW
    # kernel is called even then (it skips inside), so accelerate cannot tell it was skipped.
    # The scale is read here, not before every step: a read waits for the backward to finish.
    scale = scaler.get_scale()
    scaler.update()
    if not math.isfinite(loss):
        return grad_norm, "non-finite loss", True
    why = f"fp16 gradient overflow at loss scale {scale:g}, lowered to {scaler.get_scale():g}"
    return grad_norm, why, scale <= 1.0
