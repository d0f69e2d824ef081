"""Greedy decoding with a pre-allocated KV cache, shared by evaluation and inference bundles,
and Whisper's timestamp rules for long-form transcription (:class:`TimestampRules`).

How a decode runs (docs/decoding.md, "How decoding runs"): the decoder's self-attention keys
and values go to transformers' ``StaticCache`` sized once per decode, the cross-attention ones
are projected once; the suppressed tokens are one mask built per decode; a sequence that ended
keeps its row, its next tokens forced to EOT; the host reads whether every sequence ended only
every :data:`CHECK_EVERY` tokens on an accelerator.
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from asrforge.model.capture import CapturedStep
from asrforge.model.frames import TIME_PRECISION
from asrforge.model.projection import packed_linears, vocab_logits

if TYPE_CHECKING:
    from asrforge.lm.fusion import ShallowFusion
    from asrforge.model.fallback import Fallback
    from asrforge.model.no_speech import NoSpeech

log = logging.getLogger(__name__)

CHECK_EVERY = 16
"""Tokens between two reads of "has every sequence ended?" on an accelerator: a read stalls the
host until the device has run all it queued, so one read per 16 tokens keeps a GPU fed at the
price of at most 15 steps past the batch's end (on the CPU, where nothing is queued, it reads
every token)."""


@functools.cache
def _cache_argument(decoder_class: type) -> str:
    # transformers 5 renamed the decoder's past_key_values argument to cache and warns on the old name.
    params = inspect.signature(decoder_class.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


Rules = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``rules(logits, generated)`` -> logits with forbidden tokens at ``-inf``, applied at every
step before the pick; ``logits`` is (rows, vocab), ``generated`` (rows, t) the ids each row
generated so far (e.g. :class:`TimestampRules`)."""


@dataclass(frozen=True)
class DecodeOptions:
    """How every decoder picks tokens (openai-whisper's ``DecodingOptions``): one value carried
    from the caller (evaluation, a bundle, long-form transcription) to the decoder that reads
    it, so a new option is added here and read where it matters, not threaded through each
    layer."""

    beam_size: int = 1
    """Beams per utterance; 1: greedy decoding (:func:`greedy_decode`), more:
    :func:`~asrforge.model.beam.beam_search`."""
    patience: float = 1.0
    """Beam search: finished hypotheses to collect per utterance, in units of ``beam_size``."""
    length_penalty: float | None = None
    """Beam search's ranking (:func:`~asrforge.model.beam.length_normalized`)."""
    rules: Rules | None = None
    """Token rules applied at every step before the pick (:data:`Rules`)."""
    fusion: ShallowFusion | None = None
    """A word n-gram LM fused into beam search (:class:`~asrforge.lm.fusion.ShallowFusion`);
    read by beam search only: at ``beam_size`` 1 decoding stays greedy, without it."""
    fallback: Fallback | None = None
    """Temperature fallback (:mod:`asrforge.model.fallback`); None: off."""
    no_speech: NoSpeech | None = None
    """The no-speech gate (:mod:`asrforge.model.no_speech`): decoders then measure each row's
    no-speech probability (``Hypothesis.no_speech_prob``); None: off."""
    check_every: int | None = None
    """Greedy decoding: tokens between the host's reads of whether every sequence ended;
    None: :func:`check_interval` of the device."""
    capture: bool = False
    """Greedy decoding without ``rules``: replay each decoder step from a captured graph
    (:class:`~asrforge.model.capture.CapturedStep`; a CUDA graph on a GPU) instead of
    launching its kernels one by one (``eval.compile``)."""

    @property
    def searches_beams(self) -> bool:
        """Whether beam search decodes (more than one beam); greedy decoding otherwise, an LM
        ``fusion`` or not, as ``--beam-size`` 1 promises."""
        return self.beam_size > 1


