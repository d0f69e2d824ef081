"""Decoder sequences of a training window: the forced prompt, the targets and the labels.

Whisper trains two target formats on the same audio (openai/whisper's data format, which
transformers' ``WhisperTokenizer`` decodes with ``output_offsets=True``)::

    text mode:       <|startoftranscript|><|en|><|transcribe|><|notimestamps|> a b c<|endoftext|>
    timestamp mode:  <|startoftranscript|><|en|><|transcribe|><|0.00|> a b<|1.40|><|1.80|> c<|2.60|><|endoftext|>

and either may be preceded by ``<|startofprev|>`` and the previous window's transcript. English-
only (``.en``) models have no language or task token. The prompt (previous text included) is
never a target: its label positions are ``IGNORE``, except that the prompt's last position
predicts the first target token and, with ``data.language_target``, ``<|startoftranscript|>``'s
position predicts the language token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from asrforge.data.dataset import prompt_labels

# Seconds per timestamp token, asrforge.model.frames' value repeated because data sits below model.
TIME_PRECISION = 0.02


@dataclass(frozen=True)
class TimestampTokens:
    """Whisper's timestamp tokens ``<|0.00|>``, ``<|0.02|>``, ...: ``count`` consecutive ids from
    ``begin`` (which is ``<|notimestamps|>`` + 1, transformers' ``timestamp_begin``)."""

    begin: int
    count: int

    @property
    def max_seconds(self) -> float:
        """The last timestamp token's time."""
        return (self.count - 1) * TIME_PRECISION

    def id_of(self, seconds: float) -> int:
        """The token of the nearest 0.02 s step to ``seconds`` (0 <= seconds <= max_seconds)."""
        step = round(seconds / TIME_PRECISION)
        if not 0 <= step < self.count:
            raise ValueError(
                f"{seconds:.3f} s is outside the timestamp tokens' 0..{self.max_seconds:.2f} s"
            )
        return self.begin + step

    def seconds_of(self, token_id: int) -> float:
        return (token_id - self.begin) * TIME_PRECISION

    def __contains__(self, token_id: int) -> bool:
        return self.begin <= token_id < self.begin + self.count

    @classmethod
    def from_tokenizer(cls, tokenizer, no_timestamps: int) -> TimestampTokens | None:
        """The tokenizer's timestamp tokens, or None when ``<|0.00|>`` does not follow
        ``<|notimestamps|>`` (e.g. a BPE trained without them)."""
        n_max = 1501  # 0.00 .. 30.00
        ids = list(range(no_timestamps + 1, min(no_timestamps + 1 + n_max, len(tokenizer))))
        tokens = tokenizer.convert_ids_to_tokens(ids) if ids else []
        count = 0
        for token in tokens:
            if token != f"<|{count * TIME_PRECISION:.2f}|>":
                break
            count += 1
        return cls(no_timestamps + 1, count) if count else None


@dataclass(frozen=True)
class Segment:
    """One utterance of a window: its text tokens and where it lies in the window (seconds)."""

    text_ids: Sequence[int]
    start: float
    end: float


def window_targets(segments: Sequence[Segment], timestamps: TimestampTokens | None) -> list[int]:
    """The target tokens before ``<|endoftext|>``: the joined transcripts, each wrapped in its
    start and end timestamp tokens when ``timestamps`` is given (timestamp mode)."""
    out: list[int] = []
    for seg in segments:
        if timestamps is None:
            out.extend(seg.text_ids)
        else:
            out.append(timestamps.id_of(seg.start))
            out.extend(seg.text_ids)
            out.append(timestamps.id_of(seg.end))
    return out


def decoder_sequences(
    prompt: Sequence[int],
    targets: Sequence[int],
    eot: int,
    prev: Sequence[int] = (),
    language_after: int | None = None,
) -> tuple[list[int], list[int]]:
    """``(decoder_input_ids, labels)`` of equal length for one window.

    Args:
        prompt: the forced prompt (``<|startoftranscript|>`` ... with or without
            ``<|notimestamps|>``).
        targets: what the model learns to produce (see :func:`window_targets`).
        prev: ``<|startofprev|>`` and the previous text, or empty: context, never a target.
        language_after: as :func:`~asrforge.data.dataset.prompt_labels` takes it.
    """
    forced = [*prev, *prompt]
    decoder_input_ids = forced + list(targets)
    labels = prompt_labels(forced, language_after) + list(targets) + [eot]
    return decoder_input_ids, labels


def previous_text(start_of_prev: int, text_ids: Sequence[int], room: int) -> list[int]:
    """``<|startofprev|>`` + the last ``room - 1`` tokens of ``text_ids`` (Whisper keeps the
    end of the previous text); empty when ``room < 2`` or there is no text."""
    if room < 2 or not text_ids:
        return []
    return [start_of_prev, *list(text_ids)[-(room - 1) :]]
