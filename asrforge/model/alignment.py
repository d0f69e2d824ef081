"""Word-level timestamps: the decoder's cross-attention on its alignment heads, aligned to the
audio by dynamic time warping, as openai-whisper's ``timing.py`` does.

For one window of audio (at most the encoder's window) and the text tokens decoded in it:

* teacher-force ``prompt + text + EOT`` through the decoder and keep, for each alignment head
  ``(layer, head)``, its cross-attention logits ``(tokens, frames)`` over the window's audio
  frames (the padding after the audio is left out, and the softmax taken over the audio alone);
* normalize each head's weights over the tokens (zero mean, unit variance per frame), smooth
  along time with a median filter of width 7, and average the heads;
* dynamic time warping over ``-weights`` gives a monotonic path from the first row and frame
  to the last; a token starts at the first frame of the path on its row. The rows are those
  of the prompt's last two tokens and the text tokens: the row of ``<|notimestamps|>``
  predicts the first text token, and the one before it (``<|startoftranscript|>`` for an
  English-only model) attends to the audio before the first word, so a window that opens
  with silence gives it to that row, not to the first word (openai-whisper starts at
  ``<|notimestamps|>``, and its first word then starts at the window's first frame); when that
  row takes the speech too (it attends to non-speech, and a window ending in a long gap can
  reward it all along), leaving the text less than a frame a token, the text is aligned from
  ``<|notimestamps|>`` as openai-whisper does;
* tokens are grouped into words (a token starting with a space, punctuation or a special token
  starts a new one; per character for languages written without spaces), each word starting
  at its first token's start and ending at the next word's start; a word longer than twice
  the window's median word next to a sentence end is cut to that length; punctuation is then
  merged into the neighbouring word, which keeps its own times; a word's probability is the
  mean of its tokens' probabilities;
* the heads' lag (what ``asrforge align-heads`` measured,
  :func:`asrforge.model.head_timing.onset_offsets`) is taken off
  every word's times, none before its window's start;
* a word shorter than one step of the grid (its tokens started on one frame as the next
  word's) is given that step from the time after it, else before it, within its segment's
  span (or, where that has no room, the window's) and the audio, its neighbours kept apart.

The heads are the generation config's ``alignment_heads`` (openai-whisper's, which the
pretrained models ship); a model without them (built from scratch, or its heads lost) uses
every head of the upper half of the decoder's layers, openai-whisper's default.

Times are in seconds at the encoder's grid (0.02 s, :data:`~asrforge.model.frames.TIME_PRECISION`).
"""

from __future__ import annotations

import math
import string
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from asrforge.data.audio import SAMPLE_RATE
from asrforge.model.encoding import encode_waves
from asrforge.model.frames import HOP_LENGTH, TIME_PRECISION
from asrforge.model.projection import vocab_logits
from asrforge.text.languages import UNSPACED_LANGUAGES

if TYPE_CHECKING:
    # long-form decoding aligns its windows' text to seek by it, so it imports this module
    from asrforge.model.longform import EncodedWindows, Segment

MEDIAN_FILTER_WIDTH = 7
"""Frames of the median filter along time (openai-whisper's ``medfilt_width``)."""
PREPENDED_PUNCTUATION = "\"'“¿([{-"
"""Punctuation that joins the word after it."""
APPENDED_PUNCTUATION = "\"'.。,，!！?？:：”)]}、"
"""Punctuation that joins the word before it."""
SENTENCE_END = ".。!！?？"
MIN_WORD_DURATION = TIME_PRECISION
"""Seconds a word lasts at least where the time around it allows: one step of the alignment's
grid (whisper-timestamped's ``min_word_duration``), as two tokens can start on one frame."""


@dataclass
class Word:
    """One word of a transcript and its time in the recording."""

    word: str
    """The word as decoded, with its leading space and merged punctuation."""
    start: float
    """Seconds from the start of the recording."""
    end: float
    probability: float
    """Mean probability the model gave the word's tokens."""
    tokens: tuple[int, ...] = ()

    def to_dict(self) -> dict:
        return {
            "word": self.word,
            "start": round(self.start, 3),
            "end": round(self.end, 3),
            "probability": round(self.probability, 4),
        }