@dataclass(frozen=True)
class Hypothesis:
    """One decoded sequence: ``tokens`` without prompt and EOT; ``sum_logprob`` the sum of the
    chosen tokens' log-probabilities including EOT's (natural log; after suppression and
    ``rules``, renormalized); ``hit_cap``: the sequence ran out of tokens before EOT;
    ``no_speech_prob``: measured with :attr:`DecodeOptions.no_speech`, else None."""

    tokens: list[int]
    sum_logprob: float
    hit_cap: bool
    no_speech_prob: float | None = None

    @property
    def avg_logprob(self) -> float:
        """openai-whisper's ``avg_logprob``: per token, EOT counted."""
        return self.sum_logprob / (len(self.tokens) + 1)


COMPILE_SETTINGS = ("auto", "on", "off")


def capture_for(setting: str, device: torch.device | str) -> bool:
    """Whether ``eval.compile`` ``setting`` captures the decoder step on ``device``: ``auto``
    on CUDA only, where a greedy step is bound by kernel launches; on the CPU a step's kernels
    cost more than their launches, so there is nothing to win."""
    if setting not in COMPILE_SETTINGS:
        raise ValueError(
            f"eval.compile: must be one of {', '.join(COMPILE_SETTINGS)}, got {setting!r}"
        )
    if setting == "auto":
        return torch.device(device).type == "cuda"
    return setting == "on"


def check_interval(device: torch.device | str) -> int:
    """Tokens between two host reads of the decoders' stop condition on ``device``
    (:data:`CHECK_EVERY`; 1 on the CPU, where a read waits for nothing)."""
    return 1 if torch.device(device).type == "cpu" else CHECK_EVERY


def new_cache(model, max_len: int):
    """An ``EncoderDecoderCache`` for one decode: the self-attention part transformers'
    ``StaticCache`` of ``max_len`` positions (allocated at the first decoder pass, written in
    place), the cross-attention part a ``DynamicCache`` filled once from the encoder output."""
    # transformers loads when a decode runs, not when asrforge.model is imported
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache, StaticCache

    # WhisperConfig's num_hidden_layers is the encoder's depth; the cache needs the decoder's.
    config = copy.copy(model.config)
    config.num_hidden_layers = model.config.decoder_layers
    return EncoderDecoderCache(StaticCache(config=config, max_cache_len=max_len), DynamicCache())


def static_copy(model, cache, max_len: int):
    """``cache`` (an ``EncoderDecoderCache`` whose self-attention part holds a prompt) as a
    :func:`new_cache` of ``max_len`` positions: the prompt's keys and values copied in, the
    cross-attention part shared."""
    # transformers loads when a decode runs, not when asrforge.model is imported
    from transformers.cache_utils import EncoderDecoderCache, StaticCache

    if isinstance(cache.self_attention_cache, StaticCache):
        return cache
    static = new_cache(model, max_len).self_attention_cache
    for i, layer in enumerate(cache.self_attention_cache.layers):
        static.update(layer.keys, layer.values, i)
    return EncoderDecoderCache(static, cache.cross_attention_cache)


def decoder_states(
    model, tokens: torch.Tensor, encoder_hidden: torch.Tensor, cache
) -> torch.Tensor:
    """Run Whisper's decoder on ``tokens`` (batch, t) after what ``cache`` holds, extending it.

    Args:
        model: a ``WhisperForConditionalGeneration``.
        tokens: (batch, t) token ids that follow the cached positions.
        encoder_hidden: (batch, frames, d_model) the encoder's output.
        cache: an ``EncoderDecoderCache``, extended in place.

    Returns:
        (batch, t, d_model) the decoder's last hidden states.
    """
    decoder = model.model.decoder
    cached = {_cache_argument(type(decoder)): cache}
    return decoder(
        input_ids=tokens, encoder_hidden_states=encoder_hidden, use_cache=True, **cached
    ).last_hidden_state


