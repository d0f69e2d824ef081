"""8-bit optimizer states (optim.optimizer: adamw_8bit, bitsandbytes): its checkpoints load with
torch.load(weights_only=True) and resume is bit-identical to an uninterrupted run."""

from __future__ import annotations

import sys

import pytest
import torch
from safetensors.torch import load_file

from asrforge.checkpoint.resume import check_resume_config
from asrforge.config import OptimConfig
from asrforge.errors import UserError
from asrforge.train.optim import build_optimizer
from tests.conftest import tiny_config
from tests.test_resume import PreemptAt, run

pytest.importorskip("bitsandbytes")

# fc1/fc2 of 64 x 128 and the token embedding hold >= 4096 values: bitsandbytes keeps 8-bit
# states for those (smaller tensors keep fp32 states).
WIDER = {"d_model": 64, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128}
SECTIONS = dict(
    model={**WIDER, "dropout": 0.1},
    optim={"optimizer": "adamw_8bit", "lr": 3e-3, "warmup_steps": 2, "weight_decay": 0.01},
    train={"max_steps": 6, "grad_accum": 2, "ema_decay": 0.9},
    eval={"eval_steps": 3, "max_new_tokens": 8},
    checkpoint={"save_total_limit": 5},
)


def _latest(run_dir):
    return run_dir / "checkpoints" / "latest"


def test_adamw_8bit_resume_is_bit_identical_weights_and_optimizer_state(tmp_path, tones_dir):
    full, _ = run(tiny_config(tmp_path / "full", tones_dir, **SECTIONS), [])
    cfg = tiny_config(tmp_path / "split", tones_dir, **SECTIONS)
    first, interrupted = run(cfg, [PreemptAt(3)])
    assert interrupted.status == "interrupted" and sorted(first) == [1, 2, 3]
    second, _ = run(cfg, [], resume=True)
    assert {**first, **second} == full  # per-step losses, exactly
    a = load_file(_latest(tmp_path / "full") / "model.safetensors")
    b = load_file(_latest(tmp_path / "split") / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    opt_a = torch.load(_latest(tmp_path / "full") / "optimizer.pt", weights_only=True)
    opt_b = torch.load(_latest(tmp_path / "split") / "optimizer.pt", weights_only=True)
    codes = 0
    assert opt_a["state"].keys() == opt_b["state"].keys()
    for i, sa in opt_a["state"].items():
        qa = sa["__bnb_optimizer_quant_state__"]
        qb = opt_b["state"][i]["__bnb_optimizer_quant_state__"]
        assert sa["step"] == opt_b["state"][i]["step"] == 6
        assert qa.keys() == qb.keys()
        assert all(torch.equal(qa[k], qb[k]) for k in qa), i
        codes += qa["state1"].dtype == torch.uint8
    # the large tensors' moments are 8-bit codes, not fp32
    assert codes >= 8


@pytest.mark.fast
def test_adamw_8bit_keeps_the_parameter_groups():
    model = torch.nn.Module()
    model.embed_tokens, model.fc1 = torch.nn.Embedding(100, 64), torch.nn.Linear(64, 128)
    opt = build_optimizer(
        model, OptimConfig(optimizer="adamw_8bit", lr=1e-3, embedding_lr_scale=0.5)
    )
    assert type(opt).__name__ == "AdamW8bit"
    by_name = {g["name"]: g for g in opt.param_groups}
    assert by_name["embeddings"]["lr"] == 5e-4 and by_name["embeddings"]["weight_decay"] == 0.0
    assert by_name["decay"]["params"] == [model.fc1.weight]
    assert by_name["no_decay"]["params"] == [model.fc1.bias]


@pytest.mark.fast
def test_adamw_8bit_without_bitsandbytes_names_the_option_and_the_extra(monkeypatch):
    # a None entry makes `import bitsandbytes` raise ImportError
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    with pytest.raises(UserError) as e:
        build_optimizer(torch.nn.Linear(4, 4), OptimConfig(optimizer="adamw_8bit"))
    assert "optim.optimizer: adamw_8bit" in str(e.value)
    assert "asrforge[lowbit]" in str(e.value)


@pytest.mark.fast
def test_resume_refuses_another_optimizer(tmp_path, tones_dir):
    saved = tiny_config(tmp_path / "run", tones_dir).to_yaml()
    now = tiny_config(tmp_path / "run", tones_dir, optim={"optimizer": "adamw_8bit", "lr": 1e-3})
    with pytest.raises(UserError) as e:
        check_resume_config(now, saved, tmp_path / "run" / "checkpoints" / "step-000003")
    assert 'optim.optimizer: "adamw" -> "adamw_8bit"' in str(e.value)
    assert "optim.lr" not in str(e.value)  # the learning rate may change on resume


@pytest.mark.fast
def test_lora_imports_bitsandbytes_with_its_import_warnings_silenced(tmp_path, monkeypatch, caplog):
    import logging

    import peft  # noqa: F401 - peft's own import must not meet the stand-in below

    from asrforge.model.lora import _peft

    # a stand-in bitsandbytes that warns on import as the real one does on a CPU without kernels
    fake = tmp_path / "bitsandbytes"
    fake.mkdir()
    (fake / "__init__.py").write_text(
        "import logging\nlogging.getLogger('bitsandbytes.backends.cpu.ops').warning("
        "'Failed to load CPU gemm_4bit_forward from kernels-community')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    monkeypatch.delitem(sys.modules, "bitsandbytes")
    level = logging.getLogger("bitsandbytes").level
    with caplog.at_level(logging.WARNING):
        _peft()
    assert sys.modules["bitsandbytes"].__file__ == str(fake / "__init__.py")
    assert "gemm_4bit_forward" not in caplog.text
    assert logging.getLogger("bitsandbytes").level == level  # its later messages still show
