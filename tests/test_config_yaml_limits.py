"""YAML asrforge reads from a file is bounded: an alias bomb, nesting past Python's recursion
limit (directly or through a chain of aliases), an alias inside itself, a file not in UTF-8 or of
gigabytes are each one line naming the file (exit code 2), in a second, for a config, a matrix
file, and a checkpoint's or a run's config.yaml."""

from __future__ import annotations

import re
import time

import pytest

from asrforge.cli import main
from asrforge.config import ConfigError, load_config
from asrforge.config.yaml_limits import MAX_DEPTH, MAX_VALUES, load_yaml, read_yaml_text

pytestmark = pytest.mark.fast


def alias_bomb(levels: int = 9, fan: int = 9) -> str:
    """``levels`` anchors, each a list of ``fan`` aliases of the one before: ``fan ** levels``
    values once expanded, in a few hundred bytes."""
    lines = [f"l0: &l0 [{', '.join(['lol'] * fan)}]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * fan)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def alias_chain(n: int) -> str:
    """Each anchor a list holding the one before: nested ``n`` deep once expanded, though no
    line nests more than one level."""
    return "c0: &c0 [0]\n" + "".join(f"c{i}: &c{i} [*c{i - 1}]\n" for i in range(1, n))


BAD_YAML = {
    "bomb": (alias_bomb(), f"more than {MAX_VALUES} values once its aliases"),
    "wide-bomb": (alias_bomb(levels=4, fan=40), f"more than {MAX_VALUES} values"),
    "flow-deep": ("a: " + "[" * 100_000 + "]" * 100_000 + "\n", f"deeper than {MAX_DEPTH}"),
    "block-deep": (
        "".join("  " * i + f"k{i}:\n" for i in range(3000)) + "  " * 3000 + "v: 1\n",
        f"deeper than {MAX_DEPTH}",
    ),
    "alias-chain": (alias_chain(2000), f"deeper than {MAX_DEPTH} levels once its aliases"),
    "recursive": ("a: &a {b: *a}\n", "an alias inside the value it names"),
}


@pytest.mark.parametrize("name", list(BAD_YAML))
def test_bounded_yaml_refuses_in_a_second(name):
    text, why = BAD_YAML[name]
    start = time.perf_counter()
    with pytest.raises(ValueError, match=why):
        load_yaml(text)
    assert time.perf_counter() - start < 5


def test_aliases_within_the_bounds_load_as_yaml_does():
    text = "base: &b {lr: 0.001, steps: [1, 2]}\nrun: *b\nruns: [*b, *b]\n"
    assert load_yaml(text) == {
        "base": {"lr": 0.001, "steps": [1, 2]},
        "run": {"lr": 0.001, "steps": [1, 2]},
        "runs": [{"lr": 0.001, "steps": [1, 2]}] * 2,
    }
    assert load_yaml("") is None
    nested = "a: " + "[" * (MAX_DEPTH - 2) + "1" + "]" * (MAX_DEPTH - 2)
    assert load_yaml(nested)["a"] is not None


@pytest.mark.parametrize(
    "data, offset",
    [(b"seed: 1\nconfig_id: caf\xe9\n", 22), (b"\xff\xfeseed: 1\n", 0), (b"a: \xc3\n", 3)],
)
def test_a_config_not_in_utf8_names_its_first_bad_byte(tmp_path, data, offset):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(data)
    with pytest.raises(ValueError, match=f"not UTF-8 text \\(byte 0x.. at offset {offset}\\)"):
        read_yaml_text(path)
    with pytest.raises(ConfigError, match="latin1.yaml") as e:
        load_config(path)
    assert "not UTF-8" in str(e.value)


def test_a_huge_config_file_is_refused_unread(tmp_path, monkeypatch):
    from asrforge.config import yaml_limits

    monkeypatch.setattr(yaml_limits, "MAX_BYTES", 1000)
    path = tmp_path / "big.yaml"
    path.write_text("a: 1\n" * 1000)
    with pytest.raises(ValueError, match="larger than"):
        read_yaml_text(path)


@pytest.mark.parametrize("name", ["bomb", "flow-deep", "alias-chain"])
@pytest.mark.parametrize("command", ["train", "matrix", "config"])
def test_the_cli_says_one_line_naming_the_file(tmp_path, capsys, name, command):
    path = tmp_path / f"{name}.yaml"
    path.write_text(BAD_YAML[name][0])
    argv = {"train": ["train", str(path)], "matrix": ["matrix", str(path), "--dry-run"],
            "config": ["config", "show", str(path)]}[command]  # fmt: skip
    start = time.perf_counter()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and str(path) in err and BAD_YAML[name][1][:20] in err
    assert time.perf_counter() - start < 10


def test_a_checkpoints_config_yaml_is_bounded_too(tmp_path):
    from asrforge.bundle.contents import read_train_config
    from asrforge.checkpoint.resume import check_resume_config
    from asrforge.errors import UserError

    path = tmp_path / "config.yaml"
    path.write_text(alias_bomb())
    with pytest.raises(UserError, match="config.yaml: not a readable training config: more than"):
        read_train_config(path)
    path.write_bytes(b"seed: \xff\n")
    with pytest.raises(UserError, match="not UTF-8"):
        read_train_config(path)
    with pytest.raises(UserError, match="config.yaml: more than"):
        check_resume_config(None, alias_bomb(), tmp_path)  # refused before the config is used


def test_a_checkpoints_config_yaml_not_in_utf8_is_refused_by_name(tmp_path):
    import torch

    from asrforge.checkpoint.manifest import write_manifest
    from asrforge.checkpoint.training import (
        CheckpointContents,
        capture_rng_state,
        load_training_checkpoint,
        save_training_checkpoint,
    )
    from asrforge.errors import CheckpointCorruptError

    ckpt = save_training_checkpoint(
        tmp_path / "step-000001",
        CheckpointContents(model={"w": torch.zeros(2)}, optimizer={}, scheduler={},
                           rng=capture_rng_state(), train_state={"step": 1},
                           config_yaml="seed: 0\n"),
    )  # fmt: skip
    (ckpt / "config.yaml").write_bytes(b"seed: 0\nconfig_id: \xe9t\xe9\n")
    write_manifest(ckpt, {"step": 1})
    with pytest.raises(CheckpointCorruptError, match="config.yaml: not UTF-8 text"):
        load_training_checkpoint(ckpt)


DUPLICATED = """\
seed: 0
train: {max_steps: 1}
optim:
  lr: 0.001
  lr: 0.01
train: {max_steps: 5}
train: {max_steps: 7}
"""


def test_a_key_given_twice_is_refused_by_its_path_and_lines(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text(DUPLICATED)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    # every duplicate at once, each with its YAML path and the lines that set it
    assert e.value.problems == [
        "train: given 3 times (lines 2, 6 and 7); YAML would keep only the last: give it once",
        "optim.lr: given 2 times (lines 4 and 5); YAML would keep only the last: give it once",
    ]


def test_keys_are_told_apart_by_their_mapping_and_a_merge_may_be_overridden():
    text = "a: {x: 1}\nb: {x: 2}\nbase: &b {lr: 1}\nrun: {<<: *b, lr: 2}\nl: [{k: 1, k: 2}]\n"
    with pytest.raises(ValueError, match=r"^l\.0\.k: given 2 times \(line 5\)"):
        load_yaml(text)
    assert load_yaml(text.replace("k: 2", "j: 2"))["run"] == {"lr": 2}
    # an anchored mapping is named where it is written, not where an alias repeats it
    with pytest.raises(ValueError, match=r"^anchored\.k: given 2 times \(line 1\)[^;]*; YAML"):
        load_yaml("anchored: &x {k: 1, k: 2}\nlater: *x\n")


def test_an_overrides_value_with_a_key_twice_is_refused(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("seed: 0\n")
    with pytest.raises(ConfigError) as e:
        load_config(path, ["train={max_steps: 1, max_steps: 2}"])
    assert e.value.problems == [
        "train.max_steps: given 2 times; YAML would keep only the last: give it once"]


@pytest.mark.parametrize("command", ["train", "matrix", "config"])
def test_the_cli_refuses_a_duplicate_key_in_a_config_and_a_matrix_file(tmp_path, capsys, command):
    path = tmp_path / "dup.yaml"
    path.write_text("languages: [en]\nlanguages: [es]\n" if command == "matrix" else DUPLICATED)
    argv = {"train": ["train", str(path)], "matrix": ["matrix", str(path), "--dry-run"],
            "config": ["config", "show", str(path)]}[command]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and str(path) in err
    key = "languages" if command == "matrix" else "train"
    assert f"{key}: given " in err and "lines " in err


def test_a_config_that_is_a_symlink_loop_is_named_as_one(tmp_path):
    loop = tmp_path / "loop1.yaml"
    loop.symlink_to(tmp_path / "loop2.yaml")
    (tmp_path / "loop2.yaml").symlink_to(loop)
    with pytest.raises(ConfigError, match="loop1.yaml: a symlink loop"):
        load_config(loop)
    dangling = tmp_path / "gone.yaml"
    dangling.symlink_to(tmp_path / "nowhere.yaml")
    with pytest.raises(ConfigError, match="gone.yaml: a broken symlink"):
        load_config(dangling)


@pytest.mark.parametrize("name", ["bomb", "flow-deep", "alias-chain"])
def test_a_data_sets_readme_header_is_bounded_locally_and_by_url(tmp_path, name):
    from fsspec.implementations.memory import MemoryFileSystem

    from asrforge.config import DataConfig
    from asrforge.data.sources import load_source
    from asrforge.errors import UserError

    text, why = BAD_YAML[name]
    readme = f"---\n{text}configs:\n- config_name: default\n  data_files: x.jsonl\n---\n# A\n"
    (tmp_path / "README.md").write_text(readme)
    MemoryFileSystem().pipe(f"/{tmp_path.name}/README.md", readme.encode())
    for path, named in [(tmp_path, tmp_path / "README.md"),
                        (f"memory://{tmp_path.name}", f"memory:///{tmp_path.name}/README.md")]:
        start = time.perf_counter()
        with pytest.raises(UserError, match=re.escape(f"{named}: YAML header: ") + ".*" + why):
            load_source(DataConfig(path=path))
        assert time.perf_counter() - start < 5


def test_a_data_sets_readme_header_is_read_as_datasets_reads_it(tmp_path):
    from asrforge.data.locate import declared_configs
    from asrforge.errors import UserError

    readme = tmp_path / "README.md"
    # Trainer's cards give tags twice; huggingface_hub keeps the later, and so does asrforge
    readme.write_text("---\ntags:\n- a\nconfigs:\n- config_name: default\n"
                      "  data_files: x.jsonl\ntags:\n- b\n---\n# A\n")
    assert declared_configs(readme) == {"default": {"train": ["x.jsonl"]}}
    # what PyYAML cannot parse, datasets refuses too (DatasetCard's yaml.safe_load raises)
    readme.write_text("---\nconfigs: [\n---\n# A\n")
    with pytest.raises(UserError, match=re.escape(f"{readme}: YAML header: not valid YAML")):
        declared_configs(readme)


def test_the_base_models_card_lends_its_license_or_is_warned_of(tmp_path, caplog):
    from asrforge.bundle.card import _base_license

    card = tmp_path / "README.md"
    card.write_text("---\nlicense: mit\n---\n# A model\n")
    assert _base_license(str(tmp_path), None) == "mit"
    # a Trainer-generated card gives tags twice: read as huggingface_hub reads it
    card.write_text("---\ntags:\n- a\nlicense: apache-2.0\ntags:\n- b\n---\n")
    assert _base_license(str(tmp_path), None) == "apache-2.0"
    # a card beyond the bounds is still not loaded, but only costs the export its license
    for header, why in [(f"{alias_bomb()}license: *l8\n", f"more than {MAX_VALUES} values"),
                        (BAD_YAML["flow-deep"][0], f"deeper than {MAX_DEPTH} levels \\(line 2\\)"),
                        ("license: [\n", "not valid YAML")]:
        card.write_text(f"---\n{header}---\n")
        caplog.clear()
        assert _base_license(str(tmp_path), None) is None
        assert re.search(re.escape(f"{card}: the base model's card, read for its license: ")
                         + f".*{why}.*the model card names no license", caplog.text, re.S)