def codes_of_tokens(language_ids: Mapping[str, int]) -> dict[int, str]:
    """Each language token's code in ``language_ids`` (code -> token): the first language that
    has it, since a language that borrows another's token (``data.language_tokens``) is listed
    after it."""
    codes: dict[int, str] = {}
    for code, token in language_ids.items():
        codes.setdefault(token, code)
    return codes


@torch.no_grad()
def detect_languages(
    model, encoder_hidden: torch.Tensor, sot: int, tokens: Iterable[int]
) -> list[int]:
    """The language token each window's decoder ranks first, among ``tokens``, right after
    ``<|startoftranscript|>`` (one decoder pass over the (batch, frames, d_model)
    ``encoder_hidden``), as Whisper detects a language."""
    ids = sorted(set(tokens))
    rows = encoder_hidden.shape[0]
    prompt = torch.full((rows, 1), sot, dtype=torch.long, device=encoder_hidden.device)
    h = model.model.decoder(input_ids=prompt, encoder_hidden_states=encoder_hidden)
    logits = vocab_logits(model, h.last_hidden_state[:, -1])[:, ids]
    return [ids[int(k)] for k in logits.argmax(-1)]


def suppressed_ids(model) -> tuple[list[int], list[int]]:
    """``(always, at_begin)``: the token ids the model's generation config suppresses at every
    step (``suppress_tokens``: Whisper's non-speech symbols) and at the first generated position
    (``begin_suppress_tokens``: a leading space, EOT) — what transformers' ``generate`` applies
    to Whisper, so greedy decoding here picks the tokens it would. Empty for a from-scratch model.
    """
    gc = getattr(model, "generation_config", None)
    vocab = model.config.vocab_size

    def ids(name: str) -> list[int]:
        return sorted({int(i) for i in (getattr(gc, name, None) or []) if 0 <= int(i) < vocab})

    return ids("suppress_tokens"), ids("begin_suppress_tokens")


@dataclass(frozen=True)
class Suppression:
    """The generation config's suppressed tokens (:func:`suppressed_ids`) as two (vocab,) bool
    masks on the decoding device, built once per decode: ``always`` for every step, ``first``
    (``always`` and ``begin_suppress_tokens``) for the first generated position."""

    always: torch.Tensor
    first: torch.Tensor

    @classmethod
    def of(cls, model, device: torch.device | str) -> Suppression:
        always, at_begin = suppressed_ids(model)
        mask = torch.zeros(model.config.vocab_size, dtype=torch.bool, device=device)
        mask[always] = True
        first = mask.clone()
        first[at_begin] = True
        return cls(mask, first)

    def apply(self, logits: torch.Tensor, t: int) -> torch.Tensor:
        """``logits`` (rows, vocab) with step ``t``'s suppressed tokens at -inf (a copy)."""
        mask = self.first if t == 0 else self.always
        return logits.masked_fill(mask[: logits.shape[-1]], float("-inf"))


class PickMask:
    """One greedy decode's (rows, vocab) additive mask over the logits: 0 where a token may be
    picked, -inf where not. It folds the step's suppressed tokens (:class:`Suppression`) and
    the rows that ended (every token but EOT) into one tensor, built once and rewritten in
    place after each pick, so a step adds it and allocates nothing.

    Args:
        suppression: the suppressed tokens; ``values`` starts with the first step's.
        eot: the end-of-text id.
        rows: batch rows.
        vocab: the logits' width.
    """

    def __init__(self, suppression: Suppression, eot: int, rows: int, vocab: int):
        def additive(blocked: torch.Tensor) -> torch.Tensor:
            zeros = torch.zeros(vocab, device=blocked.device)
            return zeros.masked_fill(blocked[:vocab], float("-inf"))

        self.eot = eot
        self.always = additive(suppression.always)
        self.after_end = torch.full_like(self.always, float("-inf"))
        self.after_end[eot] = 0.0
        self.values = additive(suppression.first).expand(rows, vocab).clone()
        self.ended = torch.zeros(rows, dtype=torch.bool, device=self.always.device)
        self._hit = torch.zeros_like(self.ended)

    def update(self, picked: torch.Tensor) -> None:
        """After a step's (rows,) ``picked`` ids: a row that picked EOT has ended; every row's
        mask becomes the later steps' (in place)."""
        torch.eq(picked, self.eot, out=self._hit)
        self.ended.logical_or_(self._hit)
        torch.where(self.ended[:, None], self.after_end, self.always, out=self.values)


