"""The command line answers `--help` and bad input without importing torch, and lists every
command with the parser its own module builds."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml

from asrforge.cli import average, build_parser, main
from asrforge.errors import ExitCode, UserError

PROBE = """
import sys
from asrforge.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
print("TORCH" if "torch" in sys.modules else "NO-TORCH", code)
"""


def _probe(*argv: str) -> str:
    out = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1]


def test_help_and_a_bad_config_do_not_import_torch(tmp_path):
    assert _probe("--help") == "NO-TORCH 0"
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim:\n  lr: -1\n")
    assert _probe("train", str(bad)) == "NO-TORCH 2"


def _commands(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]  # noqa: SLF001
    return sub


def test_every_command_parser_is_built_without_heavy_imports():
    # each command module imports its domain code when it runs, so the whole parser is cheap
    code = (
        "import sys; from asrforge.cli import build_parser; build_parser(); "
        "print(sorted(m for m in ('torch', 'transformers', 'datasets') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    assert _probe("vocab", "--help") == "NO-TORCH 0"


@pytest.mark.fast
def test_every_command_is_listed_with_its_own_parser():
    commands = _commands(build_parser())
    listed = {c.dest for c in commands._choices_actions}  # noqa: SLF001
    assert listed == set(commands.choices)
    for name, parser in commands.choices.items():
        assert len(parser._actions) > 1 and parser.format_help(), name  # noqa: SLF001


def _train_yaml(tmp_path, **fields) -> str:
    path = tmp_path / "run.yaml"
    data = {"path": str(tmp_path / "tones"), "generate": "tones"}
    path.write_text(yaml.safe_dump({"data": data, "train": {"max_steps": 1}, **fields}))
    return str(path)


@pytest.mark.fast
def test_a_directory_given_as_the_config_is_named_a_directory(tmp_path, capsys):
    (tmp_path / "clips").mkdir()
    assert main(["train", str(tmp_path / "clips")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'clips'}: is a directory, not a config file" in err
    assert "no such file" not in err and "Traceback" not in err


@pytest.mark.fast
def test_an_output_dir_that_is_a_file_is_a_config_error(tmp_path, capsys):
    (tmp_path / "a-file").write_text("mine")
    assert main(["train", _train_yaml(tmp_path, output_dir=str(tmp_path / "a-file"))]) == 2
    err = capsys.readouterr().err
    assert (
        err
        == f"asrforge: error: output_dir: {tmp_path / 'a-file'}: exists and is not a directory\n"
    )
    assert (tmp_path / "a-file").read_text() == "mine"


@pytest.mark.fast
def test_an_empty_output_dir_or_a_config_inside_it_is_refused_before_any_work(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("mine")
    assert main(["train", _train_yaml(tmp_path, output_dir="runs/a"), "output_dir="]) == 2
    assert "output_dir: must name a directory, got an empty value" in capsys.readouterr().err
    # a config kept as the run's own config.yaml would be replaced by the resolved config
    (tmp_path / "runs" / "exp").mkdir(parents=True)
    config = tmp_path / "runs" / "exp" / "config.yaml"
    given = Path(_train_yaml(tmp_path, output_dir="runs/exp")).read_text()
    config.write_text("# my notes\n" + given)
    assert main(["train", str(config)]) == 2
    err = capsys.readouterr().err
    assert "is the run's own config.yaml (output_dir runs/exp)" in err
    assert config.read_text().startswith("# my notes") and sorted(
        p.name for p in tmp_path.iterdir()
    ) == ["notes.txt", "run.yaml", "runs"]


@pytest.mark.fast
def test_a_pretrained_path_that_is_no_model_directory_is_named_before_any_work(
    tmp_path, capsys, monkeypatch, hf_home
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "long.wav").write_bytes(b"RIFF")
    (tmp_path / "clips").mkdir()
    (tmp_path / "clips" / "a.wav").write_bytes(b"RIFF")
    config = _train_yaml(tmp_path, output_dir=str(tmp_path / "run"))
    for given, problem in (
        ("long.wav", "is a file, not a model directory"),
        ("./nomodel", "no such model directory"),
        ("clips", "has no config.json (not a transformers model directory)"),
    ):
        assert main(["train", config, f"model.pretrained={given}"]) == 2
        assert capsys.readouterr().err == f"asrforge: error: model.pretrained: {given}: {problem}\n"
    assert not (tmp_path / "run").exists() and not (tmp_path / "tones").exists()
    # an id that is no local path is still a Hub id: here, offline and not in the cache
    assert main(["train", config, "model.pretrained=openai/whisper-small"]) == 2
    err = capsys.readouterr().err
    assert "hf download openai/whisper-small" in err and "model directory" not in err


@pytest.mark.fast
def test_a_lora_target_typo_is_named_with_the_other_problems_before_any_work(tmp_path, capsys):
    """It used to surface after the data was read, once the model was built and peft refused."""
    pytest.importorskip("peft")
    (tmp_path / "a-file").write_text("mine")
    config = _train_yaml(tmp_path, output_dir=str(tmp_path / "a-file"),
                         model={"lora": {"target_modules": ["q_proj", "v_prj"]}})
    assert main(["train", config]) == 2
    assert capsys.readouterr().err == (
        "asrforge: error: 2 problems:\n"
        f"  output_dir: {tmp_path / 'a-file'}: exists and is not a directory\n"
        "  model.lora.target_modules.1: 'v_prj' names no layer of the model — did you mean "
        "v_proj?\n"
    )
    assert not (tmp_path / "tones").exists()


@pytest.mark.fast
def test_a_data_path_symlink_loop_is_named_and_leaves_nothing(tmp_path, capsys):
    loop = tmp_path / "data" / "tones"
    loop.parent.mkdir()
    loop.symlink_to(loop)
    config = _train_yaml(
        tmp_path, output_dir=str(tmp_path / "run"), data={"path": str(loop), "generate": "tones"}
    )
    assert main(["train", config]) == 2
    assert f"data.path: {loop}: a symlink loop" in capsys.readouterr().err
    assert [p.name for p in loop.parent.iterdir()] == ["tones"]  # no tones.tmp beside it


@pytest.mark.fast
def test_an_output_dir_that_is_the_data_holds_it_or_lies_in_it_is_refused(tmp_path, capsys):
    corpus = tmp_path / "corp"
    corpus.mkdir()
    (corpus / "train.jsonl").write_text("")
    data = {"path": str(corpus)}
    for output_dir, relation in ((corpus, "is"), (corpus / "run", "lies in"), (tmp_path, "holds")):
        config = _train_yaml(tmp_path, output_dir=str(output_dir), data=data)
        assert main(["train", config]) == 2
        err = capsys.readouterr().err
        assert f"output_dir: {output_dir} {relation} data.path {corpus}: keep the run" in err
    assert sorted(p.name for p in corpus.iterdir()) == ["train.jsonl"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corp", "run.yaml"]


@pytest.mark.fast
def test_a_run_started_from_python_refuses_an_output_dir_inside_its_data(tmp_path):
    from asrforge.train.loop import Trainer
    from tests.conftest import tiny_config

    corpus = tmp_path / "corp"
    corpus.mkdir()
    (corpus / "train.jsonl").write_text("")
    with pytest.raises(UserError, match=r"output_dir: .*corp/run lies in data.path .*corp: keep"):
        Trainer(tiny_config(corpus / "run", corpus)).fit()
    assert sorted(p.name for p in corpus.iterdir()) == ["train.jsonl"]


@pytest.mark.fast
def test_every_missing_local_path_is_named_in_one_message_before_any_work(tmp_path, capsys):
    config = _train_yaml(
        tmp_path, output_dir=str(tmp_path / "run"),
        data={"path": str(tmp_path / "corpus"), "replay": {"path": str(tmp_path / "r.jsonl")}},
        model={"tokenizer": str(tmp_path / "tok")},
        eval={"guard": {"path": str(tmp_path / "guard")}},
    )  # fmt: skip
    assert main(["train", config]) == 2
    assert capsys.readouterr().err == (
        "asrforge: error: 4 problems:\n"
        f"  data.path: {tmp_path / 'corpus'} does not exist; data.generate: tones makes a small "
        "one\n"
        f"  data.replay.path: {tmp_path / 'r.jsonl'} does not exist\n"
        f"  eval.guard.path: {tmp_path / 'guard'} does not exist\n"
        f"  model.tokenizer: {tmp_path / 'tok'}: no such tokenizer directory\n"
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.fast
def test_hub_ids_and_urls_are_not_taken_for_missing_local_paths(tmp_path):
    from asrforge.config import load_config
    from asrforge.train.paths import local_path_problems

    for data, replay in (("org/speech", "openslr/librispeech_asr"), ("s3://b/d", "memory://r")):
        cfg = load_config(data={"output_dir": str(tmp_path / "run"),
                                "data": {"path": data, "replay": {"path": replay}}})  # fmt: skip
        assert local_path_problems(cfg) == []


@pytest.mark.fast
def test_every_exit_code_is_in_the_help_and_the_readme():
    epilog = build_parser().epilog
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    listed = " ".join(readme.split("Exit codes: ", 1)[1].split(".\n", 1)[0].split())
    for code in ExitCode:
        assert f"{code:d} {code.meaning}" in epilog
    assert [int(n) for n in re.findall(r"(?:^|, )(\d+) ", listed)] == [int(c) for c in ExitCode]


@pytest.mark.fast
def test_a_ctrl_c_while_torch_imports_exits_130_in_one_line(monkeypatch, capsys):
    """Part of torch stays in sys.modules when its import is cut short; importing it again to
    close a process group failed with a traceback."""
    monkeypatch.setitem(sys.modules, "torch.distributed", types.ModuleType("torch.distributed"))
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    closed = []
    ranks = types.ModuleType("asrforge.train.ranks")
    ranks.close_process_group = lambda: closed.append(True) or True
    monkeypatch.setitem(sys.modules, "asrforge.train.ranks", ranks)

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(average, "run", interrupted)
    assert main(["average", "runs/x"]) == ExitCode.CANCELLED == 130
    assert capsys.readouterr().err == "asrforge: interrupted\n"
    assert closed == []


def test_output_whose_reader_went_away_ends_quietly(tmp_path):
    """`transcribe ... | head -1`: a closed standard output is no error to report."""
    import json
    import os

    import numpy as np
    import soundfile as sf

    from asrforge.bundle import export_bundle
    from tests.test_data_hardening import save_random_whisper

    hf = tmp_path / "hf"
    save_random_whisper(hf)
    gen = hf / "generation_config.json"
    gen.write_text(json.dumps({**json.loads(gen.read_text()), "is_multilingual": False}))
    bundle = export_bundle(hf, tmp_path / "bundle")
    clip = tmp_path / "clip.wav"
    sf.write(clip, np.zeros(16_000, np.float32), 16_000)
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line is written
    root = Path(__file__).resolve().parents[1]
    argv = [sys.executable, "-m", "asrforge", "transcribe", str(bundle), str(clip), str(clip)]
    env = {**os.environ, "PYTHONPATH": str(root)}
    try:
        done = subprocess.run(argv, stdout=write, stderr=subprocess.PIPE, text=True, env=env)
    finally:
        os.close(write)
    assert done.returncode == ExitCode.OUTPUT_CLOSED == 141
    assert "error" not in done.stderr and "Traceback" not in done.stderr
    assert "Exception ignored" not in done.stderr
