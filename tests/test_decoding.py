"""Greedy decoding: the KV-cached loop equals a plain recompute-everything loop, and the
generation config's suppressed tokens are never picked (as transformers' generate does)."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from transformers import WhisperConfig, WhisperForConditionalGeneration

from asrforge.model import projection
from asrforge.model.decoding import (
    TimestampVocab,
    codes_of_tokens,
    greedy_decode,
    suppressed_ids,
)
from asrforge.model.projection import _onednn_on_x86, packed_linears, vocab_logits

EOT = 2


def _model() -> WhisperForConditionalGeneration:
    torch.manual_seed(0)
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
    return WhisperForConditionalGeneration(cfg).eval()


def _reference(model, enc, prompts, n, always, at_begin) -> list[list[int]]:
    """No cache, no batch shrinking: the whole sequence through the decoder at every step."""
    out = []
    for b in range(prompts.shape[0]):
        seq = prompts[b].tolist()
        gen: list[int] = []
        for t in range(n):
            h = model.model.decoder(
                input_ids=torch.tensor([seq]), encoder_hidden_states=enc[b : b + 1]
            ).last_hidden_state[0, -1]
            logits = model.proj_out(h)
            for i in always + (at_begin if t == 0 else []):
                logits[i] = float("-inf")
            tok = int(logits.argmax())
            if tok == EOT:
                break
            gen.append(tok)
            seq.append(tok)
        out.append(gen)
    return out


def test_cached_greedy_equals_recomputing_and_honours_suppression():
    model = _model()
    enc = model.model.encoder(torch.randn(3, 8, 40)).last_hidden_state
    prompts = torch.tensor([[1, 5], [1, 6], [1, 7]])
    plain, _ = greedy_decode(model, enc, prompts, EOT, 8)
    assert plain == _reference(model, enc, prompts, 8, [], [])
    # suppress the tokens greedy picked most, and at the start each sequence's first token
    counts = torch.bincount(torch.tensor(sum(plain, [])), minlength=40)
    always = counts.argsort(descending=True)[:2].tolist()
    at_begin = sorted({s[0] for s in plain if s} - set(always))
    model.generation_config.suppress_tokens = always
    model.generation_config.begin_suppress_tokens = at_begin
    assert suppressed_ids(model) == (sorted(always), at_begin)
    ours, _ = greedy_decode(model, enc, prompts, EOT, 8)
    assert ours != plain
    assert ours == _reference(model, enc, prompts, 8, sorted(always), at_begin)
    assert not {t for s in ours for t in s} & set(always)
    assert all(s[0] not in at_begin for s in ours if s)


@pytest.mark.fast
def test_ids_outside_the_vocabulary_are_ignored():
    model = _model()
    model.generation_config.suppress_tokens = [3, 39, 40, 50256]
    model.generation_config.begin_suppress_tokens = None
    assert suppressed_ids(model) == ([3, 39], [])


@pytest.mark.fast
def test_vocab_logits_are_the_projections_and_follow_a_weight_written_in_place():
    model = _model().requires_grad_(False)  # as a bundle holds it
    hidden = torch.randn(3, 32)
    with torch.no_grad():
        assert torch.allclose(vocab_logits(model, hidden), model.proj_out(hidden), atol=1e-6)
        first = vocab_logits(model, hidden).clone()
        model.proj_out.weight.mul_(-2.0)  # as an interpolation or an EMA swap writes it
        assert torch.allclose(vocab_logits(model, hidden), -2.0 * first, atol=1e-5)
        model.proj_out.weight = torch.nn.Parameter(torch.zeros_like(model.proj_out.weight))
        assert vocab_logits(model, hidden).abs().max() == 0
        # a weight replaced by another of the same shape
        model.proj_out.weight.data = torch.ones_like(model.proj_out.weight)
        ones = hidden.sum(-1, keepdim=True).expand(3, 40)
        assert torch.allclose(vocab_logits(model, hidden), ones, atol=1e-5)


@pytest.mark.fast
@pytest.mark.parametrize("rows", [1, 2, 5])
def test_one_row_and_several_are_projected_alike_and_the_model_still_copies(rows):
    model = _model().requires_grad_(False)
    hidden = torch.randn(rows, 1, 32)
    with torch.no_grad():
        logits = vocab_logits(model, hidden)
        assert logits.shape == (rows, 1, 40)
        assert torch.allclose(logits, model.proj_out(hidden), atol=1e-6)
        # the kept layouts stay outside the module, so a copy of the model can still be made
        twin = copy.deepcopy(model)
        assert torch.allclose(vocab_logits(twin, hidden), logits, atol=1e-6)


def _linear_kinds(model) -> set[str]:
    return {type(m).__name__ for m in model.model.decoder.modules() if "Linear" in type(m).__name__}


@pytest.mark.fast
@pytest.mark.skipif(not _onednn_on_x86(), reason="oneDNN's packed linear is x86-64 only")
def test_several_rows_run_the_decoders_layers_on_packed_copies_and_the_layers_come_back():
    model = _model().requires_grad_(False)
    tokens, encoded = torch.tensor([[1, 5, 7], [1, 6, 8]]), torch.randn(2, 20, 32)
    names = list(model.state_dict())
    with torch.no_grad():
        plain = model.model.decoder(input_ids=tokens, encoder_hidden_states=encoded)
        with packed_linears(model.model.decoder, rows=2):
            assert _linear_kinds(model) == {"_PackedLinear"}
            assert list(model.state_dict()) == names
            packed = model.model.decoder(input_ids=tokens, encoder_hidden_states=encoded)
        assert _linear_kinds(model) == {"Linear"}
        with packed_linears(model.model.decoder, rows=1):
            assert _linear_kinds(model) == {"Linear"}
    assert torch.allclose(packed.last_hidden_state, plain.last_hidden_state, atol=1e-5)


@pytest.mark.fast
@pytest.mark.skipif(not _onednn_on_x86(), reason="oneDNN's packed linear is x86-64 only")
def test_trained_layers_and_layers_past_the_memory_bound_are_never_swapped(monkeypatch):
    model = _model()  # its weights train
    with torch.no_grad(), packed_linears(model.model.decoder, rows=4):
        assert _linear_kinds(model) == {"Linear"}
    model.requires_grad_(False)
    decoder_bytes = sum(
        m.weight.nbytes for m in model.model.decoder.modules() if type(m) is torch.nn.Linear
    )
    monkeypatch.setattr(projection, "PACKED_LAYERS_MAX_BYTES", decoder_bytes - 1)
    with torch.no_grad(), packed_linears(model.model.decoder, rows=4):
        assert _linear_kinds(model) == {"Linear"}


@pytest.mark.fast
def test_greedy_decoding_of_several_rows_under_cpu_autocast_runs_as_before():
    model = _model().requires_grad_(False)
    encoded, prompts = torch.randn(3, 20, 32), torch.tensor([[1, 5], [1, 6], [1, 7]])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        tokens, _ = greedy_decode(model, encoded, prompts, EOT, 6)
        rows = [greedy_decode(model, encoded[i : i + 1], prompts[i : i + 1], EOT, 6)[0][0]
                for i in range(3)]  # fmt: skip
        several = vocab_logits(model, torch.randn(3, 32))
        one = vocab_logits(model, torch.randn(1, 32))
    assert several.dtype == one.dtype == torch.bfloat16
    assert len(tokens) == 3 and all(len(t) <= 6 for t in tokens)
    assert tokens == rows


@pytest.mark.fast
def test_kept_copies_do_not_keep_a_replaced_weight_alive():
    from torch.multiprocessing.reductions import StorageWeakRef

    model = _model().requires_grad_(False)
    with torch.no_grad():
        greedy_decode(model, torch.randn(2, 20, 32), torch.tensor([[1, 5], [1, 6]]), EOT, 4)
        vocab_logits(model, torch.randn(1, 32))
    fc1, proj = model.model.decoder.layers[0].fc1, model.proj_out
    old = [StorageWeakRef(layer.weight.untyped_storage()) for layer in (fc1, proj)]
    model.to(torch.float64)  # each weight's tensor replaced by a cast copy
    gc.collect()
    assert all(ref.expired() for ref in old)


@pytest.mark.fast
@pytest.mark.skipif(not _onednn_on_x86(), reason="oneDNN's packed linear is x86-64 only")
def test_a_swapped_layer_passes_gradients_as_the_layer_itself():
    # another thread may train through the shared model while a decode has its layers swapped
    model = _model().requires_grad_(False)
    tokens, encoded = torch.tensor([[1, 5, 7], [1, 6, 8]]), torch.randn(2, 20, 32)
    with torch.no_grad(), packed_linears(model.model.decoder, rows=2):
        with torch.enable_grad():
            encoded.requires_grad_(True)
            states = model.model.decoder(input_ids=tokens, encoder_hidden_states=encoded)
            states.last_hidden_state.sum().backward()
    assert encoded.grad is not None and encoded.grad.abs().sum() > 0


@pytest.mark.fast
def test_a_trained_weight_is_projected_by_its_module_rewritten_or_not():
    model = _model()
    hidden = torch.randn(3, 32)
    with torch.no_grad():
        vocab_logits(model, hidden)
        # a sharded model's gather rewrites the weight's storage and leaves its version alone
        model.proj_out.weight.data.mul_(-1.0)
        assert torch.allclose(vocab_logits(model, hidden), model.proj_out(hidden), atol=1e-6)
    # with autograd on, the module itself runs, so gradients reach its weight
    vocab_logits(model, hidden).sum().backward()
    assert model.proj_out.weight.grad is not None


@pytest.mark.fast
def test_a_language_token_two_languages_share_is_the_first_ones():
    # yue borrows zh's token (data.language_tokens) and is listed after it
    assert codes_of_tokens({"zh": 50260, "yue": 50260, "en": 50259}) == {50260: "zh", 50259: "en"}


@pytest.mark.fast
def test_inference_tensors_and_hooked_projections_are_projected_by_the_module():
    hidden = torch.randn(3, 32)
    with torch.inference_mode():
        model = _model().requires_grad_(False)
        assert torch.allclose(vocab_logits(model, hidden), model.proj_out(hidden))
    model = _model().requires_grad_(False)
    model.proj_out.register_forward_hook(lambda module, args, out: out * 0)
    with torch.no_grad():
        assert vocab_logits(model, hidden).abs().max() == 0


@pytest.mark.fast
@pytest.mark.parametrize(
    "vocab, width",
    [
        (TimestampVocab(begin=15, count=10, eot=10, no_timestamps=14), 27),  # Whisper's, extended
        (TimestampVocab(begin=15, count=10, eot=10, no_timestamps=14), 25),  # stamps at the end
        (TimestampVocab(begin=20, count=5, eot=0, no_timestamps=19, specials=16), 25),  # a BPE's
    ],
)
def test_the_text_and_non_timestamp_spans_cover_the_columns_is_text_and_is_timestamp_say(
    vocab, width
):
    def columns(spans):
        return sorted(i for s in spans for i in range(s.start, s.stop))

    assert columns(vocab.text_spans(width)) == [i for i in range(width) if vocab.is_text(i)]
    assert columns(vocab.non_timestamp_spans(width)) == [
        i for i in range(width) if not vocab.is_timestamp(i)
    ]