def greedy_step(
    model,
    tokens: torch.Tensor,
    encoder_hidden: torch.Tensor,
    cache,
    mask: torch.Tensor,
    rules: Rules | None = None,
    generated: torch.Tensor | None = None,
    sums: torch.Tensor | None = None,
) -> torch.Tensor:
    """One greedy step: (batch, t) ``tokens`` after what ``cache`` holds -> the (batch,) ids
    picked (:func:`greedy_pick`); ``cache`` is extended. The captured path replays this same
    function (:class:`~asrforge.model.capture.CapturedStep`)."""
    h = decoder_states(model, tokens, encoder_hidden, cache)[:, -1]
    return greedy_pick(model, h, mask, rules, generated, sums)


def greedy_pick(
    model,
    h: torch.Tensor,
    mask: torch.Tensor,
    rules: Rules | None = None,
    generated: torch.Tensor | None = None,
    sums: torch.Tensor | None = None,
) -> torch.Tensor:
    """The (batch,) ids greedy decoding picks after the decoder states ``h`` (batch, d_model):
    ``mask`` ((batch, vocab), :class:`PickMask`) added to the logits before the ``rules``
    (given ``generated``, (batch, t) ids so far); with ``sums`` ((batch,) float), each pick's
    log-probability under those logits is added to it in place (0 for a row that ended, whose
    mask leaves only EOT)."""
    # the mask first, as openai-whisper suppresses before its timestamp rules: a suppressed
    # token must not count as the likeliest text the timestamps' mass is weighed against
    logits = vocab_logits(model, h).add_(mask)
    if rules is not None:
        logits = rules(logits, generated)
    picked = logits.argmax(-1)
    if sums is not None:
        # written in place, so a captured step adds to the same tensor at every replay
        sums.add_(logits.gather(1, picked[:, None]).squeeze(1) - logits.logsumexp(-1))
    return picked


def capture_step(model, tokens, encoder_hidden, cache, mask, sums=None) -> CapturedStep | None:
    """:func:`greedy_step` without rules over one decode's cache, encoder output, mask (and
    ``sums``), as a :class:`~asrforge.model.capture.CapturedStep` taking the (batch, 1) tokens;
    None, with a warning, when the step cannot be captured (the decode goes on uncaptured, same
    tokens)."""
    try:
        return CapturedStep(
            lambda step_tokens: greedy_step(
                model, step_tokens, encoder_hidden, cache, mask, sums=sums
            ),
            tokens,
        )
    except RuntimeError as e:
        log.warning("eval.compile: the decoder step could not be captured (%s); uncaptured", e)
        return None


