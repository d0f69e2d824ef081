"""Beam search (asrforge.model.beam): beam 1 is greedy decoding; beam k picks what
transformers' ``generate(num_beams=k)`` picks where the two conventions agree; suppression."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationMixin, WhisperConfig, WhisperForConditionalGeneration
from transformers.modeling_outputs import BaseModelOutput

from asrforge.model.beam import beam_decode, beam_search, length_normalized
from asrforge.model.decoding import DecodeOptions, greedy_decode

EOT = 2


def _model(seed: int = 0, eot_bias: float = 0.0) -> WhisperForConditionalGeneration:
    torch.manual_seed(seed)
    cfg = WhisperConfig(
        d_model=32,
        encoder_layers=1,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        vocab_size=40,
        pad_token_id=EOT,
        bos_token_id=1,
        eos_token_id=EOT,
        decoder_start_token_id=1,
        max_source_positions=20,
        max_target_positions=24,
        num_mel_bins=8,
        suppress_tokens=None,
        begin_suppress_tokens=None,
    )
    model = WhisperForConditionalGeneration(cfg).eval()
    if eot_bias:  # make EOT likelier (untied: the inputs stay as they are) so beams finish
        weight = model.proj_out.weight.detach().clone()
        weight[EOT] += eot_bias * weight.mean(0) / weight.mean(0).norm()
        model.proj_out.weight = torch.nn.Parameter(weight)
    return model


def _inputs(model, n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    enc = torch.randn(n, 20, 32, generator=g)
    prompts = torch.tensor([[1, 3 + i % 5, 9] for i in range(n)])
    return enc, prompts


def test_beam_size_one_equals_greedy():
    model = _model()
    model.generation_config.suppress_tokens = [5, 7]
    model.generation_config.begin_suppress_tokens = [EOT, 11]
    enc, prompts = _inputs(model, 6)
    greedy, greedy_cap = greedy_decode(model, enc, prompts, EOT, 20)
    beam, beam_cap = beam_decode(model, enc, prompts, EOT, 20, DecodeOptions(beam_size=1))
    assert beam == greedy
    assert beam_cap == greedy_cap


@pytest.mark.parametrize("k", [2, 5])
def test_beam_matches_generate_with_the_same_convention(k):
    """``length_penalty=0`` ranks by the summed log-probability in both; transformers'
    ``early_stopping=True`` stops at k finished hypotheses as openai-whisper's patience 1.
    EOT is suppressed at the first step only: that step has one row per utterance, so
    renormalizing (ours) or not (transformers) shifts all its candidates alike."""
    lengths, n_finished = set(), 0
    for seed in range(2):
        model = _model(seed, eot_bias=0.15)
        model.generation_config.begin_suppress_tokens = [EOT]
        enc, prompts = _inputs(model, 5, seed)
        ours = beam_search(
            model, enc, prompts, EOT, 16, DecodeOptions(beam_size=k, length_penalty=0.0)
        )
        ref = GenerationMixin.generate(
            model,
            encoder_outputs=BaseModelOutput(last_hidden_state=enc),
            decoder_input_ids=prompts,
            num_beams=k,
            early_stopping=True,
            length_penalty=0.0,
            max_new_tokens=16,
            do_sample=False,
            num_return_sequences=1,
        )
        for i, hyp in enumerate(ours):
            want = ref[i, prompts.shape[1] :].tolist()
            want = want[: want.index(EOT)] if EOT in want else want
            assert hyp.tokens == want, (seed, i)
            n_finished += not hyp.hit_cap
            lengths.add(len(hyp.tokens))
    assert n_finished >= 5 and len(lengths) >= 3  # EOT at several lengths, not only the cap


def test_beam_honours_suppression_and_finds_a_likelier_sequence_than_greedy():
    model = _model(3, eot_bias=0.15)
    model.generation_config.suppress_tokens = [4, 6, 8]
    model.generation_config.begin_suppress_tokens = [EOT, 10]
    enc, prompts = _inputs(model, 8, 3)
    hyps = beam_search(model, enc, prompts, EOT, 16, DecodeOptions(beam_size=4, length_penalty=0.0))
    greedy = beam_search(
        model, enc, prompts, EOT, 16, DecodeOptions(beam_size=1, length_penalty=0.0)
    )
    for h, g in zip(hyps, greedy, strict=True):
        assert not {4, 6, 8} & set(h.tokens)
        assert not h.tokens or h.tokens[0] not in (EOT, 10)
        assert h.sum_logprob >= g.sum_logprob - 1e-5
    assert any(h.tokens != g.tokens for h, g in zip(hyps, greedy, strict=True))


@pytest.mark.fast
def test_length_penalty_conventions():
    assert length_normalized(-6.0, 3, None) == -2.0
    assert length_normalized(-6.0, 3, 0.0) == -6.0
    assert length_normalized(-6.0, 7, 1.0) == pytest.approx(-3.0)


def test_patience_collects_more_finished_hypotheses_before_stopping():
    model = _model(1, eot_bias=1.0)
    enc, prompts = _inputs(model, 4, 2)
    for patience in (1.0, 2.0):
        hyps = beam_search(
            model, enc, prompts, EOT, 16, DecodeOptions(beam_size=3, patience=patience)
        )
        assert len(hyps) == 4
    with pytest.raises(ValueError, match="patience"):
        beam_search(model, enc, prompts, EOT, 16, DecodeOptions(beam_size=3, patience=0))


def test_beams_attend_to_one_copy_of_their_utterances_encoder_keys(monkeypatch):
    """Cross-attention after the first step: queries of k beams per live utterance, keys and
    values of one row per utterance; the model's own attention is back afterwards."""
    import asrforge.model.beam_attention as beam_attention

    seen = []
    grouped = beam_attention._grouped

    def spying(base):
        attention = grouped(base)

        def spy(module, query, key, value, attention_mask, **kwargs):
            if module is model.model.decoder.layers[0].encoder_attn:
                seen.append((query.shape[0], key.shape[0]))
            return attention(module, query, key, value, attention_mask, **kwargs)

        return spy

    monkeypatch.setattr(beam_attention, "_grouped", spying)
    model = _model(2, eot_bias=0.5)
    own = model.config._attn_implementation
    enc, prompts = _inputs(model, 4, 2)
    hyps = beam_search(model, enc, prompts, EOT, 16, DecodeOptions(beam_size=3))
    assert seen[0] == (4, 4)  # the prompt: one row per utterance
    assert all(q == 3 * kv for q, kv in seen[1:])
    assert {kv for _, kv in seen} == {4, 3, 1}  # done utterances left, their keys with them
    assert len({len(h.tokens) for h in hyps}) > 1
    assert model.config._attn_implementation == own


