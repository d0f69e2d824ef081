"""`asrforge config fields` / `config show`: generated from the schema, complete, round-tripping."""

from __future__ import annotations

from pathlib import Path

import yaml

from asrforge.cli import main
from asrforge.config import load_config
from asrforge.config_reference import field_docs

ROOT = Path(__file__).resolve().parents[1]


def _leaf_paths(data: dict, prefix: str = "") -> set[str]:
    paths = set()
    for key, value in data.items():
        if isinstance(value, dict) and value:
            paths |= _leaf_paths(value, f"{prefix}{key}.")
        else:
            paths.add(f"{prefix}{key}")
    return paths


def test_every_field_of_a_resolved_config_is_in_the_reference():
    cfg = load_config(ROOT / "configs" / "tiny.yaml")
    listed = {row.path for row in field_docs()}
    missing = _leaf_paths(cfg.model_dump(mode="json", exclude={"callbacks"})) - listed
    assert not missing
    assert {"callbacks[].name", "callbacks[]._target_", "checkpoint.keep_best[].metric"} <= listed
    assert "selection.groups.<name>.policy" in listed


def test_fields_prints_type_default_and_description(capsys):
    assert main(["config", "fields", "optim"]) == 0
    out = capsys.readouterr().out
    assert "optim.lr: float = 0.001\n    Peak learning rate." in out
    assert "optim.schedule: 'cosine' | 'linear' | 'constant' = cosine" in out
    assert "data." not in out


def test_fields_of_an_unknown_section_is_a_user_error(capsys):
    assert main(["config", "fields", "optimizer"]) == 2
    assert "no config field under 'optimizer'" in capsys.readouterr().err


def test_show_prints_the_resolved_config_with_overrides_and_defaults(capsys):
    path = ROOT / "configs" / "tiny.yaml"
    assert main(["config", "show", str(path), "optim.lr=2e-4"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["optim"]["lr"] == 2e-4
    assert shown["eval"]["max_new_tokens"] == load_config(path).eval.max_new_tokens  # a default
    assert load_config(data=shown) == load_config(path, ["optim.lr=2e-4"])
