"""The decoders on a pre-allocated KV cache, with finished rows kept and masked, pick the tokens
transformers' ``generate`` picks; the timestamp rules, now tensor operations over all rows,
forbid what openai-whisper's per-row rules forbid."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import GenerationMixin, WhisperConfig, WhisperForConditionalGeneration
from transformers.cache_utils import DynamicCache, EncoderDecoderCache
from transformers.modeling_outputs import BaseModelOutput

from asrforge.model.beam import beam_search
from asrforge.model.decoding import (
    CHECK_EVERY,
    DecodeOptions,
    Suppression,
    TimestampRules,
    TimestampVocab,
    decoder_states,
    greedy_decode,
)

EOT = 2


def _model(seed: int = 0, eot_bias: float = 0.5) -> WhisperForConditionalGeneration:
    """A tiny random Whisper whose EOT is likelier (so rows end at different lengths)."""
    torch.manual_seed(seed)
    cfg = WhisperConfig(
        d_model=32, encoder_layers=1, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=40,
        pad_token_id=EOT, bos_token_id=1, eos_token_id=EOT, decoder_start_token_id=1,
        max_source_positions=20, max_target_positions=48, num_mel_bins=8,
        suppress_tokens=None, begin_suppress_tokens=None,
    )  # fmt: skip
    model = WhisperForConditionalGeneration(cfg).eval()
    weight = model.proj_out.weight.detach().clone()
    weight[EOT] += eot_bias * weight.mean(0) / weight.mean(0).norm()
    model.proj_out.weight = torch.nn.Parameter(weight)
    model.generation_config.suppress_tokens = [5, 7]
    model.generation_config.begin_suppress_tokens = [EOT, 11]
    return model


def _inputs(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    enc = torch.randn(n, 20, 32, generator=g)
    prompts = torch.tensor([[1, 3 + i % 5, 9 + i % 3] for i in range(n)])
    return enc, prompts


def _generate(model, enc, prompts, max_new_tokens: int) -> list[list[int]]:
    out = GenerationMixin.generate(
        model, encoder_outputs=BaseModelOutput(last_hidden_state=enc), decoder_input_ids=prompts,
        num_beams=1, do_sample=False, max_new_tokens=max_new_tokens,
    )  # fmt: skip
    seqs = []
    for row in out[:, prompts.shape[1] :].tolist():
        seqs.append(row[: row.index(EOT)] if EOT in row else row)
    return seqs


@pytest.mark.parametrize("check_every", [1, 5, CHECK_EVERY])
def test_greedy_picks_what_generate_picks_as_rows_end_at_different_lengths(check_every):
    lengths, n_capped = set(), 0
    for seed in range(3):
        model = _model(seed)
        enc, prompts = _inputs(8, seed)
        ours, capped = greedy_decode(
            model, enc, prompts, EOT, 24, DecodeOptions(check_every=check_every)
        )
        assert ours == _generate(model, enc, prompts, 24), seed
        lengths |= {len(s) for s in ours}
        n_capped += sum(capped)
        assert capped == [len(s) == 24 for s in ours]
    assert len(lengths) >= 4 and n_capped < 24  # rows end at several lengths, most before the cap


def test_greedy_from_a_teacher_forced_cache_equals_greedy_from_the_prompt():
    """Evaluation's path: the loss pass's cache, cropped to the prompt, starts the decode."""
    model = _model(1)
    enc, prompts = _inputs(6, 1)
    labels = torch.randint(3, 40, (6, 5))
    cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
    with torch.no_grad():
        h = decoder_states(model, torch.cat([prompts, labels], 1), enc, cache)
        first = Suppression.of(model, "cpu").apply(model.proj_out(h[:, prompts.shape[1] - 1]), 0)
    cache.crop(-labels.shape[1])
    from_cache = greedy_decode(
        model, enc, prompts, EOT, 20, cache=cache, first_tokens=first.argmax(-1)
    )
    assert from_cache == greedy_decode(model, enc, prompts, EOT, 20)


def test_beam_search_keeps_its_hypotheses_as_rows_and_utterances_end():
    """Beam 1 is greedy decoding (whose finished rows stay in the batch); beam 3, reading the
    device once per step, equals ``generate``'s under the convention both share (plain sum,
    stop at k finished) as utterances end at different steps."""
    model = _model(2, eot_bias=0.15)
    enc, prompts = _inputs(6, 2)
    greedy, _ = greedy_decode(model, enc, prompts, EOT, 20)
    assert [
        h.tokens for h in beam_search(model, enc, prompts, EOT, 20, DecodeOptions(beam_size=1))
    ] == greedy
    model.generation_config.suppress_tokens = None
    model.generation_config.begin_suppress_tokens = [EOT]
    ours = beam_search(model, enc, prompts, EOT, 20, DecodeOptions(beam_size=3, length_penalty=0.0))
    ref = GenerationMixin.generate(
        model, encoder_outputs=BaseModelOutput(last_hidden_state=enc), decoder_input_ids=prompts,
        num_beams=3, early_stopping=True, length_penalty=0.0, max_new_tokens=20,
        do_sample=False, num_return_sequences=1,
    )  # fmt: skip
    for i, hyp in enumerate(ours):
        want = ref[i, prompts.shape[1] :].tolist()
        assert hyp.tokens == (want[: want.index(EOT)] if EOT in want else want), i
    assert len({len(h.tokens) for h in ours}) >= 2


# A toy timestamp vocabulary: text 0-9, EOT 10, specials 11-14, timestamps 15-24, text 25-26.
SMALL = TimestampVocab(begin=15, count=10, eot=10, no_timestamps=14)
V = 27


def _per_row_reference(logits: torch.Tensor, seq: list[int]) -> torch.Tensor:
    """openai-whisper's pairing and ordering rules for one row, written per token as it does."""
    v, row = SMALL, logits.clone()
    row[v.first_special : v.begin] = float("-inf")
    if not seq:
        return row
    text = torch.tensor([v.is_text(i) for i in range(V)])
    last = v.is_timestamp(seq[-1])
    penultimate = len(seq) < 2 or v.is_timestamp(seq[-2])
    if last and penultimate:
        row[v.begin : v.end] = float("-inf")
    elif last:
        row[text] = float("-inf")
    stamps = [t for t in seq if v.is_timestamp(t)]
    if stamps:
        floor = stamps[-1] if last and not penultimate else stamps[-1] + 1
        row[v.begin : floor] = float("-inf")
    return row


