"""Beam search with a KV cache, batched over utterances, as openai-whisper's
``BeamSearchDecoder`` and ``MaximumLikelihoodRanker`` define it (written anew for transformers'
Whisper): ``beam_size``, ``patience`` and ``length_penalty`` mean what they mean there.

How it works: docs/decoding.md,
"Beam search, and how it differs from transformers' (`model/beam.py`)".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from asrforge.model.beam_attention import shared_cross_attention
from asrforge.model.decoding import (
    DecodeOptions,
    Hypothesis,
    Suppression,
    decoder_states,
)
from asrforge.model.projection import vocab_logits


def length_normalized(sum_logprob: float, length: int, length_penalty: float | None) -> float:
    """openai-whisper's ranking score: ``sum_logprob / length`` when ``length_penalty`` is None,
    else ``sum_logprob / ((5 + length) / 6) ** length_penalty`` (Google NMT's penalty;
    0 ranks by the plain sum). ``length``: tokens without EOT."""
    if length_penalty is None:
        return sum_logprob / max(length, 1)
    return sum_logprob / ((5 + length) / 6) ** length_penalty


@torch.no_grad()
def beam_search(
    model,
    encoder_hidden: torch.Tensor,
    prompts: torch.Tensor,
    eot: int,
    max_new_tokens: int,
    options: DecodeOptions = DecodeOptions(),
) -> list[Hypothesis]:
    """The best hypothesis of each utterance by beam search with a KV cache.

    The prompt is decoded once per utterance and its self-attention cache repeated per beam;
    the beams share their utterance's one row of the cross-attention cache
    (:func:`~asrforge.model.beam_attention.shared_cross_attention`). Each step the
    self-attention cache is reordered to the surviving beams' parents, and an
    utterance that is done leaves the batch (its rows are dropped from both caches). The host
    reads the device once per step: the candidates that ended, with their parents and scores,
    and the beams' tokens so far, in one transfer (plus, with ``fusion``, the surviving beams'
    parents and tokens in the same one).

    Args:
        encoder_hidden: (batch, frames, d_model) encoder output.
        prompts: (batch, prompt_len) forced prefix ids.
        max_new_tokens: cap on generated tokens per sequence (the decoder's limit applies too).
        options: read here: ``beam_size`` (1 is greedy decoding), ``patience``,
            ``length_penalty``, ``rules`` (rows are beams here) and ``fusion`` (fused at word
            boundaries: beams are ranked by the fused score; each hypothesis's ``sum_logprob``
            stays the model's own).

    Returns:
        One :class:`Hypothesis` per utterance, in input order.
    """
    with shared_cross_attention(model) as shared:
        return _search(model, encoder_hidden, prompts, eot, max_new_tokens, options, shared)


def _search(
    model,
    encoder_hidden: torch.Tensor,
    prompts: torch.Tensor,
    eot: int,
    max_new_tokens: int,
    options: DecodeOptions,
    shared: bool,
) -> list[Hypothesis]:
    """:func:`beam_search` once its beams attend to one cross-attention row per utterance
    (``shared``) or to a copy each."""
    # transformers loads when a decode runs, not when asrforge.model is imported
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache

    beam_size, patience, rules, fusion = (
        options.beam_size,
        options.patience,
        options.rules,
        options.fusion,
    )
    if beam_size < 1:
        raise ValueError(f"beam_size: must be >= 1, got {beam_size}")
    if patience <= 0:
        raise ValueError(f"patience: must be > 0, got {patience}")
    k = beam_size
    max_candidates = max(1, round(k * patience))
    device = prompts.device
    n_audio, p = prompts.shape
    cap = min(max_new_tokens, model.config.max_target_positions - p)
    if cap <= 0:  # the prompt fills the decoder's context
        return [Hypothesis([], 0.0, True) for _ in range(n_audio)]
    suppression = Suppression.of(model, device)
    # Every step rewrites the whole self-attention cache in the beams' new order, so a
    # pre-allocated one would save no copy: transformers' DynamicCache fits beam search.
    cache = EncoderDecoderCache(DynamicCache(), DynamicCache())

    # per utterance: (tokens, ranking sum, the model's own sum) of each finished hypothesis
    finished: list[list[tuple[list[int], float, float]]] = [[] for _ in range(n_audio)]
    audios = list(range(n_audio))  # the utterance of each live group of k rows
    generated = torch.zeros((n_audio, 0), dtype=torch.long, device=device)  # (rows, t)
    sums = torch.zeros(n_audio, device=device)  # (rows,) summed log-probs (+ LM bonuses)
    am_sums = sums  # (rows,) the model's own summed log-probs (the same without an LM)
    states = [fusion.start(row) for row in prompts.tolist()] if fusion is not None else None
    vocab = model.config.vocab_size
    if fusion is not None:
        starts = fusion.starts_word(vocab, device)
        word_starts = starts.bool().tolist()
    tokens, enc = prompts, encoder_hidden
    gate, no_speech = options.no_speech, None
    for t in range(cap):
        hidden = decoder_states(model, tokens, enc, cache)
        if t == 0 and gate is not None:
            # read at <|startoftranscript|>, one prompt row per utterance: one row projected
            at_sot = hidden[torch.arange(n_audio, device=device), gate.positions(prompts)]
            no_speech = gate.probs(vocab_logits(model, at_sot))
        logits = suppression.apply(vocab_logits(model, hidden[:, -1]).float(), t)
        if rules is not None:  # after the suppression, as in greedy decoding
            logits = rules(logits, generated)
        logprobs = torch.log_softmax(logits, dim=-1)
        # at t == 0 every utterance has one row (the prompt), later k rows (its beams)
        per_audio = 1 if t == 0 else k
        cand_am = am_sums[:, None] + logprobs
        cand = cand_am if fusion is None else sums[:, None] + logprobs
        if fusion is not None:
            boundary, end = fusion.bonuses(states)
            cand = cand + torch.tensor(boundary, device=device)[:, None] * starts
            cand[:, eot] += torch.tensor(end, device=device)
        cand = cand.reshape(len(audios), per_audio * vocab)
        # k continuing candidates are always among the best 2k: at most one EOT per beam
        n_top = min(2 * k, per_audio * vocab)
        top_scores, top_idx = cand.topk(n_top, dim=-1)
        top_rows = top_idx // vocab + torch.arange(len(audios), device=device)[:, None] * per_audio
        top_tokens = top_idx % vocab
        top_am = top_scores if fusion is None else cand_am.reshape(cand.shape).gather(1, top_idx)
        is_eot = top_tokens == eot
        # a candidate's rank among the continuing ones (1-based) / how many continue before it
        rank = (~is_eot).cumsum(-1)
        keep = ~is_eot & (rank <= k)
        # EOT before the k-th continuing candidate (and not a forbidden one)
        ends = is_eot & (rank < k) & (top_scores > float("-inf"))
        # the k continuing beams of each utterance, in score order
        order = torch.where(keep, rank, n_top + 1).argsort(dim=-1, stable=True)[:, :k]
        src = top_rows.gather(1, order).reshape(-1)
        nxt = top_tokens.gather(1, order).reshape(-1)
        new_sums = top_scores.gather(1, order).reshape(-1)
        am_sums = new_sums if fusion is None else top_am.gather(1, order).reshape(-1)
        # The step's one read: what the host's bookkeeping needs, in one transfer.
        host = _Step.read(ends, top_rows, top_scores, top_am, generated, src, nxt, fusion)
        _collect_finished(finished, audios, host, max_candidates)
        if states is not None:
            states = [
                fusion.advance(states[r], tok, word_starts[tok])
                for r, tok in zip(host.src, host.nxt, strict=True)
            ]
        sums = new_sums
        generated = torch.cat([generated[src], nxt[:, None]], dim=1)
        # One prompt row per utterance becomes its k beams' rows at t == 0; later beams move
        # within their utterance. Shared, the cross-attention cache keeps one row per
        # utterance; else each beam gets a copy of its utterance's row.
        cache.self_attention_cache.reorder_cache(src)
        if t == 0 and not shared:
            cache.cross_attention_cache.reorder_cache(src)
            enc = enc[src]
        done = [len(finished[a]) >= max_candidates for a in audios]
        if all(done):
            break
        if any(done):
            live = [i for i, d in enumerate(done) if not d]
            rows = torch.tensor([i * k + j for i in live for j in range(k)], device=device)
            audios = [audios[i] for i in live]
            generated, sums, nxt = generated[rows], sums[rows], nxt[rows]
            am_sums = am_sums[rows]
            cross = torch.tensor(live, device=device) if shared else rows
            if states is not None:
                states = [states[i * k + j] for i in live for j in range(k)]
            enc = enc[cross]
            cache.self_attention_cache.batch_select_indices(rows)
            cache.cross_attention_cache.batch_select_indices(cross)
        tokens = nxt[:, None]
    else:
        # A capped beam's last word is complete too, so it pays the LM for it.
        if fusion is not None:
            sums = sums + torch.tensor(fusion.bonuses(states)[0], device=device)
        _add_unfinished(finished, audios, generated, sums, am_sums, k)
    probs = [None] * n_audio if no_speech is None else no_speech.tolist()
    return [
        dataclasses.replace(_best(f, eot, options.length_penalty), no_speech_prob=prob)
        for f, prob in zip(finished, probs, strict=True)
    ]


@dataclass(frozen=True)
class _Step:
    """One beam step's values on the host: per live utterance, the candidates that ended
    (``ends``: (utterance, candidate) pairs), each candidate's beam row and (ranking, model's
    own) scores, the beams' tokens before the step; with an LM, the surviving beams' parents
    and tokens."""

    ends: list[tuple[int, int]]
    rows: list[list[float]]
    scores: list[list[float]]
    am: list[list[float]]
    generated: list[list[int]]
    src: list[int]
    nxt: list[int]

    @classmethod
    def read(cls, ends, top_rows, top_scores, top_am, generated, src, nxt, fusion) -> _Step:
        """Everything in one float64 tensor and one ``tolist`` (token ids and rows are exact
        in float64, float32 scores too). ``ends``, ``top_*``: (utterances, candidates);
        ``generated``: (beams, t); ``src``, ``nxt``: (beams,)."""
        parts = [ends, top_rows, top_scores, top_am, generated]
        if fusion is not None:
            parts += [src, nxt]
        flat = torch.cat([x.reshape(-1).double() for x in parts]).tolist()
        n, m = ends.shape
        beams, t = generated.shape
        grids = [_grid(flat[g * n * m : (g + 1) * n * m], n, m) for g in range(4)]
        at = 4 * n * m
        gen = _grid([int(x) for x in flat[at : at + beams * t]], beams, t)
        parents = [int(x) for x in flat[at + beams * t :]]
        return cls(
            ends=[(i, j) for i in range(n) for j in range(m) if grids[0][i][j]],
            rows=grids[1],
            scores=grids[2],
            am=grids[3],
            generated=gen,
            src=parents[: len(parents) // 2],
            nxt=parents[len(parents) // 2 :],
        )


def _grid(values: list, height: int, width: int) -> list[list]:
    """``values`` (row-major) as ``height`` lists of ``width``."""
    return [values[r * width : (r + 1) * width] for r in range(height)]


def _collect_finished(finished, audios, host: _Step, max_candidates):
    """Append each utterance's newly finished hypotheses (in score order) until it has
    ``max_candidates``."""
    for i, j in host.ends:
        pool = finished[audios[i]]
        if len(pool) < max_candidates:
            row = int(host.rows[i][j])
            pool.append((list(host.generated[row]), host.scores[i][j], host.am[i][j]))


def _add_unfinished(finished, audios, generated, sums, am_sums, k):
    """At the cap: fill each live utterance's pool up to ``k`` with its best running beams."""
    generated, sums, am_sums = generated.tolist(), sums.tolist(), am_sums.tolist()
    for i, a in enumerate(audios):
        pool = finished[a]
        beams = range(i * k, (i + 1) * k)
        for row in sorted(beams, key=lambda r: -sums[r]):
            if len(pool) >= k:
                break
            pool.append((generated[row] + [None], sums[row], am_sums[row]))


def _best(pool, eot, length_penalty) -> Hypothesis:
    """The pool's best by :func:`length_normalized` of its ranking sum (a trailing None marks a
    capped beam); its ``sum_logprob`` is the model's own."""

    def score(item):
        seq, s, _ = item
        n = len(seq) - 1 if seq and seq[-1] is None else len(seq)
        return length_normalized(s, n, length_penalty)

    seq, _, am = max(pool, key=score)
    capped = bool(seq) and seq[-1] is None
    return Hypothesis(
        tokens=[int(x) for x in (seq[:-1] if capped else seq)], sum_logprob=am, hit_cap=capped
    )


def beam_decode(
    model,
    encoder_hidden: torch.Tensor,
    prompts: torch.Tensor,
    eot: int,
    max_new_tokens: int,
    options: DecodeOptions = DecodeOptions(),
) -> tuple[list[list[int]], list[bool]]:
    """:func:`beam_search` in :func:`~asrforge.model.decoding.greedy_decode`'s return shape:
    the generated ids of each sequence (no prompt, no EOT) and whether each hit the cap."""
    hyps = beam_search(model, encoder_hidden, prompts, eot, max_new_tokens, options)
    return [h.tokens for h in hyps], [h.hit_cap for h in hyps]