@torch.no_grad()
def greedy_decode(
    model,
    encoder_hidden: torch.Tensor,
    prompts: torch.Tensor,
    eot: int,
    max_new_tokens: int,
    options: DecodeOptions = DecodeOptions(),
    *,
    cache=None,
    first_tokens: torch.Tensor | None = None,
) -> tuple[list[list[int]], list[bool]]:
    """Greedy decoding with a pre-allocated KV cache (:func:`new_cache`), one
    :func:`greedy_step` per token. A sequence that emitted EOT keeps its row, its next tokens
    forced to EOT (:class:`PickMask`); the loop stops at the first check (every
    ``check_every`` tokens) that finds every sequence ended, or at the cap. The generation
    config's suppressed tokens are never picked (:func:`suppressed_ids`).

    Args:
        encoder_hidden: (batch, frames, d_model) encoder output.
        prompts: (batch, prompt_len) forced prefix ids (start, language, task, no-timestamps).
        max_new_tokens: cap on generated tokens per sequence (the decoder's own limit applies too).
        options: read here: ``rules`` (``generated`` holds EOT repeated after a sequence's end),
            ``check_every`` and ``capture`` (without ``rules`` only: they read a growing
            ``generated``).
        cache: an ``EncoderDecoderCache`` already holding the prompt's self-attention keys and
            values and the encoder's cross-attention ones (e.g. a teacher-forced pass's cache
            cropped to the prompt); then ``first_tokens`` must be given too.
        first_tokens: (batch,) the token chosen after the prompt, when ``cache`` is given
            (chosen with the first step's :class:`Suppression`, as here).

    Returns:
        The generated ids of each sequence (without prompt and EOT), and whether each hit the cap.
    """
    hyps = _greedy(
        model, encoder_hidden, prompts, eot, max_new_tokens, options, cache, first_tokens, False
    )
    return [h.tokens for h in hyps], [h.hit_cap for h in hyps]


@torch.no_grad()
def greedy_search(
    model,
    encoder_hidden: torch.Tensor,
    prompts: torch.Tensor,
    eot: int,
    max_new_tokens: int,
    options: DecodeOptions = DecodeOptions(),
) -> list[Hypothesis]:
    """:func:`greedy_decode` that also measures each sequence's summed log-probability (one
    log-softmax normalizer a step) and, with ``options.no_speech``, its no-speech probability
    (one more row projected at the first step), as :class:`Hypothesis` in input order."""
    return _greedy(model, encoder_hidden, prompts, eot, max_new_tokens, options, None, None, True)


def _greedy(
    model, encoder_hidden, prompts, eot, max_new_tokens, options, cache, first_tokens, measure
) -> list[Hypothesis]:
    """:func:`greedy_decode`'s loop; ``measure``: :func:`greedy_search`'s sums (else 0.0)."""
    if (cache is None) != (first_tokens is None):
        raise ValueError("give both cache and first_tokens, or neither")
    device = prompts.device
    b, p = prompts.shape
    cap = min(max_new_tokens, model.config.max_target_positions - p)
    rules = options.rules
    every = check_interval(device) if options.check_every is None else options.check_every
    if cap > 0:
        cache = new_cache(model, p + cap) if cache is None else static_copy(model, cache, p + cap)
    vocab = model.proj_out.out_features
    mask = PickMask(Suppression.of(model, device), eot, b, vocab)
    sums = torch.zeros(b, device=device) if measure else None
    gate = options.no_speech if measure else None
    no_speech = None
    # (cap, batch): each step's picks are one contiguous row, read as the next step's input
    out = torch.full((max(cap, 0), b), eot, dtype=torch.long, device=device)
    captured, capture = None, options.capture and rules is None
    tokens, n = prompts, 0
    # several rows on the CPU: the decoder's layers multiply by packed weights
    with packed_linears(model.model.decoder, b):
        for t in range(cap):
            if capture and t == 2:  # the (batch, 1) step before was the warm-up a capture needs
                captured, capture = (
                    capture_step(model, tokens, encoder_hidden, cache, mask.values, sums),
                    False,
                )
            if t == 0 and first_tokens is not None:
                out[0] = first_tokens
            elif t == 0 and gate is not None:
                # the no-speech token is read at <|startoftranscript|>, a prompt position the
                # first pass computes anyway: one more row projected
                states = decoder_states(model, tokens, encoder_hidden, cache)
                at_sot = states[torch.arange(b, device=device), gate.positions(prompts)]
                no_speech = gate.probs(vocab_logits(model, at_sot))
                out[0] = greedy_pick(model, states[:, -1], mask.values, rules, out[:0].T, sums)
            elif captured is not None:
                out[t] = captured(tokens)
            else:
                out[t] = greedy_step(
                    model, tokens, encoder_hidden, cache, mask.values, rules, out[:t].T, sums
                )
            # A sequence that ended keeps its row; what it computes after EOT is thrown away.
            mask.update(out[t])
            n = t + 1
            if n % every == 0 and bool(mask.ended.all()):
                break
            tokens = out[t][:, None]
    rows = out[:n].T.tolist()
    scores = [0.0] * b if sums is None else sums.tolist()
    probs = [None] * b if no_speech is None else no_speech.tolist()
    hyps = []
    for row, score, prob in zip(rows, scores, probs, strict=True):
        k = row.index(eot) if eot in row else len(row)
        hyps.append(Hypothesis(row[:k], score, eot not in row, prob))
    return hyps


