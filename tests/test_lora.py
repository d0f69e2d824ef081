"""LoRA (model.lora): only the adapters train and are saved, resume is exact, export merges them
into plain Whisper weights that transformers and CTranslate2 load, or writes them alone."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from asrforge.bundle.export import export_adapter, export_bundle
from asrforge.bundle.load import load_bundle
from asrforge.config import ConfigError, ModelConfig
from asrforge.errors import UserError
from asrforge.model import lora
from asrforge.model.build import build_model
from asrforge.model.encoding import encode_waves
from asrforge.model.tokenizer import load_tokenizer
from asrforge.train.loop import Trainer
from tests.conftest import tiny_config
from tests.hub_cache import add_repo
from tests.test_resume import assert_resume_is_bit_identical

pytest.importorskip("peft")

LORA = {"r": 4, "alpha": 8, "dropout": 0.1, "target_modules": ["q_proj", "v_proj", "fc1"]}
SECTIONS = dict(
    model={"lora": LORA},
    optim={"lr": 1e-2, "warmup_steps": 0},
    train={"max_steps": 6, "grad_accum": 2, "ema_decay": 0.9},
    eval={"eval_steps": 3, "max_new_tokens": 8},
    checkpoint={"save_total_limit": 5},
)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tones_dir) -> Path:
    out = tmp_path_factory.mktemp("lora") / "run"
    Trainer(tiny_config(out, tones_dir, **SECTIONS)).fit()
    return out


def _latest(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / "latest"


def _base_model(ckpt: Path):
    """The base the run trained on, rebuilt from its checkpoint as training built it."""
    from asrforge.bundle.contents import read_train_config

    cfg = read_train_config(ckpt / "config.yaml")
    tok = load_tokenizer(ckpt / "tokenizer")
    return build_model(cfg.model, tok, cfg.seed).model.eval(), tok


def test_checkpoints_hold_only_the_adapters_and_the_optimizer_only_them(lora_run):
    ckpt = _latest(lora_run)
    weights = load_file(ckpt / "model.safetensors")
    # 2 encoder + 2 decoder layers: q_proj, v_proj in self-attention (+ cross-attention in the
    # decoder) and fc1, each with lora_A and lora_B
    assert len(weights) == 2 * (2 * 3 + 2 * 5) and all(".lora_" in k for k in weights)
    assert weights["model.encoder.layers.0.self_attn.q_proj.lora_A.default.weight"].shape == (4, 32)
    base, _ = _base_model(ckpt)
    full = sum(p.numel() for p in base.parameters())
    assert sum(t.numel() for t in weights.values()) < full / 4
    ema = load_file(ckpt / "ema.safetensors")
    assert ema.keys() == weights.keys()
    optimizer = torch.load(ckpt / "optimizer.pt", weights_only=True)
    n_opt = sum(len(g["params"]) for g in optimizer["param_groups"])
    assert n_opt == len(weights) == len(optimizer["state"])
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest[lora.BASE_KEY] == lora.base_fingerprint(base)
    # training moved the adapters (lora_B starts at zero)
    assert any(t.abs().sum() > 0 for k, t in weights.items() if "lora_B" in k)


def test_lora_gets_the_partial_training_patience_and_the_line_says_only_the_adapters_train(
    lora_run,
):
    weights = load_file(_latest(lora_run) / "model.safetensors")
    n_adapter = sum(t.numel() for t in weights.values())
    n_base = sum(p.numel() for p in _base_model(_latest(lora_run))[0].parameters())
    line = next(x for x in (lora_run / "train.log").read_text().splitlines() if "selection:" in x)
    # LoRA trains part of the model: the partial-training patience, and the line says why
    trains = f"(LoRA: the adapters train, {n_adapter:,} of {n_base + n_adapter:,} parameters)"
    assert f"patience 3 {trains}" in line
    assert "whole model" not in line


def test_lora_resume_is_bit_identical(tmp_path, tones_dir):
    # per-step losses (adapter dropout included), adapters and their EMA, exactly
    assert_resume_is_bit_identical(
        tmp_path, tones_dir, SECTIONS, weights=("model.safetensors", "ema.safetensors")
    )


def test_export_merges_the_adapters_into_plain_whisper_weights(lora_run, tmp_path):
    from peft import PeftModel
    from transformers import WhisperForConditionalGeneration

    ckpt = _latest(lora_run)
    bundle_dir = export_bundle(lora_run, tmp_path / "bundle", weights="raw")
    adapter_dir = export_adapter(lora_run, tmp_path / "adapter", weights="raw")
    assert sorted(p.name for p in adapter_dir.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "manifest.json",
    ]
    hf = WhisperForConditionalGeneration.from_pretrained(bundle_dir).eval()
    assert not any("lora" in k for k in hf.state_dict())
    base, _ = _base_model(ckpt)
    peft_model = PeftModel.from_pretrained(base, adapter_dir).eval()

    feats = torch.randn(2, 80, 200)
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    with torch.no_grad():
        want = peft_model(input_features=feats, decoder_input_ids=ids).logits
        got = hf(input_features=feats, decoder_input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with peft_model.disable_adapter(), torch.no_grad():
        plain = peft_model(input_features=feats, decoder_input_ids=ids).logits
    assert (plain - want).abs().max() > 1e-3  # the adapters do change the model
    # asrforge's own loader reads the merged bundle
    assert load_bundle(bundle_dir).model.state_dict().keys() == hf.state_dict().keys()


def test_ct2_export_of_a_lora_run_decodes_as_the_merged_bundle(lora_run, tmp_path):
    ctranslate2 = pytest.importorskip("ctranslate2")
    from asrforge.model.decoding import greedy_decode

    bundle = load_bundle(export_bundle(lora_run, tmp_path / "bundle"))
    out = export_bundle(lora_run, tmp_path / "ct2", fmt="ct2")
    wave = np.sin(np.arange(16_000, dtype=np.float32) * 0.05) * 0.3
    feats = bundle.features(wave, sampling_rate=16_000, return_tensors="np").input_features
    model = ctranslate2.models.Whisper(str(out), device="cpu", compute_type="float32")
    prompt = bundle.tokenizer.convert_ids_to_tokens(bundle.specials.prompt("en"))
    result = model.generate(
        ctranslate2.StorageView.from_array(np.ascontiguousarray(feats)),
        [prompt],
        beam_size=1,
        max_length=10,
    )
    ours, _ = greedy_decode(
        bundle.model,
        encode_waves(bundle.model, bundle.features, [wave], bundle.device),
        torch.tensor([bundle.specials.prompt("en")]),
        bundle.specials.eot,
        6,
    )
    got = result[0].sequences_ids[0]
    assert got == ours[0][: len(got)] and got


def test_adapters_on_other_base_weights_are_refused(lora_run):
    ckpt = _latest(lora_run)
    from asrforge.bundle.contents import read_train_config

    cfg = read_train_config(ckpt / "config.yaml")
    tok = load_tokenizer(ckpt / "tokenizer")
    adapters = load_file(ckpt / "model.safetensors")
    with pytest.raises(UserError, match="trained on other base weights"):
        lora.merged_state(cfg, tok, adapters, "0" * 64, ckpt)
    cfg.model.lora.r = 2  # another rank: the tensors are not this configuration's adapters
    with pytest.raises(Exception, match="of another shape"):
        lora.merged_state(
            cfg,
            tok,
            adapters,
            json.loads((ckpt / "manifest.json").read_text())[lora.BASE_KEY],
            ckpt,
        )


def test_a_base_that_cannot_be_loaded_is_named_as_the_base_the_adapters_merge_into(
    lora_run, tmp_path
):
    from asrforge.bundle.contents import read_train_config

    ckpt = _latest(lora_run)
    cfg = read_train_config(ckpt / "config.yaml")
    cfg.model.pretrained = str(tmp_path / "moved")  # the base directory is gone
    adapters = load_file(ckpt / "model.safetensors")
    with pytest.raises(UserError, match="merged into their base model, which could not be loaded: "
                       ".*moved"):  # fmt: skip
        lora.merged_state(cfg, load_tokenizer(ckpt / "tokenizer"), adapters, None, ckpt)


def test_average_and_adapter_only_of_a_full_run_are_refused(lora_run, tmp_path, tones_dir):
    with pytest.raises(UserError, match="holds LoRA adapters: the mean of LoRA adapters' factors"):
        export_bundle(lora_run, tmp_path / "avg", weights="average")
    with pytest.raises(UserError, match="--weights must be ema or raw"):
        export_adapter(lora_run, tmp_path / "a", weights="average")
    full = tmp_path / "full"
    Trainer(tiny_config(full, tones_dir, train={"max_steps": 1}, eval={"eval_steps": None})).fit()
    with pytest.raises(UserError, match="needs a checkpoint of a run with model.lora"):
        export_adapter(full, tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.fast
def test_lora_config_is_checked(tmp_path, tones_dir):
    with pytest.raises(ConfigError, match="model.lora: cannot be combined"):
        tiny_config(tmp_path, tones_dir, model={"lora": {}, "freeze_encoder": True})
    with pytest.raises(ConfigError, match="model.lora.r: must be > 0"):
        tiny_config(tmp_path, tones_dir, model={"lora": {"r": 0}})
    cfg = tiny_config(tmp_path / "bad", tones_dir, model={"lora": {"target_modules": ["qproj"]}})
    with pytest.raises(UserError, match=r"model.lora.target_modules.0: 'qproj' names no layer of "
                                        r"the model — did you mean q_proj\?"):
        Trainer(cfg).fit()
    # peft trains a list of which one name matches and ignores the typo beside it: refused too
    cfg = tiny_config(tmp_path / "bad", tones_dir,
                      model={"lora": {"target_modules": ["q_proj", "v_prj"]}})
    with pytest.raises(UserError, match="model.lora.target_modules.1: 'v_prj' names no layer"):
        Trainer(cfg).fit()


WHISPER = {"d_model": 32, "encoder_layers": 2, "decoder_layers": 3, "encoder_attention_heads": 2,
           "decoder_attention_heads": 2, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64}


def _lora_model(targets, **model) -> ModelConfig:
    return ModelConfig(**model, lora={"target_modules": targets})


@pytest.mark.fast
def test_target_modules_are_checked_on_the_models_skeleton_by_peft_rule():
    """A typo in target_modules used to pass a matrix's dry run and fail each job as it built
    its model. Names are matched as peft matches a list: the whole module name, or its end
    after a dot."""
    ok = ["q_proj", "model.encoder.layers.0.fc1", "decoder.layers.2.fc2", "proj_out", "conv1"]
    assert lora.target_problems(_lora_model(ok, **WHISPER)) == []
    assert lora.target_problems(_lora_model(["q_prj", "v_proj", "mlp", "decoder.layers.3.fc1",
                                             "self_attn"], **WHISPER)) == [
        "model.lora.target_modules.0: 'q_prj' names no layer of the model — did you mean q_proj?",
        "model.lora.target_modules.2: 'mlp' names no layer of the model — its layers: conv1, "
        "conv2, embed_positions, embed_tokens, fc1, fc2, k_proj, out_proj, proj_out, q_proj, "
        "v_proj",
        "model.lora.target_modules.3: 'decoder.layers.3.fc1' names no layer of the model — no "
        "module's name ends with it (its fc1: model.encoder.layers.0.fc1 ... "
        "model.decoder.layers.2.fc1)",
        "model.lora.target_modules.4: 'self_attn' selects model.encoder.layers.0.self_attn "
        "(WhisperAttention), which LoRA cannot adapt: name linear layers (q_proj, k_proj, "
        "v_proj, out_proj, fc1, fc2)",
    ]
    assert lora.target_problems(ModelConfig(**WHISPER)) == []  # no LoRA, nothing to check


@pytest.mark.fast
def test_a_pretrained_models_targets_are_checked_from_its_config_json_alone(tmp_path, hf_home):
    """No weights are read: a directory (or a cached Hub snapshot) with only config.json is
    enough; a Hub id the cache does not hold is not checked (the run resolves it)."""
    from transformers import WhisperConfig

    config = WhisperConfig(d_model=32, encoder_layers=1, decoder_layers=4, encoder_attention_heads=2,
                           decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64)
    local = tmp_path / "model"
    config.save_pretrained(str(local))
    assert not list(local.glob("*.safetensors"))
    targets = ["decoder.layers.3.fc1", "encoder.layers.1.fc1", "q_prj"]
    expected = [
        "model.lora.target_modules.1: 'encoder.layers.1.fc1' names no layer of the model — no "
        "module's name ends with it (its fc1: model.encoder.layers.0.fc1 ... "
        "model.decoder.layers.3.fc1)",
        "model.lora.target_modules.2: 'q_prj' names no layer of the model — did you mean q_proj?",
    ]
    assert lora.target_problems(_lora_model(targets, pretrained=local)) == expected
    add_repo(hf_home, "org/whisper-ish", {"config.json": (local / "config.json").read_text()})
    assert lora.target_problems(_lora_model(targets, pretrained="org/whisper-ish")) == expected
    assert lora.target_problems(_lora_model(targets, pretrained="org/not-cached")) == []


def test_export_cli_adapter_only(lora_run, tmp_path, capsys):
    from asrforge.cli import main

    out = tmp_path / "adapter"
    assert main(["export", str(lora_run), "--out", str(out), "--adapter-only"]) == 0
    assert "wrote the LoRA adapters" in capsys.readouterr().out
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8
    assert sorted(config["target_modules"]) == ["fc1", "q_proj", "v_proj"]
    ema = load_file(_latest(lora_run) / "ema.safetensors")  # EMA weights by default
    written = load_file(out / "adapter_model.safetensors")
    key = "model.encoder.layers.0.self_attn.q_proj.lora_B.default.weight"
    assert torch.equal(written["base_model.model." + key.replace(".default.", ".")], ema[key])
    # readable by whoever serves it, as a bundle's files are (safetensors writes 0o600)
    assert {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()} == dict.fromkeys(
        ["adapter_config.json", "adapter_model.safetensors", "manifest.json"], 0o644)
    bad = ["export", str(lora_run), "--out", str(tmp_path / "x"), "--adapter-only"]
    assert main([*bad, "--format", "ct2"]) == 2
    assert "--format does not apply" in capsys.readouterr().err


def test_resume_refuses_another_lora_setting(lora_run, tmp_path, tones_dir):
    import shutil

    for change in ({"lora": {**LORA, "r": 2}}, {"lora": None}):
        run_dir = tmp_path / f"copy-{len(list(tmp_path.iterdir()))}"
        shutil.copytree(lora_run, run_dir, symlinks=True)
        sections = {**SECTIONS, "model": change, "train": {**SECTIONS["train"], "max_steps": 8}}
        cfg = tiny_config(run_dir, tones_dir, **sections)
        with pytest.raises(UserError, match=r"--resume: the config changes .*model\.lora"):
            Trainer(cfg).fit(resume=True)


def test_average_of_a_lora_run_is_refused_and_writes_nothing(lora_run, tmp_path, capsys):
    from asrforge.cli import main

    out = tmp_path / "avg"
    assert main(["average", str(lora_run), "--metric", "loss", "--k", "2", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "holds LoRA adapters: the mean of LoRA adapters' factors" in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists()


def test_an_average_of_lora_adapters_is_refused_by_export_and_evaluate(
    lora_run, tmp_path, tones_dir, capsys
):
    """Such an average (adapters, no base recorded) used to crash both with a KeyError."""
    from asrforge.checkpoint.manifest import read_manifest, write_manifest
    from asrforge.cli import main

    averaged = tmp_path / "loss.ave_2best"
    shutil.copytree(lora_run / "checkpoints" / "best", averaged)
    reserved = ("files", "format_version", lora.BASE_KEY)
    meta = {k: v for k, v in read_manifest(averaged).items() if k not in reserved}
    write_manifest(averaged, {**meta, "kind": "average"})
    export = ["export", str(averaged), "--out", str(tmp_path / "b")]
    evaluate = ["evaluate", str(averaged), "--data", str(tones_dir), "--split", "validation"]
    for argv in (export, evaluate):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert f"{averaged}: a model.lora run's checkpoint whose manifest records no" in err
        assert "Traceback" not in err
    assert not (tmp_path / "b").exists()
