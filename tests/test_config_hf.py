"""Hugging Face TrainingArguments names in a config get a precise hint (``asrforge config hf``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from asrforge.cli import main
from asrforge.config import ConfigError, DataConfig, format_errors, load_config
from asrforge.config.hf_names import PEER_NAMES
from asrforge.config.reference import field_docs
from asrforge.matrix.plan import MatrixConfig

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[1]


def test_every_hint_names_real_config_fields():
    listed = {row.path for row in field_docs()}
    for name, where in PEER_NAMES.items():
        for path in re.findall(r"\b[a-z_]+(?:(?:\.|\[\]\.)[a-z_]+)+\b", where):
            assert path in listed, (name, path)


def test_hf_names_get_the_asrforge_name_not_a_lookalike():
    with pytest.raises(ConfigError) as e:
        load_config(
            ROOT / "configs" / "tiny.yaml",
            [
                "learning_rate=1e-5",
                "data.per_device_train_batch_size=16",
                "train.gradient_accumulation_steps=2",
                "warmup_ratio=0.1",
                "fp16=true",
                "optim.adam_beta2=0.999",
            ],
        )
    lines = e.value.problems
    assert (
        "learning_rate: unknown field — Hugging Face's learning_rate; asrforge calls this optim.lr"
        in lines
    )
    by_field = {line.split(":")[0]: line for line in lines}
    assert "data.batch_size" in by_field["data.per_device_train_batch_size"]
    assert "eval_batch_size" not in by_field["data.per_device_train_batch_size"]
    assert "train.grad_accum" in by_field["train.gradient_accumulation_steps"]
    assert "optim.warmup_steps, a number of steps" in by_field["warmup_ratio"]
    assert "train.precision: fp16" in by_field["fp16"]
    assert "optim.betas" in by_field["optim.adam_beta2"]
    # a typo of an asrforge name still gets the close match
    with pytest.raises(ConfigError, match=r"did you mean eval.eval_steps\?"):
        load_config(ROOT / "configs" / "tiny.yaml", ["eval.eval_step=3"])


def test_a_section_checked_alone_gets_the_hint_and_another_schema_does_not():
    """Every model of the run's schema hints, wherever in the config package it is defined (a
    command's data.* options are checked by DataConfig alone); the matrix's schema does not."""
    with pytest.raises(ValidationError) as e:
        DataConfig.model_validate({"path": "x", "learning_rate": 1})
    assert format_errors(e.value, DataConfig, prefix="data") == [
        "data.learning_rate: unknown field — Hugging Face's learning_rate; asrforge calls this "
        "optim.lr"
    ]
    with pytest.raises(ValidationError) as e:
        MatrixConfig.model_validate({"learning_rate": 1})
    assert "learning_rate: unknown field" in format_errors(e.value, MatrixConfig)


def test_config_hf_lists_the_table(capsys):
    assert main(["config", "hf"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == len(PEER_NAMES)
    assert any(re.fullmatch(r"learning_rate +optim\.lr", line) for line in out)


def test_names_asrforge_has_no_setting_for_say_so_in_plain_words():
    for name in ("load_best_model_at_end", "predict_with_generate", "push_to_hub"):
        with pytest.raises(ConfigError) as e:
            load_config(ROOT / "configs" / "tiny.yaml", [f"{name}=true"])
        (line,) = e.value.problems
        assert f"Hugging Face's {name} has no asrforge setting: " in line
        assert "calls this nothing" not in line


def test_push_to_hub_points_at_export_push_to_hub(capsys):
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "configs" / "tiny.yaml", ["push_to_hub=true"])
    (line,) = e.value.problems
    assert line.endswith(
        "push_to_hub has no asrforge setting: export uploads the bundle it writes "
        "(asrforge export RUN --out BUNDLE --push-to-hub REPO)"
    )
    with pytest.raises(SystemExit):
        main(["train", str(ROOT / "configs" / "tiny.yaml"), "--push_to_hub", "x"])
    err = capsys.readouterr().err
    assert "--push-to-hub REPO" in err and "never uploads" not in err


def test_optim_given_an_optimizer_name_points_at_optim_optimizer():
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "configs" / "tiny.yaml", ["optim=adamw_bnb_8bit"])
    (line,) = e.value.problems
    assert line.startswith("optim: input should be a valid dictionary")
    assert "asrforge calls this optim.optimizer" in line
    assert (
        "adamw_bnb_8bit -> adamw_8bit" in line and "adamw_torch, adamw_torch_fused -> adamw" in line
    )


@pytest.mark.parametrize("flags", [["--learning_rate", "1e-5"], ["--learning-rate=1e-5"]])
def test_a_flag_style_override_says_overrides_are_key_value(flags, capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", str(ROOT / "configs" / "tiny.yaml"), *flags])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert "config overrides are key=value without dashes" in err
    assert "Hugging Face's learning_rate; asrforge calls this optim.lr" in err


def test_ms_swift_names_get_the_asrforge_name():
    with pytest.raises(ConfigError) as e:
        load_config(
            ROOT / "configs" / "tiny.yaml",
            [
                "train.log_freq=5",
                "log_to_file=true",
                "master_only=true",
                "log_dir=x",
                "checkpoint.save_on_best=true",
                "save_steps=100",
                "metric_for_best_model=wer",
                "greater_is_better=false",
            ],
        )
    by_field = {line.split(":")[0]: line for line in e.value.problems}
    assert "ms-swift's log_freq; asrforge calls this train.log_every" in by_field["train.log_freq"]
    assert (
        "ms-swift's log_to_file has no asrforge setting: every run writes its log"
        in (by_field["log_to_file"])
    )
    assert "only rank zero logs and writes files" in by_field["master_only"]
    assert "asrforge calls this output_dir" in by_field["log_dir"]
    assert "checkpoints/best always holds" in by_field["checkpoint.save_on_best"]
    for name in ("save_steps", "metric_for_best_model", "greater_is_better"):
        assert f"Hugging Face's and ms-swift's {name}; asrforge calls this" in by_field[name]


def test_espnet_names_get_the_asrforge_name():
    with pytest.raises(ConfigError) as e:
        load_config(
            ROOT / "configs" / "tiny.yaml",
            ["accum_grad=4", "grad_clip=5.0", "optim.optim_conf=1", "ngpu=2"],
        )
    by_field = {line.split(":")[0]: line for line in e.value.problems}
    assert "ESPnet's accum_grad; asrforge calls this train.grad_accum" in by_field["accum_grad"]
    assert "optim.clip_grad_norm" in by_field["grad_clip"]
    assert "optim.lr, optim.betas" in by_field["optim.optim_conf"]
    assert "ESPnet's ngpu has no asrforge setting: start one process per GPU" in by_field["ngpu"]