@dataclass(frozen=True)
class TimestampVocab:
    """Where a vocabulary keeps Whisper's timestamp tokens: ``<|0.00|>`` is ``begin``, and
    ``begin + k`` stands for ``k * 0.02`` s into the window, for ``k < count``. Ids at or past
    ``begin + count`` (an extended vocabulary's new tokens) are text again."""

    begin: int
    count: int
    eot: int
    no_timestamps: int
    specials: int | None = None
    """The first special token after the text tokens (``<|startoftranscript|>``), when it is
    not ``eot + 1`` (Whisper's layout): a BPE asrforge trains has EOT first (id 0), its text
    tokens, then the specials and timestamps."""

    @property
    def end(self) -> int:
        return self.begin + self.count

    @property
    def first_special(self) -> int:
        return self.eot + 1 if self.specials is None else self.specials

    def is_timestamp(self, token: int) -> bool:
        return self.begin <= token < self.end

    def is_text(self, token: int) -> bool:
        return token != self.eot and not self.first_special <= token < self.end

    def text_spans(self, width: int) -> list[slice]:
        """The column ranges of the text tokens (:meth:`is_text`) in logits ``width`` wide."""
        spans, at = [], 0
        for start, stop in sorted([(self.eot, self.eot + 1), (self.first_special, self.end)]):
            if at < start:
                spans.append(slice(at, start))
            at = max(at, stop)
        if at < width:
            spans.append(slice(at, width))
        return spans

    def non_timestamp_spans(self, width: int) -> list[slice]:
        """The column ranges of every token but a timestamp in logits ``width`` wide."""
        return [s for s in (slice(0, self.begin), slice(self.end, width)) if s.start < s.stop]

    @classmethod
    def of(cls, tokenizer, vocab_size: int, window_seconds: float) -> TimestampVocab | None:
        """The timestamp tokens of ``tokenizer``, or None when it has none or too few to cover
        ``window_seconds`` (a from-scratch BPE has no timestamps: such a model cannot drive
        long-form decoding by timestamps)."""

        def tid(token: str) -> int | None:
            i = tokenizer.convert_tokens_to_ids(token)
            # Whisper's unknown token is <|endoftext|> itself
            unknown = i == tokenizer.unk_token_id and token != "<|endoftext|>"
            return None if i is None or unknown else int(i)

        no_ts, first, eot = tid("<|notimestamps|>"), tid("<|0.00|>"), tid("<|endoftext|>")
        sot = tid("<|startoftranscript|>")
        count = round(window_seconds / TIME_PRECISION) + 1
        last = tid(f"<|{(count - 1) * TIME_PRECISION:.2f}|>")
        if None in (no_ts, first, eot, last) or last != first + count - 1:
            return None
        if first + count > vocab_size:
            return None
        specials = None if sot is None or sot == eot + 1 else sot
        return cls(begin=first, count=count, eot=eot, no_timestamps=no_ts, specials=specials)