@pytest.mark.fast
def test_timestamp_rules_over_all_rows_forbid_what_the_per_row_rules_forbid():
    rng = random.Random(0)
    rules = TimestampRules(SMALL, max_initial_timestamp=None)
    # the timestamp-mass rule off: text clearly likelier than all timestamps together
    logits = torch.zeros(1, V)
    logits[0, [*range(10), 10, 25, 26]] = 8.0
    for t in range(1, 9):
        seqs = [[rng.choice(range(V)) for _ in range(t)] for _ in range(64)]
        got = rules(logits.expand(64, V), torch.tensor(seqs))
        for seq, row in zip(seqs, got, strict=True):
            assert torch.equal(row, _per_row_reference(logits[0], seq)), seq


@pytest.mark.fast
def test_a_suppressed_token_does_not_outweigh_the_timestamps_mass(monkeypatch):
    """openai-whisper suppresses before its timestamp rules: the likeliest text the timestamps'
    mass is weighed against is one that may be picked."""
    import asrforge.model.decoding as decoding

    monkeypatch.setattr(decoding, "vocab_logits", lambda model, h: h.clone())
    logits = torch.full((1, V), float("-inf"))
    logits[0, 3], logits[0, 4] = 5.0, 1.0  # 3 is suppressed
    logits[0, SMALL.begin : SMALL.end] = 0.5  # mass log(10) + 0.5 = 2.8: above 1, below 5
    mask = torch.zeros(1, V)
    mask[0, 3] = float("-inf")
    generated = torch.tensor([[SMALL.begin, 2]])  # a segment's start, then text
    rules = TimestampRules(SMALL, max_initial_timestamp=None)
    picked = decoding.greedy_pick(None, logits, mask, rules, generated)
    assert SMALL.is_timestamp(int(picked[0]))
