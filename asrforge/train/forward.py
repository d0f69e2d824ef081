"""The training forward pass: :class:`TrainingWhisper` turns one training batch into logits.

Its four paths through the model: docs/training.md, "The training forward (`train/forward.py`)".
"""

from __future__ import annotations

import torch
from torch import nn

from asrforge.data.dataset import IGNORE
from asrforge.model.partial import encode_frozen_part, encode_trained_part, set_frozen_eval


def labelled_positions(
    labels: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder positions of a batch that carry a label, and their labels, on ``device``.

    Found on the host from the collated labels, so the device waits for nothing.

    Args:
        labels: (batch, tokens) collated labels (on the CPU), ``IGNORE`` at prompt and padding.

    Returns:
        (n,) indices into the flattened (batch * tokens) positions, and (n,) their labels.
    """
    flat = labels.flatten()
    keep = (flat != IGNORE).nonzero().squeeze(1)
    return keep.to(device, non_blocking=True), flat[keep].to(device, non_blocking=True)


# What TrainingWhisper.forward reads of a batch that has one entry per row.
ROW_INPUTS = ("decoder_input_ids", "input_features", "encoder_hidden_states")


def rows_holding(batch: dict, positions: torch.Tensor, width: int) -> tuple[dict, torch.Tensor]:
    """The rows of ``batch`` that hold ``positions`` (flattened over rows of ``width`` tokens),
    as a batch :meth:`TrainingWhisper.forward` takes, and those positions within them."""
    row, slot = torch.unique(positions // width, return_inverse=True)
    if len(row) == len(batch["decoder_input_ids"]):
        return batch, positions
    rows = {**batch}
    for key in ROW_INPUTS:
        if key in batch:
            rows[key] = batch[key][row.to(batch[key].device)]
    return rows, slot * width + positions % width


WHISPER_PREFIX = "whisper."
"""The Whisper model's parameter names start with this in :class:`TrainingWhisper`'s."""


class TrainingWhisper(nn.Module):
    """A Whisper model (``WhisperForConditionalGeneration``) as training runs it.

    Args:
        whisper: the model; its parameters are this module's, under ``whisper.``.
        frozen_top: ``model.trained_top_encoder_layers``: None when the whole encoder trains, else the
            number of top encoder layers that train above a frozen part (0: all frozen).
    """

    def __init__(self, whisper: nn.Module, frozen_top: int | None):
        super().__init__()
        self.whisper = whisper
        self.frozen_top = frozen_top

    def train(self, mode: bool = True) -> TrainingWhisper:
        """Set the training mode; the frozen part of the encoder stays in eval mode (a fixed
        function of the audio: no dropout, and its output may be cached)."""
        super().train(mode)
        if mode and self.frozen_top is not None:
            set_frozen_eval(self.whisper.model.encoder, self.frozen_top)
        return self

    def forward(self, batch: dict, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits for one collated batch.

        Args:
            batch: ``decoder_input_ids`` (batch, tokens); a speech batch also ``input_features``
                (batch, n_mels, frames) or ``encoder_hidden_states`` (batch, positions, d_model);
                ``task`` is ``"lm"`` for a text-only batch (default ``"asr"``).
            positions: (n,) indices into the flattened (batch * tokens) decoder positions whose
                logits are wanted, e.g. those with a label; None: every position.

        Returns:
            (batch, tokens, vocab) logits, or (n, vocab) at ``positions``.
        """
        device = self.whisper.proj_out.weight.device
        decoder_input_ids = batch["decoder_input_ids"].to(device, non_blocking=True)
        if batch.get("task", "asr") == "lm":
            hidden = self.whisper.model.decoder(
                input_ids=decoder_input_ids, use_cache=False
            ).last_hidden_state
        else:
            encoder_states = self._encoder_states(batch, device)
            if encoder_states is None:
                inputs = {"input_features": batch["input_features"].to(device, non_blocking=True)}
            else:
                inputs = {"encoder_outputs": (encoder_states,)}
            hidden = self.whisper.model(
                **inputs, decoder_input_ids=decoder_input_ids, use_cache=False
            ).last_hidden_state
        if positions is not None:
            # The vocabulary projection is the step's largest matmul: none at prompt or padding.
            hidden = hidden.flatten(0, 1)[positions]
        return self.whisper.proj_out(hidden)

    def _encoder_states(self, batch: dict, device: torch.device) -> torch.Tensor | None:
        """The encoder's output computed apart from Whisper's forward (a frozen lower part, fresh
        or cached), or None when Whisper's own forward runs the encoder."""
        encoder, top = self.whisper.model.encoder, self.frozen_top
        if "encoder_hidden_states" in batch:  # the frozen part's, cached
            frozen = batch["encoder_hidden_states"].to(device, non_blocking=True)
        elif top:  # frozen lower layers, run apart in eval mode
            # SpecAugment, as WhisperModel.forward applies it in training (a no-op unless the
            # config's apply_spec_augment is on); transformers has no public function for it
            features = self.whisper.model._mask_input_features(batch["input_features"].to(device))  # noqa: SLF001
            frozen = encode_frozen_part(encoder, features, top)
        else:
            return None
        return encode_trained_part(encoder, frozen, top)
