"""Stopping a run of several processes (torchrun, two CPU ranks): a SIGTERM to the launcher or to
one rank alone, and a data error met by one rank, stop every rank at the same step, without a
crash of a DataLoader worker and without a rank left waiting in a collective."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from asrforge.checkpoint.manifest import verify
from asrforge.config import DataConfig
from tests.conftest import tiny_config
from tests.test_sources import by_split, write_jsonl
from tests.test_stream import epoch_uids, open_split, tok_specials  # noqa: F401

TIMEOUT = 180  # seconds: a hang fails the test, not the session


def torchrun(cfg_path: Path, *launcher: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
               "2", *launcher, "-m", "asrforge", "train", str(cfg_path)]  # fmt: skip
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        # torchrun stops its ranks (SIGTERM, then SIGKILL after its grace period)
        proc.terminate()
        proc.communicate(timeout=120)
        raise AssertionError("the run hung: a rank waits for another one") from None


def wait_for_steps(run_dir: Path, steps: int) -> None:
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + TIMEOUT
    while time.time() < deadline:
        if metrics.exists() and metrics.read_text().count('"event": "train"') >= steps:
            return
        time.sleep(0.2)
    raise AssertionError(f"no {steps} steps in {TIMEOUT} s")


def rank_pid(launcher: int, rank: int) -> int:
    """The pid of torchrun's child process of ``rank`` (by its RANK environment variable)."""
    children = Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()
    for pid in children:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in env:
            return int(pid)
    raise AssertionError(f"no rank {rank} among {children}")


def rank_exit_codes(stderr: str) -> dict[int, int]:
    """Each rank's exit code, from torchrun's failure summary (which repeats the first one)."""
    found = re.findall(r"rank\s*:\s*(\d+) \(local_rank.*\n\s*exitcode\s*:\s*(-?\d+)", stderr)
    return {int(rank): int(code) for rank, code in found}


def rank_traceback(stderr: str) -> bool:
    """A rank printed a traceback through asrforge's code (a crash, not the graceful stop)."""
    return re.search(r'File ".*/asrforge/', stderr) is not None


def write_config(tmp_path: Path, data_dir: Path, **sections) -> Path:
    cfg = tiny_config(tmp_path / "run", data_dir, **sections)
    path = tmp_path / "cfg.yaml"
    path.write_text(cfg.to_yaml())
    return path


def interrupted_steps(stderr: str) -> list[int]:
    """The step each rank reports it stopped at ("run interrupted at step N")."""
    return [int(n) for n in re.findall(r"run interrupted at step (\d+)", stderr)]


def assert_saved_and_resumable(tmp_path: Path, cfg_path: Path) -> int:
    latest = tmp_path / "run" / "checkpoints" / "latest"
    manifest = verify(latest)
    state = json.loads((latest / "train_state.json").read_text())
    assert manifest["step"] == state["step"] >= 2
    # the checkpoint resumes (two ranks again) and the run completes from it
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node", "2", "-m", "asrforge", "train", str(cfg_path),
                           "--resume", "train.max_steps=" + str(state["step"] + 2)],
                          capture_output=True, text=True, timeout=TIMEOUT)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"at step {state['step']} (epoch" in (tmp_path / "run" / "train.log").read_text()
    return state["step"]


def test_sigterm_to_torchrun_saves_one_checkpoint_every_rank_exits_interrupted(tmp_path, tones_dir):
    # DataLoader workers (num_workers 1): torchrun signals each rank's process group, workers too
    cfg_path = write_config(tmp_path, tones_dir, data={"num_workers": 1},
                            train={"max_steps": 100000, "log_every": 1},
                            eval={"eval_steps": None, "at_end": False})  # fmt: skip
    proc = torchrun(cfg_path)
    wait_for_steps(tmp_path / "run", 3)
    proc.send_signal(signal.SIGTERM)
    _, stderr = finish(proc)
    assert "killed by signal" not in stderr, stderr[-3000:]
    # every rank took the graceful path (no traceback of a rank, the step saved); torchrun itself
    # exits 1: it ends with its own SignalException, not with its ranks' exit codes (75 each)
    assert not rank_traceback(stderr), stderr[-3000:]
    assert proc.returncode == 1
    assert "SIGTERM received" in stderr
    step = assert_saved_and_resumable(tmp_path, cfg_path)
    assert f"run interrupted at step {step}: received SIGTERM" in stderr


def test_a_signal_to_one_rank_stops_both_at_the_same_step(tmp_path, tones_dir):
    cfg_path = write_config(tmp_path, tones_dir, train={"max_steps": 100000, "log_every": 1},
                            eval={"eval_steps": None, "at_end": False})  # fmt: skip
    proc = torchrun(cfg_path)
    wait_for_steps(tmp_path / "run", 3)
    os.kill(rank_pid(proc.pid, 1), signal.SIGTERM)  # rank 1 alone: rank 0 has no signal
    _, stderr = finish(proc)
    # both ranks exited via the graceful path, at the same step, and saved it: rank 0 (rank 1's
    # exit may come after torchrun's report, which then stops it) exits 75; torchrun exits 1
    assert rank_exit_codes(stderr)[0] == 75, stderr[-3000:]
    assert set(rank_exit_codes(stderr).values()) <= {75, -15}, stderr[-3000:]
    assert not rank_traceback(stderr), stderr[-3000:]
    assert proc.returncode == 1
    step = assert_saved_and_resumable(tmp_path, cfg_path)
    log = (tmp_path / "run" / "train.log").read_text()  # rank 0's, which got no signal
    assert f"run interrupted at step {step}: received SIGTERM" in log


