"""Long-form transcription: audio longer than the encoder's window, decoded window by window.

How it works: docs/decoding.md, "Long-form decoding, window by window (`model/longform.py`)".
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from asrforge.data.audio import SAMPLE_RATE
from asrforge.errors import UserError
from asrforge.model.alignment import align_words, alignment_heads, place_words
from asrforge.model.beam import beam_search
from asrforge.model.decoding import (
    DecodeOptions,
    TimestampRules,
    TimestampVocab,
    greedy_decode,
    greedy_search,
)
from asrforge.model.encoding import encode_waves
from asrforge.model.fallback import decode_with_fallback
from asrforge.model.frames import TIME_PRECISION, window_seconds
from asrforge.model.silence import segment

CHUNKINGS = ("timestamps", "silence")
MAX_PREVIOUS_TOKENS = 223
"""Previous-text tokens kept after ``<|startofprev|>`` (Whisper: half the decoder context - 1)."""

WindowDecoder = Callable[[list[np.ndarray], list[list[int]]], list[list[int]]]
"""``decode(windows, prompts)``: the ids each (n_samples,) window generated after its prompt."""

SpeechEnd = Callable[[np.ndarray, list[int], list[tuple[float, float, list[int]]]], float | None]
"""``speech_end(window, prompt, segments)``: where the complete ``segments`` decoded from the
(n_samples,) ``window``, each ``(start, end, text ids)`` in seconds from the window's start, end
in its audio, by the cross-attention alignment (:mod:`asrforge.model.alignment`) with the last
word held to its segment's end timestamp as openai-whisper holds it; None: unknown. ``prompt``
is the recording's decoder prompt without ``<|notimestamps|>``."""


@dataclass
class Segment:
    """A stretch of a recording and its text."""

    start: float
    """Seconds from the start of the recording."""
    end: float
    text: str
    tokens: list[int] = field(default_factory=list, repr=False)
    """The generated ids, timestamps included (what conditions the next window)."""
    window: tuple[float, float] = field(default=(0.0, 0.0), repr=False)
    """The audio decoded to find this segment, seconds from the start of the recording: where
    word timestamps (``asrforge.model.alignment``) align its text. A segment of a VAD chunk is
    timed, and its words aligned, on the chunk's audio, then placed on the recording's clock
    (``asrforge.model.vad.Chunk.placed``): its window then spans the chunk's regions and the
    audio left out between them, so its words cannot be aligned again from the recording."""
    words: list | None = None
    """Its words (``asrforge.model.alignment.Word``), when word timestamps were asked for."""

    def to_dict(self) -> dict:
        out = {"start": round(self.start, 3), "end": round(self.end, 3), "text": self.text}
        if self.words is not None:
            out["words"] = [w.to_dict() for w in self.words]
        return out


def parse_window(
    tokens: Sequence[int], vocab: TimestampVocab
) -> tuple[list[tuple[int, int | None, list[int]]], int | None, int | None]:
    """One window's generated ids -> its segments, how far the next window moves, and where
    the text it cut off starts.

    Args:
        tokens: generated ids, without the prompt and EOT.
        vocab: the timestamp tokens.

    Returns:
        ``(segments, seek, tail)``. Each segment is ``(start, end, ids)``, times in timestamp steps
        (0.02 s) from the window's start; ``end`` None means "to the end of the window's audio"
        (text without a closing timestamp). ``seek`` is the steps to move to the end of the last
        complete segment (where the next window starts, so that an unfinished segment is
        decoded whole there), or None to move past the whole window. ``tail`` is the opening
        timestamp of the unfinished segment when it holds text (the next window must start no
        later, or that text is never decoded), else None.
    """
    stamp = [vocab.is_timestamp(t) for t in tokens]
    single_ending = stamp[-2:] == [False, True]  # the last segment closed, nothing opened after
    consecutive = [i + 1 for i in range(len(tokens) - 1) if stamp[i] and stamp[i + 1]]
    if not consecutive:
        # one segment: up to its last timestamp, if any beyond the first position
        ends = [t - vocab.begin for t, s in zip(tokens, stamp, strict=True) if s]
        end = ends[-1] if ends and ends[-1] > 0 else None
        start = tokens[0] - vocab.begin if tokens and stamp[0] else 0
        if end is not None and end <= start:
            end = None
        return [(start, end, list(tokens))], None, None
    slices = consecutive + ([len(tokens)] if single_ending else [])
    segments, last = [], 0
    for cut in slices:
        piece = list(tokens[last:cut])
        start = piece[0] - vocab.begin if stamp[last] else 0
        end = piece[-1] - vocab.begin if stamp[cut - 1] else None
        segments.append((start, end, piece))
        last = cut
    if single_ending:
        return segments, None, None
    said = any(vocab.is_text(t) for t in tokens[last:])
    tail = tokens[last] - vocab.begin if said else None
    return segments, tokens[last - 1] - vocab.begin, tail  # the unfinished one is decoded again