def alignment_heads(model) -> list[tuple[int, int]]:
    """``(layer, head)`` pairs whose cross-attention follows the audio: the generation config's
    ``alignment_heads``, else every head of the upper half of the decoder's layers."""
    recorded = getattr(getattr(model, "generation_config", None), "alignment_heads", None)
    cfg = model.config
    if recorded:
        return [(int(layer), int(head)) for layer, head in recorded]
    return [
        (layer, head)
        for layer in range(cfg.decoder_layers // 2, cfg.decoder_layers)
        for head in range(cfg.decoder_attention_heads)
    ]


def median_filter(x: torch.Tensor, width: int) -> torch.Tensor:
    """Median over a sliding window of ``width`` (odd) along the last axis, edges reflected.

    The ``width`` shifted copies of ``x`` are sorted elementwise by an odd-even transposition
    network of minimum/maximum pairs and the middle one taken: the same values as
    ``unfold(...).median``, which took six times as long on a window's heads (bench/README.md,
    "The seek floor's alignment")."""
    pad = width // 2
    if x.shape[-1] <= pad:
        return x
    n = x.shape[-1]
    flat = x.reshape(-1, 1, n)
    padded = torch.nn.functional.pad(flat, (pad, pad), mode="reflect")[:, 0]
    shifted = [padded[:, k : k + n] for k in range(width)]
    for rnd in range(width):
        for i in range(rnd % 2, width - 1, 2):
            a, b = shifted[i], shifted[i + 1]
            shifted[i], shifted[i + 1] = torch.minimum(a, b), torch.maximum(a, b)
    return shifted[pad].reshape(x.shape)


def dtw(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Dynamic time warping of a ``(tokens, frames)`` cost matrix: the cheapest monotonic path
    from ``(0, 0)`` to ``(tokens - 1, frames - 1)`` (steps: diagonal, down, right; on a tie the
    diagonal, then down).

    Returns:
        ``(token_indices, frame_indices)`` of the path, in order.
    """
    n, m = cost.shape
    # Cell (i, j) of the accumulated cost (1-based; row and column 0 are the border) is kept at
    # [i + j, i]: a cell needs only the two anti-diagonals before its own, so each anti-diagonal
    # is one vector operation over contiguous slices instead of a loop over its cells.
    rows, columns = np.arange(1, n + 1)[:, None], np.arange(1, m + 1)[None, :]
    skewed_cost = np.full((n + m + 1, n + 1), np.inf)
    skewed_cost[rows + columns, rows] = cost
    acc = np.full((n + m + 1, n + 1), np.inf)
    acc[0, 0] = 0.0
    trace = np.zeros((n + m + 1, n + 1), dtype=np.int8)
    for d in range(2, n + m + 1):
        lo, hi = max(1, d - m), min(n, d - 1)  # the rows i of anti-diagonal d
        diag, up, left = acc[d - 2, lo - 1 : hi], acc[d - 1, lo - 1 : hi], acc[d - 1, lo : hi + 1]
        by_diag = (diag <= up) & (diag <= left)
        by_up = up <= left
        np.add(
            skewed_cost[d, lo : hi + 1],
            np.where(by_diag, diag, np.where(by_up, up, left)),
            out=acc[d, lo : hi + 1],
        )
        trace[d, lo : hi + 1] = np.where(by_diag, 0, np.where(by_up, 1, 2))
    i, j = n, m
    tokens, frames = [], []
    while i > 0 and j > 0:
        tokens.append(i - 1)
        frames.append(j - 1)
        # the cells of row 0 and column 0 (but the corner) cost inf, so the path ends at (0, 0)
        step = trace[i + j, i]
        if step == 0:
            i, j = i - 1, j - 1
        elif step == 1:
            i -= 1
        else:
            j -= 1
    return np.array(tokens[::-1]), np.array(frames[::-1])


def split_words(
    tokens: Sequence[int],
    decode: Callable[[list[int]], str],
    specials: frozenset[int],
    *,
    unspaced: bool = False,
) -> list[list[int]]:
    """Group text ``tokens`` into words: the token lists of each, in order.

    A token list that decodes to an incomplete UTF-8 character (a byte-level BPE piece) is kept
    with the tokens after it until the character is whole. With ``unspaced`` each character is
    a word; else a piece starting with a space, a punctuation piece or a special token starts a
    new word.
    """
    pieces: list[list[int]] = []
    current: list[int] = []
    for token in tokens:
        current.append(token)
        if "\ufffd" not in decode(current):
            pieces.append(current)
            current = []
    if current:
        pieces.append(current)
    if unspaced:
        return pieces
    words: list[list[int]] = []
    for piece in pieces:
        text = decode(piece)
        starts_word = (
            piece[0] in specials
            or text.startswith(" ")
            or text.strip() in string.punctuation
            or not words
        )
        if starts_word:
            words.append(list(piece))
        else:
            words[-1].extend(piece)
    return words


def merge_punctuation(words: list[Word]) -> list[Word]:
    """Join punctuation to its word: opening marks to the word after, closing marks to the word
    before (openai-whisper's ``merge_punctuations``); the word keeps its own times, so a full
    stop the alignment stretched over the pause after it does not stretch its word."""
    out = list(words)
    # opening marks, from the end so that a mark joins the word after it
    i = len(out) - 2
    while i >= 0:
        prev, nxt = out[i], out[i + 1]
        if prev.word.startswith(" ") and prev.word.strip() in PREPENDED_PUNCTUATION:
            out[i + 1] = Word(
                prev.word + nxt.word, nxt.start, nxt.end, _mean_probability(prev, nxt),
                prev.tokens + nxt.tokens,
            )  # fmt: skip
            del out[i]
        i -= 1
    i = 0
    while i < len(out) - 1:
        prev, nxt = out[i], out[i + 1]
        if not prev.word.endswith(" ") and nxt.word in APPENDED_PUNCTUATION:
            out[i] = Word(
                prev.word + nxt.word, prev.start, prev.end, _mean_probability(prev, nxt),
                prev.tokens + nxt.tokens,
            )  # fmt: skip
            del out[i + 1]
        else:
            i += 1
    return out


def median_word(words: Sequence[Word]) -> float:
    """The median length of the words that have one, at most 0.7 s (openai-whisper's measure
    of a window's words, which its corrections of long words are relative to); 0 for none."""
    durations = np.array([w.end - w.start for w in words])
    durations = durations[durations.nonzero()]
    return min(0.7, float(np.median(durations))) if len(durations) else 0.0


def cut_at_sentence_ends(words: list[Word], longest: float) -> None:
    """A word longer than ``longest`` next to a sentence end, as DTW stretches one over the
    pause there, cut to that length: a full stop from its start, the word after it from its
    end (in place, on the window's words before punctuation is merged)."""
    for i in range(1, len(words)):
        w = words[i]
        if w.end - w.start > longest:
            if w.word.strip() in SENTENCE_END:
                w.end = w.start + longest
            elif words[i - 1].word.strip() in SENTENCE_END:
                w.start = w.end - longest


def _mean_probability(a: Word, b: Word) -> float:
    n_a, n_b = max(len(a.tokens), 1), max(len(b.tokens), 1)
    return (a.probability * n_a + b.probability * n_b) / (n_a + n_b)


@torch.no_grad()
def cross_attention(
    model,
    encoder_out: torch.Tensor,
    ids: torch.Tensor,
    heads: Sequence[tuple[int, int]],
    *,
    logits: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Teacher-force ``ids`` and read the cross-attention logits of ``heads``.

    Args:
        encoder_out: (1, frames, d_model) one window's encoder output.
        ids: (1, n) the decoder's input ids.
        heads: ``(layer, head)`` pairs.
        logits: whether to project the decoder's states onto the vocabulary (a third of the
            time on tiny.en); False gives None for them.

    Returns:
        ``(logits, qk)``: (n, vocab) the decoder's logits, and (len(heads), n, frames) each
        head's pre-softmax attention scores.
    """
    layers = model.model.decoder.layers
    wanted: dict[int, list[int]] = {}
    for layer, head in heads:
        wanted.setdefault(layer, []).append(head)
    captured: dict[int, torch.Tensor] = {}
    hooks = []
    owner = threading.get_ident()

    def capture(layer: int):
        def hook(module, args, kwargs):
            # another thread's pass through the shared model fires the hook too
            if threading.get_ident() == owner:
                captured[layer] = args[0] if args else kwargs["hidden_states"]

        return hook

    try:
        for layer in wanted:
            hooks.append(
                layers[layer].encoder_attn.register_forward_pre_hook(
                    capture(layer), with_kwargs=True
                )
            )
        hidden = model.model.decoder(
            input_ids=ids, encoder_hidden_states=encoder_out, use_cache=False
        ).last_hidden_state
    finally:
        for h in hooks:
            h.remove()
    projected = vocab_logits(model, hidden)[0].float() if logits else None
    scores = {}
    for layer, hs in wanted.items():
        attn = layers[layer].encoder_attn
        n_heads, head_dim = attn.num_heads, attn.head_dim
        q = (attn.q_proj(captured[layer]) * attn.scaling)[0].view(-1, n_heads, head_dim)
        k = attn.k_proj(encoder_out)[0].view(-1, n_heads, head_dim)
        qk = torch.einsum("thd,fhd->htf", q.float(), k.float())
        for head in hs:
            scores[(layer, head)] = qk[head]
    return projected, torch.stack([scores[(layer, head)] for layer, head in heads])


def token_starts(qk: torch.Tensor, n_prompt: int, n_text: int, n_samples: int) -> np.ndarray:
    """Where each text token starts, by the heads of ``qk`` together (see the module docstring).

    Args:
        qk: (heads, n_prompt + n_text + 1, frames) the attention scores of the decoder's input
            ``prompt + text + EOT``, as :func:`cross_attention` gives them.
        n_prompt: prompt tokens, the last ``<|notimestamps|>``.
        n_samples: the window's audio in samples at 16 kHz (the frames after it are padding).

    Returns:
        (n_text + 1,) seconds from the window's start: each text token's start, then the end of
        the last one.
    """
    frames = max(1, min(qk.shape[-1], n_samples // HOP_LENGTH // 2))
    weights = qk[:, :, :frames].softmax(dim=-1)
    std, mean = torch.std_mean(weights, dim=-2, keepdim=True, unbiased=False)
    weights = median_filter((weights - mean) / std.clamp_min(1e-10), MEDIAN_FILTER_WIDTH)
    matrix = weights.mean(dim=0)

    def start_frames(lead: int) -> np.ndarray:
        rows = matrix[n_prompt - 1 - lead : n_prompt + n_text]
        token_index, frame_index = dtw(-rows.double().cpu().numpy())
        jumps = np.diff(token_index, prepend=-1).astype(bool)
        return frame_index[jumps][lead:]

    # the row before <|notimestamps|> takes the audio before the first word; a prompt of one
    # token has none
    found = start_frames(1 if n_prompt >= 2 else 0)
    if n_prompt >= 2 and found[-1] - found[0] < n_text:
        # That row attends to non-speech, and a window ending in a long gap rewarded it all
        # along: it took the speech too, leaving the text less than a frame a token. (One
        # that takes most of the speech but leaves a frame a token is not told apart.)
        found = start_frames(0)
    return found * TIME_PRECISION


def align_words(
    model,
    encoder_out: torch.Tensor,
    prompt: Sequence[int],
    text_tokens: Sequence[int],
    n_samples: int,
    *,
    eot: int,
    decode: Callable[[list[int]], str],
    specials: frozenset[int],
    heads: Sequence[tuple[int, int]],
    unspaced: bool = False,
    probabilities: bool = True,
) -> tuple[list[Word], float]:
    """The words of one window and their times in it (see the module docstring).

    Args:
        encoder_out: (1, frames, d_model) the window's encoder output.
        prompt: the decoder prompt, ending in ``<|notimestamps|>``.
        text_tokens: the window's decoded text ids (no timestamps, no specials).
        n_samples: the window's audio length in samples at 16 kHz (the frames after it are
            padding and left out).
        probabilities: False: each word's probability is nan, not computed (where only the
            times are wanted).

    Returns:
        Words with times in seconds from the window's start, long words at sentence ends cut
        and punctuation merged, and :func:`median_word` of the window's words.
    """
    text_tokens = list(text_tokens)
    if not text_tokens:
        return [], 0.0
    device = encoder_out.device
    ids = torch.tensor([[*prompt, *text_tokens, eot]], device=device)
    logits, qk = cross_attention(model, encoder_out, ids, heads, logits=probabilities)
    token_probs = np.full(len(text_tokens), np.nan)
    if logits is not None:
        probs = logits[len(prompt) - 1 : len(prompt) - 1 + len(text_tokens)].softmax(dim=-1)
        token_probs = probs[torch.arange(len(text_tokens)), torch.tensor(text_tokens)].cpu().numpy()
    starts = token_starts(qk, len(prompt), len(text_tokens), n_samples)

    word_tokens = split_words(text_tokens, decode, specials, unspaced=unspaced)
    words, k = [], 0
    for toks in word_tokens:
        a, b = k, k + len(toks)
        words.append(
            Word(decode(toks), float(starts[a]), float(starts[b]), float(token_probs[a:b].mean()),
                 tuple(toks))
        )  # fmt: skip
        k = b
    median = median_word(words)
    if median > 0:
        cut_at_sentence_ends(words, 2 * median)
    return merge_punctuation(words), median


def tidy_long_words(
    words: list[Word],
    segment_start: float,
    segment_end: float,
    last_speech: float = 0.0,
    *,
    median: float,
) -> float:
    """openai-whisper's corrections of a segment's first and last words, in its order: the
    first word, when it ends more than four median words after the last speech before it and
    it (or it and the next) is longer than twice the median word, is cut to that length, the
    pause going before it; the first and last words are held to the segment's own timestamps
    when they run past them by more than 0.5 s.

    The path of the alignment starts at the window's first frame, so without the first rule the
    first word of a recording that opens with silence starts at 0 s.

    Args:
        words: one segment's words, times in seconds from the recording's start (changed in
            place).
        segment_start, segment_end: the segment's times, same clock.
        last_speech: where the speech before this segment ended (the previous segment's
            return value; 0 for a recording's first).
        median: :func:`median_word` of the window the segment was aligned in.

    Returns:
        Where this segment's speech ends: its last word's end (``last_speech`` when it has no
        words).
    """
    if not words:
        return last_speech
    longest = median * 2
    first, last = words[0], words[-1]
    second = words[1] if len(words) > 1 else None
    after_pause = median > 0 and first.end - last_speech > median * 4
    if after_pause and (
        first.end - first.start > longest
        or (second is not None and second.end - first.start > longest * 2)
    ):
        if second is not None and second.end - second.start > longest:
            boundary = max(second.end / 2, second.end - longest)
            first.end = second.start = boundary
        first.start = max(0.0, first.end - longest)
    if segment_start < first.end and segment_start - 0.5 > first.start:
        first.start = max(0.0, min(first.end - median, segment_start))
    if segment_end > last.start and segment_end + 0.5 < last.end:
        last.end = max(last.start + median, segment_end)
    return last.end


def hold_word_lengths(words: list[Word], earliest: float, latest: float) -> None:
    """Give each of one segment's words at least :data:`MIN_WORD_DURATION`, in place, within
    ``[earliest, latest]``: a shorter word takes time from the gap or the words after it, and
    at ``latest`` from those before it, the words staying in order and apart. Where the span
    holds less than that a word, the last words stay shorter.

    Args:
        words: one segment's words, in order, none overlapping the next.
        earliest, latest: seconds the words may span (a word already outside stays there).
    """
    if not words:
        return
    earliest, latest = min(earliest, words[0].start), max(latest, earliest)
    # forward: each word ends MIN_WORD_DURATION after its start at least, pushing later words
    floor = earliest
    for w in words:
        w.start = max(w.start, floor)
        w.end = max(w.end, w.start + MIN_WORD_DURATION)
        floor = w.end
    # backward: none past `latest`, pulling earlier words back as far as `earliest`
    ceiling = latest
    for w in reversed(words):
        w.end = min(w.end, ceiling)
        w.start = max(min(w.start, w.end - MIN_WORD_DURATION), earliest)
        ceiling = w.start
    # a span too short for every word: the first ones keep their length, none overlaps
    floor = earliest
    for w in words:
        w.start = max(w.start, floor)
        w.end = max(w.end, w.start)
        floor = w.end


def place_words(
    words: Sequence[Word],
    median: float,
    segments: Sequence[tuple[float, float, int]],
    *,
    offset: float = 0.0,
    lag: float = 0.0,
    last_speech: float = 0.0,
    audio_end: float = math.inf,
    hold: bool = True,
) -> tuple[list[list[Word]], float]:
    """One window's aligned words -> each of its segments' words, :func:`tidy_long_words` then
    (``hold``) :func:`hold_word_lengths` applied to each segment in order.

    Args:
        words: :func:`align_words`'s words, seconds from the window's start (not changed).
        median: :func:`align_words`'s median word.
        segments: ``(start, end, n_text_tokens)`` of each segment the words came from, in order,
            seconds on the clock the result is on; a word goes to the segment its first token
            came from.
        offset: where the window starts on that clock.
        lag: seconds the heads place words late, taken off every word's times, none before the
            window's start.
        last_speech: where the speech before the first segment ended, same clock.
        audio_end: where the window's audio ends, same clock: no word runs past it.
        hold: give each word a frame at least, as word timestamps show them; False for where
            the speech ends as aligned (long-form decoding's seek floor), which a frame held
            for a word of no length would move.

    Returns:
        ``(words per segment, where the last segment's speech ends)``.
    """
    earliest = previous_end = max(offset, last_speech)
    bounds = np.cumsum([n for _, _, n in segments])
    per_segment: list[list[Word]] = [[] for _ in segments]
    k = 0
    for w in words:
        where = min(int(np.searchsorted(bounds, k, side="right")), len(segments) - 1)
        start, end = (offset + max(0.0, t - lag) for t in (w.start, w.end))
        per_segment[where].append(Word(w.word, start, end, w.probability, w.tokens))
        k += len(w.tokens)
    for (start, end, _), placed in zip(segments, per_segment, strict=True):
        last_speech = tidy_long_words(placed, start, end, last_speech, median=median)
    if not hold:
        return per_segment, last_speech
    # A word gets length from its segment's span (its words' or its timestamps', whichever is
    # wider), never before the previous segment's words nor into the next one's.
    for k, ((start, end, _), placed) in enumerate(zip(segments, per_segment, strict=True)):
        if not placed:
            continue
        following = [ws[0].start for ws in per_segment[k + 1 :] if ws]
        latest = min(max(placed[-1].end, min([end, *following[:1]])), audio_end)
        hold_word_lengths(placed, max(start, previous_end), latest)
        previous_end = placed[-1].end
    # A segment whose span has no room left (the next one's words start where it ends) lends
    # across its bounds, as the window's words are in order all the same.
    every = [w for placed in per_segment for w in placed]
    if every:
        latest = min(max(every[-1].end, segments[-1][1]), audio_end)
        hold_word_lengths(every, earliest, latest)
        last_speech = every[-1].end
    return per_segment, last_speech


@torch.no_grad()
def add_word_timestamps(
    model,
    extractor,
    waves: Sequence[np.ndarray],
    segments: Sequence[Sequence[Segment]],
    prompts: Sequence[Sequence[int]],
    languages: Sequence[str],
    *,
    eot: int,
    decode: Callable[[list[int]], str],
    non_text: frozenset[int],
    device: torch.device | str = "cpu",
    sample_rate: int = SAMPLE_RATE,
    heads: Sequence[tuple[int, int]] | None = None,
    encoded: EncodedWindows | None = None,
    lag: float = 0.0,
) -> None:
    """Set ``words`` on every segment: each window's segments aligned together, as
    openai-whisper aligns a window's text, then :func:`tidy_long_words` per segment, in order,
    each knowing where the speech before it ended.

    Args:
        waves: (n_samples,) recordings at ``sample_rate``.
        segments: each recording's segments (their ``window`` says which audio they came from).
        prompts: each recording's decoder prompt, ending in ``<|notimestamps|>``.
        languages: each recording's language code (unspaced scripts are split per character).
        non_text: ids that are not text (specials, timestamps).
        heads: ``(layer, head)`` pairs to align with; None: :func:`alignment_heads`.
        encoded: windows decoding encoded (and kept): not encoded again.
        lag: seconds the heads place words late (what ``asrforge align-heads`` measured),
            taken off every word's times, none before its window's start.
    """
    heads = alignment_heads(model) if heads is None else list(heads)
    for wave, segs, prompt, language in zip(waves, segments, prompts, languages, strict=True):
        last_speech = 0.0
        by_window: dict[tuple[float, float], list[Segment]] = {}
        for s in segs:
            by_window.setdefault(s.window, []).append(s)
        for (a, b), group in by_window.items():
            audio = wave[round(a * sample_rate) : round(b * sample_rate)]
            kept = None if encoded is None else encoded.take(audio)
            if kept is not None:
                encoder_out = kept[None]
            else:
                encoder_out = encode_waves(model, extractor, [audio], device, sample_rate)
            texts = [[t for t in s.tokens if t not in non_text] for s in group]
            words, median = align_words(
                model,
                encoder_out,
                prompt,
                [t for ts in texts for t in ts],
                audio.shape[0],
                eot=eot,
                decode=decode,
                specials=non_text,
                heads=heads,
                unspaced=language in UNSPACED_LANGUAGES,
            )
            spans = [(s.start, s.end, len(ts)) for s, ts in zip(group, texts, strict=True)]
            per_segment, last_speech = place_words(
                words, median, spans, offset=a, lag=lag, last_speech=last_speech,
                audio_end=a + audio.shape[0] / sample_rate,
            )  # fmt: skip
            for s, placed in zip(group, per_segment, strict=True):
                s.words = placed
