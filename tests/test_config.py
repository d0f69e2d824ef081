"""The config schema: every error class, overrides, and every shipped config loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from schema_fields import schema_fields

from asrforge.config import ConfigError, TrainConfig, load_config
from asrforge.matrix.plan import MatrixConfig

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[1]
MINIMAL = {"output_dir": "runs/x", "data": {"path": "d"}}


def problems(data=None, overrides=None) -> list[str]:
    with pytest.raises(ConfigError) as e:
        load_config(data=data if data is not None else dict(MINIMAL), overrides=overrides)
    return e.value.problems


def test_minimal_config_fills_defaults():
    cfg = load_config(data=MINIMAL)
    assert isinstance(cfg, TrainConfig)
    assert cfg.optim.lr > 0 and cfg.model.d_model == 64 and cfg.data.batch_size == 8


def test_bound_error_names_the_yaml_path_and_value():
    assert problems({**MINIMAL, "optim": {"lr": -1}}) == ["optim.lr: must be > 0, got -1"]


def test_unknown_field_suggests_the_close_name():
    (p,) = problems({**MINIMAL, "eval": {"eval_step": 5}})
    assert p == "eval.eval_step: unknown field — did you mean eval.eval_steps?"


def test_every_problem_is_reported_at_once():
    ps = problems(
        {
            "data": {"path": "d", "batch_size": 0},
            "optim": {"lr": 0, "betas": "x"},
            "train": {"precision": "fp8"},
            "bogus": 1,
        }
    )
    joined = "\n".join(ps)
    for needle in ("output_dir: required field is missing", "data.batch_size: must be > 0",
                   "optim.lr: must be > 0", "optim.betas", "train.precision: must be one of",
                   "bogus: unknown field"):
        assert needle in joined, (needle, ps)
    assert len(ps) >= 6


def test_cross_field_rules_name_each_field():
    # with model.pretrained, shape fields may be set (a run's config.yaml records them): the
    # model build checks them against the pretrained model (tests/test_model_shape_record.py)
    cfg = load_config(data={**MINIMAL, "model": {"pretrained": "p", "d_model": 32}})
    assert cfg.model.d_model == 32 and "d_model" in cfg.to_plain()["model"]
    ps = problems({**MINIMAL, "model": {"d_model": 32, "encoder_attention_heads": 5, "decoder_attention_heads": 4}})
    assert ps == ["model.encoder_attention_heads: must divide d_model=32, got 5"]
    ps = problems({**MINIMAL, "model": {"max_source_positions": 120}})
    assert ps[0].startswith("model.max_source_positions: must be a multiple of 50")


def test_overrides_are_typed_and_reach_lists():
    data = {**MINIMAL, "callbacks": [{"name": "early_stopping", "patience": 2}]}
    cfg = load_config(data=data, overrides=["optim.lr=0.5", "train.max_steps=7",
                                           "callbacks.0.patience=4", "output_dir=/tmp/y"])
    assert cfg.optim.lr == 0.5 and cfg.train.max_steps == 7
    assert cfg.callbacks[0].options == {"patience": 4}
    assert str(cfg.output_dir) == "/tmp/y"


def test_bad_overrides_are_config_errors():
    assert problems(overrides=["optim.lr"])[0].startswith("optim.lr: an override must look like")
    assert problems(overrides=["optim.lrr=1"]) == [
        "optim.lrr: unknown field — did you mean optim.lr?"
    ]
    assert problems(overrides=["optim.lr=abc"])[0].startswith("optim.lr:")


def test_yaml_and_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "clips").mkdir()
    with pytest.raises(ConfigError, match=r"clips: is a directory, not a config file"):
        load_config(tmp_path / "clips")
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(lst)


def test_config_id_defaults_to_file_stem_and_roundtrips(tmp_path):
    f = tmp_path / "my-run.yaml"
    f.write_text(yaml.safe_dump(MINIMAL))
    cfg = load_config(f)
    assert cfg.config_id == "my-run"
    again = load_config(data=yaml.safe_load(cfg.to_yaml()))
    assert again == cfg and again.fingerprint() == cfg.fingerprint()


@pytest.mark.parametrize("schema", [TrainConfig, MatrixConfig], ids=lambda m: m.__name__)
def test_every_field_of_every_section_has_a_description(schema):
    # The field's docstring is its documentation and its `asrforge train --help` line.
    fields = schema_fields(schema)
    missing = [path for path, info in fields if not (info.description or "").strip()]
    assert not missing, f"{len(missing)} of {len(fields)} fields have no description: {missing}"


def test_trained_top_encoder_layers_counts_the_layers_that_train():
    # (it was `frozen_encoder_top`, a name that read as the count of frozen layers)
    def model(**fields):
        return load_config(data={**MINIMAL, "model": {"encoder_layers": 4, **fields}}).model

    assert model().trained_top_encoder_layers is None  # the whole encoder trains
    assert model(train_encoder_layers=1).trained_top_encoder_layers == 1
    assert model(freeze_encoder=True).trained_top_encoder_layers == 0


TRAIN_CONFIGS = sorted(p for p in (ROOT / "configs").glob("*.yaml") if not p.name.startswith("matrix-"))


@pytest.mark.parametrize("path", TRAIN_CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_load_and_name_their_command(path):
    cfg = load_config(path)
    assert cfg.config_id == path.stem
    header = "".join(line for line in path.read_text().splitlines(True) if line.startswith("#"))
    assert "asrforge " in header and path.name in header, f"{path.name}: header must name its command"
    from asrforge.callbacks import build_callbacks

    build_callbacks(cfg)  # callback names and options are valid too


def test_yaml_words_that_look_boolean_stay_words(tmp_path):
    assert load_config(data=MINIMAL, overrides=["train.precision=no"]).train.precision == "no"
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump(MINIMAL) + "train:\n  precision: no\n")
    assert load_config(f).train.precision == "no"


def test_a_pretrained_config_roundtrips_through_its_yaml():
    cfg = load_config(data={**MINIMAL, "model": {"pretrained": "some/dir"}})
    again = load_config(data=yaml.safe_load(cfg.to_yaml()))
    assert again.model.pretrained == cfg.model.pretrained


def test_optim_betas_must_be_in_0_1():
    # AdamW would raise a torch traceback at the first step
    assert problems(overrides=["optim.betas=[0.9, 1]"]) == ["optim.betas.1: must be < 1, got 1"]
    (p,) = problems(overrides=["optim.betas=[-0.1, 0.9]"])
    assert p == "optim.betas.0: must be >= 0, got -0.1"
    assert load_config(data=MINIMAL, overrides=["optim.betas=[0, 0.999]"]).optim.betas == (0, 0.999)


def test_optim_settings_must_be_finite():
    not_finite = "input should be a finite number, got"
    assert problems(overrides=["optim.lr=.inf"]) == [f"optim.lr: {not_finite} inf"]
    assert problems(overrides=["optim.eps=.nan"]) == [f"optim.eps: {not_finite} nan"]


def test_a_keep_best_metric_evaluation_never_produces_is_refused_before_training(tmp_path, capsys):
    from asrforge.callbacks import build_callbacks
    from asrforge.cli import main
    from asrforge.train.events import eval_metric_names

    (tmp_path / "d").mkdir()  # the command names a missing data path before the callbacks
    data = {
        **MINIMAL,
        "data": {"path": str(tmp_path / "d")},
        "output_dir": str(tmp_path / "run"),
        "checkpoint": {"keep_best": [{"metric": "wer"}, {"metric": "wre", "k": 2}]},
    }
    with pytest.raises(ConfigError) as e:
        build_callbacks(load_config(data=data))
    assert e.value.problems == [
        "checkpoint.keep_best.1.metric: 'wre' is not a metric evaluation produces, did you mean "
        f"'wer'? (it produces: {', '.join(eval_metric_names())})"
    ]
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump(data))
    assert main(["train", str(f)]) == 2
    assert f"invalid config {f}:\n  checkpoint.keep_best.1.metric: 'wre'" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_language_value_that_names_no_language_is_refused_before_start_up(
    tmp_path, capsys, monkeypatch
):
    from asrforge.cli import main
    from asrforge.train.loop import Trainer

    monkeypatch.setattr(Trainer, "fit", lambda *a, **k: pytest.fail("the run started"))
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump({**MINIMAL, "output_dir": str(tmp_path / "run")}))
    args = ["train", str(f), "data.language=xx", "data.languages=[en, Klingon]"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "data.language: unknown language 'xx'" in err
    assert "data.languages.1: unknown language 'Klingon'" in err
    # one value in several fields is one line naming each
    assert main(["train", str(f), "data.languages=[xx]", "selection.language=xx"]) == 2
    assert "data.languages.0, selection.language: unknown language 'xx'" in capsys.readouterr().err
    # the guard's language too, before its set is read
    assert main(["train", str(f), "eval.guard.path=nowhere", "eval.guard.language=Elvish"]) == 2
    assert "eval.guard.language: unknown language 'Elvish'" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
