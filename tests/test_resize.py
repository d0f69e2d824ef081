"""Vocabulary resize on load: explicit, reported, and nothing else may differ."""

from __future__ import annotations

import pytest
import torch

from asrforge.errors import CheckpointNotSupportedError
from asrforge.model.resize import VOCAB_TENSORS, adapt_state_dict

pytestmark = pytest.mark.fast

EMB, PROJ = VOCAB_TENSORS


def _state(vocab: int, d: int = 4) -> dict[str, torch.Tensor]:
    emb = torch.arange(vocab * d, dtype=torch.float32).reshape(vocab, d)
    return {
        EMB: emb,
        PROJ: emb,  # tied, as load_weights returns it
        "model.decoder.embed_positions.weight": torch.ones(8, d),
        "model.decoder.layer_norm.weight": torch.ones(d),
    }


def _shapes(vocab: int, d: int = 4) -> dict[str, torch.Size]:
    return {k: v.shape for k, v in _state(vocab, d).items()}


def test_grow_copies_shared_rows_and_reports_exactly_the_adapted(tmp_path):
    old = _state(10)
    new, report = adapt_state_dict(old, _shapes(13))
    assert new[EMB].shape == (13, 4)
    assert torch.equal(new[EMB][:10], old[EMB])
    torch.testing.assert_close(new[EMB][10:], old[EMB].mean(0).expand(3, 4))
    assert new[PROJ] is new[EMB]  # still tied
    assert [line.split(":")[0] for line in report] == [EMB, PROJ]
    assert "10 rows copied, 3 new rows (mean of the old rows)" in report[0]
    assert "tied to" in report[1]
    # Untouched tensors are the same objects.
    assert new["model.decoder.layer_norm.weight"] is old["model.decoder.layer_norm.weight"]


def test_shrink_reports_dropped_rows():
    new, report = adapt_state_dict(_state(10), _shapes(7))
    assert torch.equal(new[EMB], _state(10)[EMB][:7])
    assert "3 rows dropped (old ids 7..9)" in report[0]


def test_new_rows_from_initializer_or_model():
    calls = []

    def init(name, n, old):
        calls.append((name, n, tuple(old.shape)))
        return torch.full((n, old.shape[1]), -1.0)

    new, report = adapt_state_dict(_state(10), _shapes(12), init=init)
    assert calls == [(EMB, 2, (10, 4))]  # once for the tied pair
    assert (new[EMB][10:] == -1).all() and "from the initializer" in report[0]

    model = {k: torch.full(s, 7.0) for k, s in _shapes(12).items()}
    new, report = adapt_state_dict(_state(10), _shapes(12), model_state=model)
    assert (new[EMB][10:] == 7).all() and "kept from the model" in report[0]


def test_row_map_ports_shared_ids():
    old = _state(5)
    # target id 0 <- old 4, 1 <- old 0, 2 is new.
    new, report = adapt_state_dict(old, _shapes(3), row_map=[4, 0, -1])
    assert torch.equal(new[EMB][0], old[EMB][4]) and torch.equal(new[EMB][1], old[EMB][0])
    assert "2 rows copied, 1 new rows" in report[0] and "old ids 1..3" in report[0]


def test_untied_vocab_tensors_each_resized():
    old = _state(6)
    old[PROJ] = old[PROJ].clone() * 2
    new, report = adapt_state_dict(old, _shapes(8))
    assert torch.equal(new[PROJ][:6], old[PROJ]) and new[PROJ] is not new[EMB]
    assert len(report) == 2 and all("6 rows copied" in line for line in report)


def test_same_shapes_need_no_report():
    old = _state(6)
    new, report = adapt_state_dict(old, _shapes(6))
    assert report == [] and all(new[k] is old[k] for k in old)


def test_other_mismatches_raise_naming_the_tensor():
    shapes = _shapes(12)
    shapes["model.decoder.embed_positions.weight"] = torch.Size([16, 4])
    with pytest.raises(
        CheckpointNotSupportedError,
        match=r"embed_positions\.weight: expected \(16, 4\), got \(8, 4\)",
    ):
        adapt_state_dict(_state(10), shapes)
    # A vocab tensor whose width differs is not a vocabulary resize.
    with pytest.raises(CheckpointNotSupportedError, match=r"embed_tokens\.weight: expected"):
        adapt_state_dict(
            _state(10, d=4),
            _shapes(12, d=8)
            | {
                "model.decoder.layer_norm.weight": torch.Size([4]),
                "model.decoder.embed_positions.weight": torch.Size([8, 4]),
            },
        )
    extra = _state(10) | {"adapter.weight": torch.zeros(2)}
    with pytest.raises(
        CheckpointNotSupportedError, match=r"not in the model \(1\): adapter\.weight"
    ):
        adapt_state_dict(extra, _shapes(10))
    shapes = _shapes(10) | {"new.bias": torch.Size([3])}
    with pytest.raises(
        CheckpointNotSupportedError, match=r"missing from the checkpoint \(1\): new\.bias"
    ):
        adapt_state_dict(_state(10), shapes)


def test_whisper_model_loads_resized_state_strictly():
    transformers = pytest.importorskip("transformers")

    def model(vocab: int):
        cfg = transformers.WhisperConfig(
            vocab_size=vocab,
            d_model=16,
            encoder_layers=1,
            decoder_layers=1,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            encoder_ffn_dim=32,
            decoder_ffn_dim=32,
            num_mel_bins=8,
            max_source_positions=16,
            max_target_positions=16,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            decoder_start_token_id=3,
        )
        return transformers.WhisperForConditionalGeneration(cfg)

    torch.manual_seed(0)
    small, big = model(50), model(60)
    target = {k: v.shape for k, v in big.state_dict().items()}
    new, report = adapt_state_dict(small.state_dict(), target, model_state=big.state_dict())
    assert [line.split(":")[0] for line in report] == [EMB, PROJ]
    big.load_state_dict(new, strict=True)
    assert big.proj_out.weight is big.model.decoder.embed_tokens.weight
    assert torch.equal(
        big.model.decoder.embed_tokens.weight[:50], small.model.decoder.embed_tokens.weight
    )
