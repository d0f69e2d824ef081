"""Shallow fusion of a word n-gram LM into beam search, at word boundaries.

How it works: docs/decoding.md, "Shallow fusion at word boundaries (`lm/fusion.py`)".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from asrforge.lm.ngram import BOS, EOS, NGramLM
from asrforge.text import normalize

LN10 = math.log(10.0)


@dataclass(frozen=True)
class WordState:
    """A hypothesis's LM state: its language (None: not fused), the LM context (the last
    ``order - 1`` words, ``<s>`` first at the start) and the tokens of the word being spelled."""

    language: str | None
    context: tuple[str, ...]
    pending: tuple[int, ...] = ()


class ShallowFusion:
    """Word-level LM fusion for :func:`asrforge.model.beam.beam_search`.

    Args:
        lm: the n-gram model.
        tokenizer: the model's tokenizer (to spell tokens and find word starts).
        eot: the end-of-text id.
        alpha: LM weight (natural-log LM probabilities times ``alpha``).
        beta: bonus per word.
        language_of: ``prompt ids -> language code``: the language each row is decoded in.
    """

    def __init__(self, lm: NGramLM, tokenizer, eot: int, alpha: float, beta: float, language_of):
        self.lm, self.tokenizer, self.eot = lm, tokenizer, eot
        self.alpha, self.beta = float(alpha), float(beta)
        self.language_of = language_of
        self.languages = set(lm.meta.get("languages") or [])
        self._starts: dict[int, torch.Tensor] = {}
        self._special: set[int] = set()
        self._words: dict[tuple[tuple[int, ...], str], list[str]] = {}
        self._scores: dict[tuple, tuple[float, tuple[str, ...]]] = {}

    def starts_word(self, vocab: int, device) -> torch.Tensor:
        """(vocab,) float: 1 where a token starts a new word (a leading space, or a special or
        timestamp token ``<|...|>``), else 0; EOT 0 (its bonus is :meth:`bonuses`' second)."""
        if vocab not in self._starts:
            pieces = self.tokenizer.convert_ids_to_tokens(list(range(vocab)))
            self._special = {
                i for i, p in enumerate(pieces) if p is not None and p.startswith("<|")
                and p.endswith("|>")
            }  # fmt: skip
            flags = torch.tensor(
                [p is not None and p.startswith(("Ġ", "▁", " ")) for p in pieces], dtype=torch.float
            )
            flags[sorted(self._special)] = 1.0
            flags[self.eot] = 0.0
            self._starts[vocab] = flags
        return self._starts[vocab].to(device)

    def start(self, prompt: list[int]) -> WordState:
        language = self.language_of(prompt)
        fused = language if language in self.languages else None
        return WordState(fused, (BOS,))

    def _complete(self, state: WordState) -> tuple[float, tuple[str, ...]]:
        """``(bonus, context)`` of completing the pending word: ``alpha * ln p + beta`` per
        word it normalizes to, and the context after them."""
        key = (state.language, state.context, state.pending)
        if key not in self._scores:
            words = self._normalized(state.pending, state.language)
            context, total = state.context, 0.0
            for w in words:
                total += self.alpha * self.lm.log10_prob(w, context) * LN10 + self.beta
                context = (*context, w)[-max(self.lm.order - 1, 1) :]
            self._scores[key] = (total, context)
        return self._scores[key]

    def _normalized(self, tokens: tuple[int, ...], language: str) -> list[str]:
        key = (tokens, language)
        if key not in self._words:
            text = self.tokenizer.decode(list(tokens), skip_special_tokens=True) if tokens else ""
            self._words[key] = normalize(text, language).split() if text.strip() else []
        return self._words[key]

    def bonuses(self, states: list[WordState]) -> tuple[list[float], list[float]]:
        """Per row: the bonus of a word-starting token (the pending word completed) and of EOT
        (that plus ``alpha * ln p(</s> | ...)``)."""
        boundary, end = [], []
        for s in states:
            if s.language is None:
                boundary.append(0.0)
                end.append(0.0)
                continue
            bonus, context = self._complete(s)
            boundary.append(bonus)
            end.append(bonus + self.alpha * self.lm.log10_prob(EOS, context) * LN10)
        return boundary, end

    def advance(self, state: WordState, token: int, starts_word: bool) -> WordState:
        """The state after ``token`` (EOT's is never used)."""
        if state.language is None:
            return state
        if not starts_word:
            return WordState(state.language, state.context, (*state.pending, token))
        _, context = self._complete(state)
        return WordState(state.language, context, () if token in self._special else (token,))
