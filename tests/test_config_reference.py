"""`asrforge config fields` / `config show` / `train --help`: generated from the schema, complete,
round-tripping."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from schema_fields import schema_fields

from asrforge.cli import main
from asrforge.config import TrainConfig, load_config
from asrforge.config.reference import field_docs
from asrforge.matrix.plan import MatrixConfig

pytestmark = pytest.mark.fast

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


def test_show_under_a_pretrained_model_prints_only_the_shape_fields_set(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    config = {"output_dir": "runs/x", "data": {"path": "data"}, "model": {"pretrained": "base"}}
    path.write_text(yaml.safe_dump(config))
    assert main(["config", "show", str(path), "model.decoder_layers=3"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)["model"]
    # the pretrained model's shape is not the from-scratch defaults
    assert "d_model" not in shown and "encoder_layers" not in shown
    assert shown["decoder_layers"] == 3 and shown["pretrained"] == "base"


def _help(argv: list[str], capsys) -> list[str]:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    return capsys.readouterr().out.splitlines()


def _field_lines(lines: list[str]) -> dict[str, tuple[str, str]]:
    """The field list of a --help page: {path: (header line, description joined)}."""
    fields: dict[str, tuple[str, str]] = {}
    path = None
    for line in lines:
        if line.startswith("    ") and path is not None:
            head, text = fields[path]
            fields[path] = (head, f"{text} {line.strip()}".strip())
        elif ": " in line and not line.startswith(" "):
            path = line.split(": ", 1)[0]
            fields[path] = (line, "")
        else:
            path = None
    return fields


def _yaml(value) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


@pytest.mark.parametrize(
    "schema, argv",
    [(TrainConfig, ["train", "--help"]), (MatrixConfig, ["matrix", "--help"])],
    ids=["train", "matrix"],
)
def test_help_lists_every_field_with_its_description(schema, argv, capsys):
    fields = _field_lines(_help(argv, capsys))
    for path, info in schema_fields(schema):
        assert path in fields, f"{path} is not in `asrforge {' '.join(argv)}`"
        words = " ".join(info.description.split()).replace("``", "`")
        assert fields[path][1] == words, path


def test_train_help_shows_each_fields_type_and_default(capsys):
    fields = _field_lines(_help(["train", "--help"], capsys))
    # every value of a minimal config, once resolved, is a default
    resolved = load_config(data={"output_dir": "runs/x", "data": {"path": "d"}})
    defaults = resolved.model_dump(mode="json", exclude={"output_dir": True, "data": {"path"}})
    leaves = _leaf_paths(defaults)
    assert len(leaves) > 80
    for path in leaves:
        value = _value_at(defaults, path)
        assert path in fields, f"{path} is not in `asrforge train --help`"
        assert fields[path][0].endswith(f" = {_yaml(value)}"), (path, fields[path][0])
    assert fields["optim.lr"][0] == "optim.lr: float = 0.001"
    assert fields["eval.guard.path"][0] == "eval.guard.path: Path = (required)"
    assert fields["data"][0] == "data: section (required)"


def _value_at(data: dict, path: str):
    for key in path.split("."):
        data = data[key]
    return data