def test_a_tokenless_language_in_one_ranks_stream_stops_every_rank_with_it(
    tmp_path,
    clips,
    tok_specials,  # noqa: F811
):
    root = tmp_path / "corpus"
    train = by_split(clips, "train")
    rows = [{"audio_filepath": r["file"], "text": r["text"], "lang": r["language"],
             "id": f"u{i}"} for i, r in enumerate(train)]  # fmt: skip
    write_jsonl(root / "m.jsonl", rows)
    write_jsonl(root / "dev.jsonl", [{"audio": r["file"], "text": r["text"],
                                      "language": r["language"]}
                                     for r in by_split(clips, "validation")])  # fmt: skip
    data = {"path": str(root / "m.jsonl"), "batch_size": 4,
            "stream": {"enabled": True, "shard_rows": 10, "eval_path": str(root / "dev.jsonl")}}  # fmt: skip
    # a row of rank 1's third batch outside the first shard (checked before training) becomes
    # a language without a token: met mid-stream, by rank 1 only
    rank1 = epoch_uids(open_split(DataConfig(**data), tok_specials), tmp_path, rank=1, world=2)
    victim = next(int(u[1:]) for u in rank1[2] if int(u[1:]) >= 10)
    rows[victim]["lang"] = "Klingon"
    write_jsonl(root / "m.jsonl", rows)
    cfg_path = write_config(tmp_path, root, data=data, train={"max_steps": 100, "max_epochs": 2},
                            eval={"eval_steps": None, "at_end": False})  # fmt: skip
    logs = tmp_path / "logs"  # each rank's stderr in a file of its own
    proc = torchrun(cfg_path, "--log-dir", str(logs), "--redirects", "2")
    _, stderr = finish(proc)
    # rank 0, whose data had no such row, stops with rank 1's error; rank 1 too (or torchrun,
    # seeing rank 0 fail first, stops it)
    (rank0,) = logs.glob("*/attempt_0/0/stderr.log")
    assert "language 'Klingon' (1 utterance) has no token" in rank0.read_text()
    codes = rank_exit_codes(stderr)
    assert set(codes.values()) <= {2, -15} and 2 in codes.values(), stderr[-3000:]
    assert not rank_traceback(stderr + rank0.read_text()), stderr[-3000:]
    assert proc.returncode == 1  # torchrun: a rank failed
    assert not (tmp_path / "run" / "checkpoints" / "latest").exists()


def test_a_launchers_signal_while_a_worker_starts_does_not_kill_it():
    import signal
    import subprocess
    import time

    from asrforge.data.workers import StopSignalLoader, ignore_stop_signals

    def slow_start(worker_id: int) -> None:
        time.sleep(1.0)  # the window between the fork and ignoring the signals, widened
        ignore_stop_signals(worker_id)

    loader = StopSignalLoader(
        list(range(6)), batch_size=2, num_workers=1, worker_init_fn=slow_start
    )
    batches = iter(loader)
    worker = batches._workers[0].pid
    # a launcher's signal comes from another process, not the worker's parent
    subprocess.run(["kill", "-TERM", str(worker)], check=True)
    assert [b.tolist() for b in batches] == [[0, 1], [2, 3], [4, 5]]
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == set()  # this process's mask restored


# Two ranks on gloo, as accelerate starts them under torchrun: a BPE from scratch whose every
# training row data.languages leaves out. Rank zero finds that; each rank prints what it raised.
TOKENIZER_RANK = """
import sys
from datetime import timedelta
from pathlib import Path

from accelerate import PartialState
from datasets import Dataset

from asrforge.train.ranks import close_process_group
from asrforge.train.setup import run_tokenizer
from asrforge.train.setup_data import SplitTexts
from tests.conftest import tiny_config

state = PartialState(cpu=True, backend="gloo", timeout=timedelta(seconds=60))
tmp = Path(sys.argv[1])
cfg = tiny_config(tmp / "run", tmp / "corpus", data={"languages": ["Zulu"]})
rows = Dataset.from_dict({"text": ["an orchard"], "language": ["en"]})
try:
    run_tokenizer(cfg, tmp / "run", state, SplitTexts(cfg.data, rows, rows))
    print("built")
except Exception as e:
    print(type(e).__name__, e)
close_process_group()
"""


def test_a_tokenizer_error_on_rank_zero_is_raised_on_every_rank(tmp_path):
    """The other ranks raise rank zero's error instead of dying on its lost connection."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1", "PYTHONPATH": ":".join(sys.path)}  # fmt: skip
        procs.append(subprocess.Popen(
            [sys.executable, "-c", TOKENIZER_RANK, str(tmp_path)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        ))  # fmt: skip
    outs = [p.communicate(timeout=TIMEOUT) for p in procs]
    printed = [out.strip().splitlines()[-1] if out.strip() else err[-1500:] for out, err in outs]
    assert printed[0].startswith("UserError") and "Zulu" in printed[0], printed
    assert printed[1] == printed[0]
    assert not (tmp_path / "run" / "tokenizer").exists()
