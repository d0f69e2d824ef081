"""A LoRA run on a quantized base (model.lora.quantize_base, bitsandbytes): the base's linear
layers load quantized, evaluation runs on it, checkpoints hold the adapters and the
full-precision base's sha256, resume is exact, and export merges the adapters into the
full-precision base as plain Whisper weights that transformers and CTranslate2 load."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from asrforge.bundle.export import export_bundle
from asrforge.cli import main
from asrforge.config import ConfigError
from asrforge.model import lora
from asrforge.model.build import build_model, build_tokenizer
from asrforge.model.lowbit import quantization_config
from asrforge.model.tokenizer import load_tokenizer
from asrforge.train.loop import Trainer
from asrforge.train.setup import build_run_model
from tests.conftest import tiny_config
from tests.test_resume import PreemptAt, run

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "fc1"]}
# bitsandbytes' CPU 4-bit matmul works on blocks of 64 inputs: every Whisper is at least that wide.
WIDER = {"d_model": 64, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128}


def sections(pretrained: Path, quantize: str = "4bit") -> dict:
    return dict(
        model={**WIDER, "pretrained": str(pretrained), "lora": {**LORA, "quantize_base": quantize}},
        optim={"lr": 1e-2, "warmup_steps": 0},
        train={"max_steps": 2, "grad_accum": 2, "precision": "fp32"},
        eval={"eval_steps": 2, "max_new_tokens": 4},
        checkpoint={"save_total_limit": 5},
    )


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, tones_dir) -> Path:
    """A tiny model and its tokenizer saved as a transformers directory."""
    root = tmp_path_factory.mktemp("qlora-base")
    cfg = tiny_config(root / "scratch", tones_dir, model=WIDER)
    tokenizer = build_tokenizer(cfg.model, ["one two three", "uno dos tres"] * 60)
    build_model(cfg.model, tokenizer, 0).model.save_pretrained(str(root / "base"))
    tokenizer.save_pretrained(str(root / "base"))
    return root / "base"


@pytest.fixture(scope="module")
def qlora_run(tmp_path_factory, tones_dir, pretrained) -> Path:
    out = tmp_path_factory.mktemp("qlora") / "run"
    Trainer(tiny_config(out, tones_dir, **sections(pretrained))).fit()
    return out


def _latest(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / "latest"


def _full_precision_base(ckpt: Path):
    from asrforge.bundle.contents import read_train_config

    cfg = read_train_config(ckpt / "config.yaml")
    return build_model(cfg.model, load_tokenizer(ckpt / "tokenizer"), cfg.seed).model.eval(), cfg


def test_checkpoints_hold_the_adapters_and_the_full_precision_base_sha256(qlora_run):
    ckpt = _latest(qlora_run)
    weights = load_file(ckpt / "model.safetensors")
    assert weights and all(".lora_" in k for k in weights)
    assert all(t.dtype == torch.float32 for t in weights.values())
    assert any(t.abs().sum() > 0 for k, t in weights.items() if "lora_B" in k)  # trained
    optimizer = torch.load(ckpt / "optimizer.pt", weights_only=True)
    assert sum(len(g["params"]) for g in optimizer["param_groups"]) == len(weights)
    base, cfg = _full_precision_base(ckpt)
    assert cfg.model.lora.quantize_base == "4bit"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest[lora.BASE_KEY] == lora.base_fingerprint(base)
    log = (qlora_run / "train.log").read_text()
    assert "base loaded 4bit" in log
    # evaluation ran on the quantized base at the start and during training: a loss per utterance
    for step in (0, 2):
        lines = (qlora_run / "eval" / f"step-{step:06d}.jsonl").read_text().splitlines()
        losses = [json.loads(line).get("loss") for line in lines[:-1]]
        assert len(losses) == 12 and all(np.isfinite(x) for x in losses)
    assert "eval step 2: loss" in log


def test_quantized_base_resume_is_bit_identical(tmp_path, tones_dir, pretrained):
    # evaluation at step 2 only: the run is slow enough on a CPU's 4-bit kernels
    no_start = {**sections(pretrained), "eval": {"at_start": False, "max_new_tokens": 2}}
    full, _ = run(tiny_config(tmp_path / "full", tones_dir, **no_start), [])
    cfg = tiny_config(tmp_path / "split", tones_dir, **no_start)
    first, interrupted = run(cfg, [PreemptAt(1)])
    assert interrupted.status == "interrupted" and sorted(first) == [1]
    second, _ = run(cfg, [], resume=True)
    assert {**first, **second} == full  # per-step losses, exactly
    a = load_file(_latest(tmp_path / "full") / "model.safetensors")
    b = load_file(_latest(tmp_path / "split") / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    opt_a = torch.load(_latest(tmp_path / "full") / "optimizer.pt", weights_only=True)
    opt_b = torch.load(_latest(tmp_path / "split") / "optimizer.pt", weights_only=True)
    for i, sa in opt_a["state"].items():
        assert all(torch.equal(sa[k], opt_b["state"][i][k]) for k in ("exp_avg", "exp_avg_sq"))


def test_export_merges_into_the_full_precision_base_not_the_quantized_one(qlora_run, tmp_path):
    from peft import PeftModel
    from transformers import WhisperForConditionalGeneration

    ckpt = _latest(qlora_run)
    bundle_dir = export_bundle(qlora_run, tmp_path / "bundle", weights="raw")
    hf = WhisperForConditionalGeneration.from_pretrained(bundle_dir).eval()
    assert type(hf.model.encoder.layers[0].fc1) is torch.nn.Linear
    assert {t.dtype for t in hf.state_dict().values()} == {torch.float32}
    assert not any("lora" in k for k in hf.state_dict())

    base, cfg = _full_precision_base(ckpt)
    adapters = tmp_path / "adapter"
    adapters.mkdir()
    lora.write_adapter(adapters, load_file(ckpt / "model.safetensors"), cfg.model.lora, None)
    feats = torch.randn(2, 80, 200)
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    full = PeftModel.from_pretrained(base, adapters).eval()
    with torch.no_grad():
        want = full(input_features=feats, decoder_input_ids=ids).logits
        got = hf(input_features=feats, decoder_input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    # The quantized base the adapters trained on differs from it by the quantization error.
    quantized = build_model(
        cfg.model,
        load_tokenizer(ckpt / "tokenizer"),
        cfg.seed,
        quantization=quantization_config("4bit", "fp32"),
    ).model.eval()
    qpeft = PeftModel.from_pretrained(quantized, adapters).eval()
    with torch.no_grad():
        on_quantized = qpeft(input_features=feats, decoder_input_ids=ids).logits
    assert (on_quantized - want).abs().max() > 1e-4


def test_asrforge_export_ct2_of_a_quantized_base_run_loads_and_decodes_in_ctranslate2(
    qlora_run, tmp_path
):
    ctranslate2 = pytest.importorskip("ctranslate2")
    from asrforge.bundle.load import load_bundle

    bundle = load_bundle(export_bundle(qlora_run, tmp_path / "bundle"))
    out = tmp_path / "ct2"
    assert main(["export", str(qlora_run), "--out", str(out), "--format", "ct2"]) == 0
    model = ctranslate2.models.Whisper(str(out), device="cpu", compute_type="float32")
    wave = np.sin(np.arange(16_000, dtype=np.float32) * 0.05) * 0.3
    feats = bundle.features(wave, sampling_rate=16_000, return_tensors="np").input_features
    prompt = bundle.tokenizer.convert_ids_to_tokens(bundle.specials.prompt("en"))
    result = model.generate(
        ctranslate2.StorageView.from_array(np.ascontiguousarray(feats)),
        [prompt],
        beam_size=1,
        max_length=10,
    )
    assert result[0].sequences_ids[0]


def test_an_8bit_base_trains_and_exports_plain_weights(tmp_path, tones_dir, pretrained):
    from transformers import WhisperForConditionalGeneration

    out = tmp_path / "run"
    cfg = tiny_config(out, tones_dir, **sections(pretrained, "8bit"))
    cfg.train.max_steps, cfg.eval.at_start = 1, False
    cfg.model.gradient_checkpointing = True  # gradients reach the adapters through recomputation
    Trainer(cfg).fit()
    assert "base loaded 8bit" in (out / "train.log").read_text()
    adapters = load_file(_latest(out) / "model.safetensors")
    assert any(t.abs().sum() > 0 for k, t in adapters.items() if "lora_B" in k)
    hf = WhisperForConditionalGeneration.from_pretrained(export_bundle(out, tmp_path / "b"))
    assert type(hf.model.decoder.layers[0].fc1) is torch.nn.Linear


@pytest.mark.fast
def test_quantize_base_needs_a_pretrained_model(tmp_path, tones_dir):
    with pytest.raises(ConfigError) as e:
        tiny_config(tmp_path, tones_dir, model={"lora": {"quantize_base": "4bit"}})
    assert "model.lora.quantize_base: 4bit needs model.pretrained" in str(e.value)


@pytest.mark.parametrize(
    ("precision", "dtype"), [("fp32", torch.float32), ("bf16", torch.bfloat16)]
)
def test_a_4bit_base_multiplies_in_the_run_precision(
    tmp_path, tones_dir, pretrained, precision, dtype
):
    cfg = tiny_config(tmp_path, tones_dir, **sections(pretrained))
    tokenizer = load_tokenizer(pretrained)
    bundle, base = build_run_model(cfg, tokenizer, None, precision, torch.device("cpu"))
    fc1 = bundle.model.model.encoder.layers[0].fc1
    assert type(fc1.base_layer).__name__ == "Linear4bit" and fc1.base_layer.compute_dtype == dtype
    # the adapters train in fp32 whatever the precision; the base's fingerprint is full precision
    assert fc1.lora_A["default"].weight.dtype == torch.float32
    assert base == lora.base_fingerprint(build_model(cfg.model, tokenizer, cfg.seed).model)
