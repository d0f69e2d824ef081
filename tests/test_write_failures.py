"""A file a run cannot write (a full disk, a file where a directory should be) stops it with one
message naming the file and the checkpoint that is intact: no traceback, exit code 1."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from asrforge.cli import main
from asrforge.io import append
from asrforge.train import setup as train_setup
from tests.conftest import tiny_config


def _full_disk_under(monkeypatch, name: str) -> None:
    """Every write appended to the run's ``name`` fails with ENOSPC, as on a full disk (reading
    it back still works, as there)."""
    real = append.open_no_follow

    def open_no_follow(path, flags, mode=0o666):
        if Path(path).name == name and flags & os.O_APPEND:
            return os.open("/dev/full", os.O_WRONLY)
        return real(path, flags, mode)

    monkeypatch.setattr(append, "open_no_follow", open_no_follow)


def _config_file(tmp_path, tones_dir, **sections):
    path = tmp_path / "cfg.yaml"
    path.write_text(tiny_config(tmp_path / "run", tones_dir, **sections).to_yaml())
    return path


def _eval_is_a_file(run):
    (run / "eval").write_text("")  # where eval/step-000002.jsonl's directory goes
    return f"{run / 'eval'}: File exists"


def _eval_records_are_a_directory(run):
    (run / "eval" / "step-000002.jsonl").mkdir(parents=True)  # the atomic rename onto it fails
    return f"could not write {run / 'eval' / 'step-000002.jsonl'}: Is a directory (errno 21)"


@pytest.mark.parametrize("obstacle", [_eval_is_a_file, _eval_records_are_a_directory])
def test_a_failed_write_mid_run_stops_it_with_one_message(
    tmp_path, tones_dir, capsys, monkeypatch, obstacle
):
    cfg = _config_file(
        tmp_path,
        tones_dir,
        train={"max_steps": 3},
        eval={"eval_steps": 2, "max_new_tokens": 2},
        checkpoint={"checkpoint_every": 1},
    )
    run = tmp_path / "run"
    run.mkdir()
    what = obstacle(run)
    _full_disk_under(monkeypatch, "train.log")
    assert main(["train", str(cfg)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Logging error" not in err
    stopped = [line for line in err.splitlines() if line.startswith("asrforge: run stopped")]
    assert stopped == [
        f"asrforge: run stopped: {what}; the checkpoint {run / 'checkpoints' / 'step-000001'} "
        "is intact (--resume continues from it)"
    ]
    # train.log's failure: one line, then the log goes on on stderr
    assert err.count(f"cannot write {run / 'train.log'}") == 1
    assert "INFO checkpoints: saved step-000001" in err


@pytest.mark.fast
def test_a_full_disk_under_a_logger_stops_the_run(tmp_path, tones_dir, capsys, monkeypatch):
    cfg = _config_file(tmp_path, tones_dir, train={"max_steps": 2})
    run = tmp_path / "run"
    run.mkdir()
    _full_disk_under(monkeypatch, "metrics.jsonl")
    assert main(["train", str(cfg)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    stopped = [line for line in err.splitlines() if line.startswith("asrforge: run stopped")]
    assert stopped == [
        f"asrforge: run stopped: {run / 'metrics.jsonl'}: No space left on device; "
        "no checkpoint was written"
    ]


@pytest.mark.fast
@pytest.mark.parametrize(
    "error",
    [
        Exception("No space left on device (os error 28)"),  # what tokenizers' Rust writer raises
        OSError(errno.ENOSPC, "No space left on device"),
    ],
)
def test_a_full_disk_at_start_up_is_one_clear_error(
    tmp_path, tones_dir, monkeypatch, capsys, error
):
    real = train_setup.build_tokenizer

    def build_tokenizer(*args, **kwargs):
        tokenizer = real(*args, **kwargs)

        def save_pretrained(*_a, **_k):
            raise error

        tokenizer.save_pretrained = save_pretrained
        return tokenizer

    monkeypatch.setattr(train_setup, "build_tokenizer", build_tokenizer)
    cfg = _config_file(tmp_path, tones_dir, train={"max_steps": 1})
    assert main(["train", str(cfg)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    tokenizer = tmp_path / "run" / "tokenizer"
    assert f"asrforge: run stopped: could not write {tokenizer}: No space left on device" in err
    assert "the run stopped before its first step" in err
    assert not (tmp_path / "run" / "tokenizer").exists()  # nothing half-written


@pytest.mark.parametrize("room", [0, 100, 700])
def test_a_disk_filling_up_inside_a_torch_file_stops_the_run_with_one_message(
    tmp_path, tones_dir, capsys, monkeypatch, room
):
    """The disk fills ``room`` bytes into step 2's optimizer.pt: torch's zip writer then raised
    "unexpected pos" over the OSError, and two tracebacks ended the run."""
    real = os.write

    def write(fd, data):
        name = os.readlink(f"/proc/self/fd/{fd}")
        if "step-000002" in name and name.endswith("optimizer.pt"):
            left = room - os.fstat(fd).st_size
            if left <= 0:
                raise OSError(errno.ENOSPC, "No space left on device")
            data = memoryview(data)[:left]
        return real(fd, data)

    monkeypatch.setattr(os, "write", write)
    cfg = _config_file(
        tmp_path, tones_dir, train={"max_steps": 3}, eval={"eval_steps": None},
        checkpoint={"checkpoint_every": 1},
    )
    assert main(["train", str(cfg)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "unexpected pos" not in err
    run = tmp_path / "run"
    stopped = [line for line in err.splitlines() if line.startswith("asrforge: run stopped")]
    assert len(stopped) == 1, err
    assert stopped[0].startswith(
        f"asrforge: run stopped: could not write {run / 'checkpoints' / 'step-000002'}: No space "
        "left on device (errno 28)"
    )
    assert stopped[0].endswith(
        f"the checkpoint {run / 'checkpoints' / 'step-000001'} is intact (--resume continues "
        "from it)"
    )
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step-000001"]


def test_a_full_disk_under_a_checkpoints_tokenizer_stops_the_run_with_one_message(
    tmp_path, tones_dir, monkeypatch, capsys
):
    """The tokenizers library reports a failed write as a bare Exception: in a checkpoint's
    tokenizer/ it escaped the one-line report."""
    real = train_setup.build_tokenizer

    def build_tokenizer(*args, **kwargs):
        tokenizer = real(*args, **kwargs)
        save = tokenizer.save_pretrained

        def save_pretrained(directory, *a, **k):
            if "step-000002" in str(directory):
                raise Exception("No space left on device (os error 28)")  # noqa: TRY002
            return save(directory, *a, **k)

        tokenizer.save_pretrained = save_pretrained
        return tokenizer

    monkeypatch.setattr(train_setup, "build_tokenizer", build_tokenizer)
    cfg = _config_file(
        tmp_path, tones_dir, train={"max_steps": 3}, eval={"eval_steps": None},
        checkpoint={"checkpoint_every": 1},
    )
    assert main(["train", str(cfg)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    run = tmp_path / "run"
    stopped = [line for line in err.splitlines() if line.startswith("asrforge: run stopped")]
    assert stopped == [
        f"asrforge: run stopped: could not write {run / 'checkpoints' / 'step-000002'}: No space "
        f"left on device (errno 28); the checkpoint {run / 'checkpoints' / 'step-000001'} is "
        "intact (--resume continues from it)"
    ]