def with_previous(prompt: list[int], previous: list[int], startofprev: int | None) -> list[int]:
    """``<|startofprev|> previous-text prompt``: the condition_on_previous_text prompt."""
    if startofprev is None or not previous:
        return list(prompt)
    return [startofprev, *previous[-MAX_PREVIOUS_TOKENS:], *prompt]


def transcribe_by_timestamps(
    waves: Sequence[np.ndarray],
    prompts: Sequence[list[int]],
    decode: WindowDecoder,
    vocab: TimestampVocab,
    *,
    decode_text: Callable[[list[int]], str],
    window_samples: int,
    sample_rate: int = SAMPLE_RATE,
    startofprev: int | None = None,
    speech_end: SpeechEnd | None = None,
) -> list[list[Segment]]:
    """Sequential windows moved by timestamps (see the module docstring). The current windows
    of all recordings are decoded together in each round. A window never starts before the end
    of the text already emitted, and a segment never starts before the end of the one before.

    Args:
        waves: (n_samples,) recordings at ``sample_rate``.
        prompts: each recording's decoder prompt, without ``<|notimestamps|>``.
        decode: decodes windows (see :data:`WindowDecoder`).
        vocab: the timestamp tokens.
        decode_text: text ids -> text.
        window_samples: the encoder's window.
        startofprev: the ``<|startofprev|>`` id to condition each window on the text before it
            (``condition_on_previous_text``); None: each window stands alone.
        speech_end: where a window's text ends by its audio (see :data:`SpeechEnd`): a window
            that would start at the end of its last complete segment starts no earlier than
            that (openai-whisper's seek to the last word's end), so a sentence the model timed
            too early is not decoded again, and no later than the opening timestamp of the
            text the window cut off. None: by the timestamps alone.

    Returns:
        Each recording's segments, in order, within its duration.
    """
    step = round(TIME_PRECISION * sample_rate)
    seeks = [0] * len(waves)
    previous: list[list[int]] = [[] for _ in waves]
    out: list[list[Segment]] = [[] for _ in waves]
    pending = [i for i, w in enumerate(waves) if w.shape[0] > 0]
    while pending:
        windows = [waves[i][seeks[i] : seeks[i] + window_samples] for i in pending]
        generated = decode(
            windows, [with_previous(prompts[i], previous[i], startofprev) for i in pending]
        )
        for i, window, tokens in zip(pending, windows, generated, strict=True):
            offset, limit = seeks[i] / sample_rate, (seeks[i] + window.shape[0]) / sample_rate
            pieces, seek, tail = parse_window(tokens, vocab)
            said: list[tuple[float, float, list[int]]] = []
            for start, end, ids in pieces:
                floor = out[i][-1].end if out[i] else 0.0
                a = max(min(offset + start * TIME_PRECISION, limit), floor)
                b = limit if end is None else min(offset + end * TIME_PRECISION, limit)
                text_ids = [t for t in ids if vocab.is_text(t)]
                text = decode_text(text_ids).strip()
                if text and b > a:
                    out[i].append(Segment(a, b, text, list(ids), (offset, limit)))
                    previous[i] += ids
                    said.append((a - offset, b - offset, text_ids))
            if seek is not None and speech_end is not None and said:
                # timestamps that drift early would start the next window inside the last
                # sentence, which it would then decode a second time
                heard = speech_end(window, prompts[i], said)
                if heard is not None:
                    reach = round(heard / TIME_PRECISION)
                    # an alignment that drifts late must not skip the sentence the window cut off
                    seek = max(seek, reach if tail is None else min(reach, tail))
            moved = window.shape[0] if seek is None else min(seek * step, window.shape[0])
            seeks[i] += moved if moved > 0 else window.shape[0]  # never decode a window twice
        pending = [i for i in pending if seeks[i] < waves[i].shape[0]]
    return out