class TimestampRules:
    """openai-whisper's ``ApplyTimestampRules`` for greedy decoding in timestamp mode (a prompt
    without ``<|notimestamps|>``), as :attr:`DecodeOptions.rules`:

    * ``<|notimestamps|>`` and the other special tokens between EOT and the timestamps are
      never picked;
    * the first token is a timestamp, at most ``max_initial_timestamp`` seconds;
    * timestamps come in pairs (a segment's end, then the next one's start), except right
      before EOT: after a lone timestamp comes another timestamp or EOT, after a pair text;
    * timestamps never decrease, and a segment's end is later than its start;
    * when the probability mass of all timestamps exceeds that of the likeliest other token,
      a timestamp is picked.

    Args:
        vocab: the timestamp tokens.
        max_initial_timestamp: seconds; None: no limit.
    """

    def __init__(self, vocab: TimestampVocab, max_initial_timestamp: float | None = 1.0):
        self.vocab = vocab
        self.max_initial = (
            None if max_initial_timestamp is None else round(max_initial_timestamp / TIME_PRECISION)
        )
        self._offsets: dict[torch.device, torch.Tensor] = {}

    def __call__(self, logits: torch.Tensor, generated: torch.Tensor) -> torch.Tensor:
        """(rows, vocab) logits, (rows, t) generated ids -> masked float logits. Every rule is
        a tensor operation over all rows, so applying them reads nothing back to the host; each
        writes only the columns it rules on, so a step passes over the vocabulary a few times."""
        v = self.vocab
        logits = logits.float().clone()
        logits[:, v.first_special : v.begin] = float("-inf")  # sot, languages, notimestamps...
        if generated.shape[1] == 0:
            logits[:, : v.begin] = float("-inf")
            logits[:, v.end :] = float("-inf")
            if self.max_initial is not None:
                logits[:, v.begin + self.max_initial + 1 :] = float("-inf")
        else:
            self._pairs_and_order(logits, generated)
        # The softmax's normalizer is common to both sides, so logits compare as log-probs do.
        stamps = logits[:, v.begin : v.end].logsumexp(-1)
        others = logits[:, : v.begin].amax(-1)
        if v.end < logits.shape[-1]:
            others = torch.maximum(others, logits[:, v.end :].amax(-1))
        self._block(logits, stamps > others, v.non_timestamp_spans(logits.shape[-1]))
        return logits

    @staticmethod
    def _block(logits: torch.Tensor, rows: torch.Tensor, columns: list[slice]) -> None:
        """Set ``columns`` of the (rows,) ``rows`` marked to -inf, in place."""
        for span in columns:
            logits[:, span].masked_fill_(rows[:, None], float("-inf"))

    def _pairs_and_order(self, logits: torch.Tensor, generated: torch.Tensor) -> None:
        """The pairing and ordering rules for rows that generated at least one token."""
        v = self.vocab
        stamps = logits[:, v.begin : v.end]
        is_stamp = (generated >= v.begin) & (generated < v.end)
        last = is_stamp[:, -1]
        penultimate = is_stamp[:, -2] if generated.shape[1] >= 2 else torch.ones_like(last)
        # After a pair of timestamps (or the opening one) text must follow.
        stamps.masked_fill_((last & penultimate)[:, None], float("-inf"))
        # After a segment's end comes the next segment's start or EOT.
        self._block(logits, last & ~penultimate, v.text_spans(logits.shape[-1]))
        # 1-based position of each row's last timestamp, 0 when it has none
        steps = torch.arange(1, generated.shape[1] + 1, device=generated.device)
        at = (is_stamp * steps).amax(-1)
        latest = generated.gather(1, (at - 1).clamp(min=0)[:, None]).squeeze(1)
        # never backwards; a segment's end must be later than its start (no endless loop)
        floor = torch.where(last & ~penultimate, latest, latest + 1) - v.begin
        below = (at > 0)[:, None] & (self._offsets_on(logits.device) < floor[:, None])
        stamps.masked_fill_(below, float("-inf"))

    def _offsets_on(self, device: torch.device) -> torch.Tensor:
        """(count,) each timestamp's offset from ``<|0.00|>``, built once per device."""
        if device not in self._offsets:
            self._offsets[device] = torch.arange(self.vocab.count, device=device)
        return self._offsets[device]
