"""The decoders read the device back rarely: greedy decoding once per ``CHECK_EVERY`` tokens on
an accelerator's cadence (plus the result), beam search once per step (plus the result). Each
read makes the host wait for the device, which on a GPU leaves it idle between small kernels.
Counted on the CPU: every read of a tensor's value, whoever makes it (transformers included)."""

from __future__ import annotations

import math
import sys

import torch
from transformers import WhisperConfig, WhisperForConditionalGeneration

from asrforge.model.beam import beam_search
from asrforge.model.decoding import (
    CHECK_EVERY,
    DecodeOptions,
    TimestampRules,
    TimestampVocab,
    greedy_decode,
)
from tests.test_host_reads import READS

EOT = 2
TOKENS = 40


def _model() -> WhisperForConditionalGeneration:
    torch.manual_seed(0)
    cfg = WhisperConfig(
        d_model=32, encoder_layers=1, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=60,
        pad_token_id=EOT, bos_token_id=1, eos_token_id=EOT, decoder_start_token_id=1,
        max_source_positions=20, max_target_positions=64, num_mel_bins=8,
        suppress_tokens=[5, 7], begin_suppress_tokens=[EOT],
    )  # fmt: skip
    model = WhisperForConditionalGeneration(cfg).eval()
    model.generation_config.suppress_tokens = [5, 7]
    model.generation_config.begin_suppress_tokens = [EOT]
    with torch.no_grad():  # EOT never wins, so every sequence runs to the cap
        model.proj_out.weight[EOT] = 0.0
    return model


def _count_reads(monkeypatch) -> list[str]:
    reads: list[str] = []
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            caller = sys._getframe(1).f_code
            reads.append(f"{_name} in {caller.co_filename.rsplit('/', 1)[-1]}:{caller.co_name}")
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return reads


def _inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, 20, 32, generator=g), torch.tensor([[1, 3, 9]] * 2 + [[1, 4, 8]] * 2)


def test_greedy_decoding_reads_the_device_once_per_check(monkeypatch):
    model = _model()
    enc, prompts = _inputs()
    vocab = TimestampVocab(begin=40, count=20, eot=EOT, no_timestamps=39, specials=35)
    for rules in (None, TimestampRules(vocab)):
        reads = _count_reads(monkeypatch)
        seqs, capped = greedy_decode(
            model, enc, prompts, EOT, TOKENS, DecodeOptions(rules=rules, check_every=CHECK_EVERY)
        )
        monkeypatch.undo()
        assert all(capped) and [len(s) for s in seqs] == [TOKENS] * 4
        # one "has every sequence ended?" per CHECK_EVERY tokens, and the result
        assert len(reads) <= math.ceil(TOKENS / CHECK_EVERY) + 1, reads
        assert len(reads) / TOKENS < 0.1


def test_beam_search_reads_the_device_once_per_step(monkeypatch):
    model = _model()
    enc, prompts = _inputs()
    reads = _count_reads(monkeypatch)
    hyps = beam_search(model, enc, prompts, EOT, TOKENS, DecodeOptions(beam_size=3))
    monkeypatch.undo()
    assert all(h.hit_cap for h in hyps)
    # one per step, and the running beams' tokens and sums at the cap
    assert len(reads) <= TOKENS + 3, reads