def transcribe_by_silence(
    waves: Sequence[np.ndarray],
    prompts: Sequence[list[int]],
    decode: WindowDecoder,
    *,
    decode_text: Callable[[list[int]], str],
    window_seconds: float,
    sample_rate: int = SAMPLE_RATE,
) -> list[list[Segment]]:
    """Cut each recording at its quietest moments (:func:`asrforge.model.silence.segment`) and
    decode every piece; one segment per piece that has text."""
    pieces = [
        (i, a, b)
        for i, wave in enumerate(waves)
        for a, b in segment(wave, sample_rate, window_seconds)
    ]
    generated = decode([waves[i][a:b] for i, a, b in pieces], [prompts[i] for i, _, _ in pieces])
    out: list[list[Segment]] = [[] for _ in waves]
    for (i, a, b), ids in zip(pieces, generated, strict=True):
        text = decode_text(ids).strip()
        if text:
            span = (a / sample_rate, b / sample_rate)
            out[i].append(Segment(*span, text, list(ids), span))
    return out


class EncodedWindows:
    """Encoder outputs already computed for windows, keyed by the windows' samples: a window
    whose language was detected from it is not encoded again to be decoded, nor a decoded one
    to time its words. Each is handed out once and then dropped; one lives for one decoding
    call.

    Args:
        limit: how many are held at most; one more is not kept (its window is encoded again).
    """

    def __init__(self, limit: int | None = None) -> None:
        self._by_key: dict[tuple[int, bytes], torch.Tensor] = {}
        self.limit = limit

    @staticmethod
    def _key(window: np.ndarray) -> tuple[int, bytes]:
        data = np.ascontiguousarray(window, dtype=np.float32).tobytes()
        return window.shape[0], hashlib.blake2b(data, digest_size=16).digest()

    @property
    def full(self) -> bool:
        """Whether :attr:`limit` are held (one more is not kept)."""
        return self.limit is not None and len(self._by_key) >= self.limit

    def add(self, window: np.ndarray, encoded: torch.Tensor) -> None:
        """Keep ``encoded`` (frames, d_model), the encoder's output for ``window``, unless
        :attr:`full`; a row of a batch is kept as a copy of its own."""
        if self.full:
            return
        # A view would keep its whole batch alive, and :attr:`limit` counts rows.
        if encoded.untyped_storage().nbytes() > encoded.numel() * encoded.element_size():
            encoded = encoded.clone()
        self._by_key[self._key(window)] = encoded

    def take(self, window: np.ndarray) -> torch.Tensor | None:
        """The encoder output kept for ``window``'s samples (no longer kept), or None."""
        return self._by_key.pop(self._key(window), None) if self._by_key else None

    def __len__(self) -> int:
        return len(self._by_key)

    def clear(self) -> None:
        """Hold none."""
        self._by_key.clear()


HELD_BYTES = 256 << 20
"""At most this much of a round's encoder output is kept for the seek floor (``speech_end``);
above it a window is encoded again (1500 frames x d_model x the dtype's bytes a window: tiny.en
in fp32 keeps 116 windows, large-v3 in fp16 69)."""