def test_searches_overlapping_on_one_model_keep_the_shared_attention_until_the_last_ends():
    """As two threads' searches on one bundle would: the first to end does not take the
    shared cross-attention from the other."""
    from asrforge.model.beam_attention import PREFIX, shared_cross_attention

    model = _model()
    own = model.config._attn_implementation
    first, second = shared_cross_attention(model), shared_cross_attention(model)
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert model.config._attn_implementation == PREFIX + own
    enc, prompts = _inputs(model, 2)
    beam_search(model, enc, prompts, EOT, 8, DecodeOptions(beam_size=3))  # a third, inside
    assert model.config._attn_implementation == PREFIX + own
    second.__exit__(None, None, None)
    assert model.config._attn_implementation == own


def test_an_implementation_the_beams_cannot_share_under_gives_each_beam_its_keys(monkeypatch):
    """Outside the implementations wrapped (flash attention looks its kernels up by the model's
    implementation name), each beam attends to a copy of its utterance's keys, as before."""
    import asrforge.model.beam_attention as beam_attention

    model = _model(2, eot_bias=0.5)
    enc, prompts = _inputs(model, 4, 2)
    options = DecodeOptions(beam_size=3)
    shared = beam_search(model, enc, prompts, EOT, 16, options)
    monkeypatch.setattr(beam_attention, "SHARING", ())
    copied = beam_search(model, enc, prompts, EOT, 16, options)
    assert [h.tokens for h in copied] == [h.tokens for h in shared]
    assert model.config._attn_implementation == "sdpa"
