"""What keeps a run near its starting model while it trains (:class:`StartingModel`): its
weights, which L2-SP (``optim.l2sp``) pulls the trained parameters back toward after each step,
and a frozen copy of it, whose token distributions the model is distilled toward on the replay
rows (``train.distill_weight``). Both are taken when the run is built, before a resume loads
its checkpoint, so a resumed run holds the same start as the run it continues.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from asrforge.data.dataset import IGNORE
from asrforge.train.forward import rows_holding


class StartingModel:
    """The starting model, as much of it as the run's options need.

    Args:
        model: the run's :class:`~asrforge.train.forward.TrainingWhisper` before its first step.
        l2sp: ``optim.l2sp`` (0: the starting weights are not kept).
        distill_weight: ``train.distill_weight`` (0: no frozen copy is kept).
        replay_only: distil on the replay rows only (``data.replay`` is set); else on every row.
    """

    def __init__(self, model: nn.Module, *, l2sp: float, distill_weight: float, replay_only: bool):
        self.l2sp, self.distill_weight, self.replay_only = l2sp, distill_weight, replay_only
        # Keyed by the parameter itself: the optimizer's groups hold the same objects.
        self.weights = (
            {p: p.detach().clone() for p in model.parameters() if p.requires_grad} if l2sp else {}
        )
        self.teacher = None
        if distill_weight:
            self.teacher = copy.deepcopy(model).eval()
            self.teacher.requires_grad_(False)

    @classmethod
    def of_run(cls, cfg, model: nn.Module) -> StartingModel | None:
        """The run's starting model, or None when no option needs it."""
        l2sp, weight = cfg.optim.l2sp, cfg.train.distill_weight
        if not (l2sp or weight):
            return None
        return cls(model, l2sp=l2sp, distill_weight=weight, replay_only=cfg.data.replay is not None)

    @torch.no_grad()
    def pull(self, optimizer) -> None:
        """L2-SP as a decoupled decay toward the start: ``w -= lr * l2sp * (w - w_start)`` for
        each trained parameter, at its group's learning rate (the step's, before the schedule
        moves it). Once per optimizer step, so grad accumulation does not change it."""
        if not self.weights:
            return
        for group in optimizer.param_groups:
            share = group["lr"] * self.l2sp
            for p in group["params"]:
                start = self.weights.get(p)
                if start is not None:
                    p.lerp_(start, share)

    def distill_loss(
        self, batch: dict, student_logits: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor | None:
        """``distill_weight`` times the KL divergence from the frozen start's token
        distributions to the model's, averaged over the labelled positions of the rows it
        distils (the replay rows, or every row), or None when the batch has none of them.

        Args:
            student_logits: (n, vocab) the model's logits at ``positions``.
            positions: (n,) the labelled positions, into the flattened (batch * tokens) ones,
                in the order of ``student_logits``.
        """
        if self.teacher is None or batch.get("task", "asr") == "lm":
            return None
        labels = batch["labels"]
        keep = (labels.flatten() != IGNORE).nonzero().squeeze(1)
        rows = keep // labels.shape[1]
        if self.replay_only:
            replay = batch.get("replay")
            if replay is None or not bool(replay.any()):
                return None
            chosen = replay[rows].nonzero().squeeze(1)
            if not len(chosen):
                return None
        else:
            chosen = torch.arange(len(keep))
        device = student_logits.device
        chosen = chosen.to(device, non_blocking=True)
        rows, at = rows_holding(batch, positions[chosen], labels.shape[1])
        with torch.no_grad():
            teacher = self.teacher(rows, at).float().log_softmax(-1)
        student = student_logits[chosen].float().log_softmax(-1)
        kl = F.kl_div(student, teacher, log_target=True, reduction="batchmean")
        return self.distill_weight * kl