def _held_windows(model, batch_size: int) -> int:
    """Windows :data:`HELD_BYTES` holds for ``model`` (one decode batch at least)."""
    cfg = model.config
    itemsize = getattr(model, "dtype", torch.float32).itemsize
    return max(batch_size, HELD_BYTES // (cfg.max_source_positions * cfg.d_model * itemsize))


@torch.no_grad()
def decode_windows(
    model,
    extractor,
    windows: Sequence[np.ndarray],
    prompts: Sequence[list[int]],
    *,
    eot: int,
    max_new_tokens: int,
    batch_size: int,
    device: torch.device | str = "cpu",
    options: DecodeOptions = DecodeOptions(),
    autocast: Callable[[], contextlib.AbstractContextManager] | None = None,
    sample_rate: int = SAMPLE_RATE,
    decode_text: Callable[[list[int]], str] | None = None,
    encoded: EncodedWindows | None = None,
    keep: EncodedWindows | None = None,
    capped: Callable[[], None] | None = None,
) -> list[list[int]]:
    """Decode windows (each at most one encoder window long), batched among windows of equal
    prompts -> the ids each generated (no prompt, no EOT).

    Args:
        extractor: the log-mel front end (a transformers ``WhisperFeatureExtractor``).
        options: how tokens are picked: with a ``fallback``, a window that looks like a loop
            is decoded again at higher temperatures
            (:func:`~asrforge.model.fallback.decode_with_fallback`; needs ``decode_text``);
            else beam search when :attr:`~DecodeOptions.searches_beams`, else greedy decoding.
            Its ``rules`` (e.g. ``TimestampRules``) apply to every beam. With its
            ``no_speech`` gate (:mod:`asrforge.model.no_speech`), a window the gate skips
            generates nothing.
        autocast: a context manager factory for the forward passes (the training loop's).
        encoded: windows encoded before (by language detection): not encoded again.
        keep: where each window's encoder output goes once decoded (to time its words).
        capped: called when a window stopped at ``max_new_tokens`` (its text may be cut).
    """
    if options.fallback is not None and decode_text is None:
        raise ValueError("fallback needs decode_text")
    out: list[list[int]] = [[] for _ in windows]
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for j, prompt in enumerate(prompts):
        by_prompt.setdefault(tuple(prompt), []).append(j)
    for prompt, idx in by_prompt.items():
        for k in range(0, len(idx), batch_size):
            chunk = idx[k : k + batch_size]
            known = [None if encoded is None else encoded.take(windows[j]) for j in chunk]
            unknown = [windows[j] for j, e in zip(chunk, known, strict=True) if e is None]
            with autocast() if autocast is not None else contextlib.nullcontext():
                fresh = iter(())
                if unknown:
                    fresh = iter(encode_waves(model, extractor, unknown, device, sample_rate))
                enc = torch.stack([next(fresh) if e is None else e for e in known])
                if keep is not None:
                    for j, row in zip(chunk, enc, strict=True):
                        keep.add(windows[j], row)
                ids = torch.tensor([list(prompt)] * len(chunk), device=device)
                gate = options.no_speech
                if options.fallback is not None:
                    hyps, _temps = decode_with_fallback(
                        model, enc, ids, eot, max_new_tokens, options, decode_text=decode_text
                    )
                elif options.searches_beams:
                    hyps = beam_search(model, enc, ids, eot, max_new_tokens, options)
                elif gate is not None:
                    hyps = greedy_search(model, enc, ids, eot, max_new_tokens, options)
                else:  # nothing reads a log-probability, so greedy_decode measures none
                    hyps = None
                    seqs, hit_cap = greedy_decode(model, enc, ids, eot, max_new_tokens, options)
            if hyps is not None:
                # a window the no-speech gate skips yields no text (a long recording moves
                # past it whole)
                kept = [
                    gate is None or not gate.skips(h.no_speech_prob, h.avg_logprob) for h in hyps
                ]
                seqs = [h.tokens if k else [] for h, k in zip(hyps, kept, strict=True)]
                hit_cap = [h.hit_cap and k for h, k in zip(hyps, kept, strict=True)]
            if capped is not None and any(hit_cap):
                capped()
            for j, seq in zip(chunk, seqs, strict=True):
                out[j] = seq
    return out


def choose_chunking(tokenizer, model_config, requested: str | None) -> tuple[str, str]:
    """``(chunking, why)``: ``timestamps`` when the vocabulary has timestamp tokens for the
    model's whole window, else ``silence``; ``requested`` (one of :data:`CHUNKINGS`) overrides.

    Raises:
        UserError: an unknown chunking, or ``timestamps`` for a model without timestamp tokens.
    """
    if requested is not None and requested not in CHUNKINGS:
        raise UserError(f"chunking: must be one of {', '.join(CHUNKINGS)}, got {requested!r}")
    vocab = TimestampVocab.of(tokenizer, model_config.vocab_size, window_seconds(model_config))
    if requested == "timestamps" and vocab is None:
        raise UserError(
            "chunking timestamps: this model's vocabulary has no timestamp tokens "
            "(<|0.00|> ...); use chunking silence"
        )
    if requested is not None:
        return requested, "as requested"
    if vocab is not None:
        return "timestamps", "the model predicts timestamps"
    return "silence", "the vocabulary has no timestamp tokens: long audio is cut at silences"


def transcribe_long(
    model,
    tokenizer,
    extractor,
    waves: Sequence[np.ndarray],
    prompts: Sequence[list[int]],
    *,
    chunking: str,
    no_timestamps: int,
    eot: int,
    max_new_tokens: int,
    batch_size: int,
    device: torch.device | str = "cpu",
    autocast: Callable[[], contextlib.AbstractContextManager] | None = None,
    condition_on_previous_text: bool = False,
    sample_rate: int = SAMPLE_RATE,
    options: DecodeOptions = DecodeOptions(),
    encoded: EncodedWindows | None = None,
    keep: EncodedWindows | None = None,
    heads: Sequence[tuple[int, int]] | None = None,
    word_lag: float = 0.0,
    capped: Callable[[], None] | None = None,
) -> list[list[Segment]]:
    """Transcribe recordings of any length with ``model`` (in eval mode), the way
    ``asrforge transcribe`` does: :func:`transcribe_by_timestamps` or
    :func:`transcribe_by_silence`, per ``chunking`` (see :func:`choose_chunking`).

    Args:
        prompts: each recording's ``<|notimestamps|>`` prompt (as for short clips); timestamp
            mode drops that token.
        max_new_tokens: cap per window; in timestamp mode at most half the decoder's context,
            as Whisper caps it (the other half holds the previous text).
        condition_on_previous_text: timestamp mode: ``<|startofprev|>`` + the text before.
        options: how each window is decoded (see :func:`decode_windows`; both chunkings);
            timestamp mode sets its ``rules`` to :class:`TimestampRules`.
        encoded: windows encoded before (by language detection), not encoded again.
        keep: where each decoded window's encoder output goes (to time its words); timestamp mode
            without it holds up to :data:`HELD_BYTES` of a round's windows to find where their
            text ends.
        heads: timestamp mode: the ``(layer, head)`` pairs that align a window's text to find
            where it ends (:data:`SpeechEnd`); None: the model's own
            (:func:`~asrforge.model.alignment.alignment_heads`); empty: by timestamps alone.
        word_lag: seconds those heads place words late, taken off that end.
        capped: called when a window stopped at its cap (see :func:`decode_windows`).
    """
    seconds = window_seconds(model.config)

    def text(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    def decoder(
        cap: int, window_options: DecodeOptions, held: EncodedWindows | None
    ) -> WindowDecoder:
        def decode(windows: list[np.ndarray], ps: list[list[int]]) -> list[list[int]]:
            if held is not None and held is not keep:
                held.clear()  # the round before's windows are aligned or not needed
            return decode_windows(
                model,
                extractor,
                windows,
                ps,
                eot=eot,
                max_new_tokens=cap,
                batch_size=batch_size,
                device=device,
                options=window_options,
                autocast=autocast,
                sample_rate=sample_rate,
                decode_text=text,
                encoded=encoded,
                keep=held,
                capped=capped,
            )

        return decode

    if chunking == "silence":
        if condition_on_previous_text:
            raise UserError("condition_on_previous_text: needs chunking timestamps")
        return transcribe_by_silence(
            waves,
            prompts,
            decoder(max_new_tokens, options, keep),
            decode_text=text,
            window_seconds=seconds,
            sample_rate=sample_rate,
        )
    vocab = TimestampVocab.of(tokenizer, model.config.vocab_size, seconds)
    if vocab is None:
        raise UserError("chunking timestamps: this model's vocabulary has no timestamp tokens")
    startofprev = None
    if condition_on_previous_text:
        startofprev = tokenizer.convert_tokens_to_ids("<|startofprev|>")
        if startofprev is None or startofprev == tokenizer.unk_token_id:
            raise UserError("condition_on_previous_text: the tokenizer has no <|startofprev|>")
    heads = alignment_heads(model) if heads is None else list(heads)
    # a round may hold every recording of a long-form evaluation: what the budget cannot keep
    # for speech_end is encoded again there
    held = (keep if keep is not None else EncodedWindows(limit=_held_windows(model, batch_size))
            ) if heads else keep  # fmt: skip
    specials = frozenset(tokenizer.all_special_ids)

    def speech_end(
        window: np.ndarray, prompt: list[int], said: list[tuple[float, float, list[int]]]
    ) -> float | None:
        enc = held.take(window)
        if enc is None:
            enc = encode_waves(model, extractor, [window], device, sample_rate)[0]
        elif held is keep:
            held.add(window, enc)  # word timestamps align it again
        words, median = align_words(
            model, enc[None], [*prompt, no_timestamps], [t for _, _, ts in said for t in ts],
            window.shape[0], eot=eot, decode=text, specials=specials, heads=heads,
            probabilities=False,
        )  # fmt: skip
        if not words:
            return None
        spans = [(a, b, len(ts)) for a, b, ts in said]
        return place_words(words, median, spans, lag=word_lag, hold=False)[1]

    segments = transcribe_by_timestamps(
        waves,
        [p[:-1] if p and p[-1] == no_timestamps else list(p) for p in prompts],
        decoder(
            min(max_new_tokens, model.config.max_target_positions // 2),
            dataclasses.replace(options, rules=TimestampRules(vocab)),
            held,
        ),
        vocab,
        decode_text=text,
        window_samples=round(seconds * sample_rate),
        sample_rate=sample_rate,
        startofprev=startofprev,
        speech_end=speech_end if heads else None,
    )
    if held is not None and held is not keep:
        held.clear()  # the last round's windows that speech_end did not take
    return segments
