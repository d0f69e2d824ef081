"""``data.eval_batch_size: auto``: the largest batch that fits on a GPU, probed once per model
shape and device; the configured default on the CPU. The probe itself needs a GPU
(``bench/gpu_check.py`` reports the batch it chose); its search is checked here."""

from __future__ import annotations

import pytest
from transformers import WhisperConfig, WhisperForConditionalGeneration

from asrforge.config import DataConfig
from asrforge.evaluation import batch_size
from asrforge.evaluation.batch_size import eval_batch_size, largest_fitting


@pytest.mark.fast
def test_the_largest_fitting_batch_doubles_until_one_does_not_fit():
    tried: list[int] = []

    def fits(b: int) -> bool:
        tried.append(b)
        return b <= 40

    assert largest_fitting(8, fits) == 32 and tried == [8, 16, 32, 64]
    assert largest_fitting(8, lambda b: True, ceiling=100) == 64
    assert largest_fitting(8, lambda b: False) == 8  # the configured batch stands


@pytest.mark.fast
def test_auto_is_the_default_batch_on_the_cpu_and_a_number_is_kept():
    assert eval_batch_size(None, 8) == 8 and eval_batch_size(24, 8) == 24
    assert eval_batch_size("auto", 8, model=object(), device="cpu") == 8
    assert DataConfig(path="d", eval_batch_size="auto").eval_batch_size == "auto"
    with pytest.raises(ValueError):
        DataConfig(path="d", eval_batch_size="most")


@pytest.mark.fast
def test_auto_probes_once_per_model_shape_and_device(monkeypatch):
    probes: list[int] = []
    monkeypatch.setattr(batch_size, "_probed", {})
    monkeypatch.setattr(batch_size, "_fits", lambda model, b, *a: probes.append(b) or b <= 64)
    cfg = dict(d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
               decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, vocab_size=50,
               max_source_positions=10, max_target_positions=16, num_mel_bins=8, pad_token_id=2,
               bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)  # fmt: skip
    model = WhisperForConditionalGeneration(WhisperConfig(**cfg))
    assert eval_batch_size("auto", 16, model, "cuda:0") == 64
    assert eval_batch_size("auto", 16, model, "cuda:0") == 64
    assert probes == [16, 32, 64, 128]  # the second call used the cached answer
    wider = WhisperForConditionalGeneration(WhisperConfig(**{**cfg, "d_model": 32}))
    eval_batch_size("auto", 16, wider, "cuda:0")
    assert len(probes) == 8  # another shape is probed again


def test_a_run_with_auto_evaluates_in_batches_of_the_default_on_the_cpu(tmp_path, tones_dir):
    from conftest import tiny_config

    from asrforge.train.loop import Trainer

    seen: list[int] = []
    real = batch_size.largest_fitting
    cfg = tiny_config(
        tmp_path / "run", tones_dir, train={"max_steps": 2}, eval={"eval_steps": 2},
        data={"path": str(tones_dir), "batch_size": 4, "num_workers": 0,
              "eval_batch_size": "auto"},
    )  # fmt: skip
    batch_size.largest_fitting = lambda *a, **k: seen.append(1) or real(*a, **k)
    try:
        result = Trainer(cfg).fit()
    finally:
        batch_size.largest_fitting = real
    assert result.status == "completed" and result.last_metrics["n"] > 0
    assert seen == []  # evaluated, nothing probed on the CPU
