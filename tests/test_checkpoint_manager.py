"""The checkpoints directory: latest, best, top-k, rotation, recovery, and SIGKILL at any moment."""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from asrforge.checkpoint.manager import CheckpointManager, metric_dir_name
from asrforge.checkpoint.manifest import read_manifest, verify
from asrforge.checkpoint.resume import find_resume_checkpoint
from asrforge.checkpoint.training import (
    CheckpointContents,
    capture_rng_state,
    load_training_checkpoint,
)
from asrforge.config import TopKSpec
from asrforge.errors import CheckpointSaveError, UserError
from asrforge.io import atomic


def _writer(step: int):
    def write(d: Path) -> None:
        (d / "weights.bin").write_bytes(step.to_bytes(4, "little") * 64)
        (d / "tokenizer").mkdir()
        (d / "tokenizer" / "vocab.txt").write_text(f"step {step}\n")

    return write


def _step_of(d: Path) -> int:
    return read_manifest(d)["step"]


def _step_dirs(root: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in root.glob("step-*"))


@pytest.mark.fast
def test_layout_latest_and_best(tmp_path):
    m = CheckpointManager(tmp_path, save_total_limit=None, keep_best=[])
    p1 = m.save(1, _writer(1), {"wer": 0.5}, is_best=True)
    assert p1 == tmp_path / "step-000001"
    m.save(20, _writer(20), {"wer": 0.7}, is_best=False)
    assert os.readlink(tmp_path / "latest") == "step-000020"
    assert m.latest() == tmp_path / "step-000020"
    assert _step_of(tmp_path / "best") == 1 and verify(tmp_path / "best")["metrics"] == {"wer": 0.5}
    # best/ shares the step directory's inodes (hard links), it does not copy them.
    assert os.path.samefile(tmp_path / "best" / "weights.bin", p1 / "weights.bin")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "best",
        "latest",
        "step-000001",
        "step-000020",
    ]


@pytest.mark.fast
@pytest.mark.parametrize("keep_start", [True, False])
def test_a_kept_start_survives_rotation_and_pruning_and_is_not_resumed(tmp_path, keep_start):
    def write(step: int):
        def with_resume_state(d: Path) -> None:
            _writer(step)(d)
            (d / "optimizer.pt").write_bytes(b"resume only")

        return with_resume_state

    m = CheckpointManager(tmp_path, save_total_limit=1, keep_start=keep_start)
    for step in range(4):
        m.save(step, write(step), {"wer": 0.9 - step / 10}, is_best=True)
    assert (0 in _step_dirs(tmp_path)) == keep_start
    m.prune_after_run()
    assert _step_dirs(tmp_path) == ([0] if keep_start else [])
    if keep_start:
        assert sorted(os.listdir(tmp_path / "step-000000")) == [
            "manifest.json", "tokenizer", "weights.bin"
        ]  # fmt: skip
    for resume in (True, False):
        with pytest.raises(UserError, match="holds a finished run whose checkpoints were pruned"):
            find_resume_checkpoint(m, resume=resume)


def test_rotation_never_deletes_best_or_topk_sources(tmp_path):
    specs = [TopKSpec(metric="wer", k=2, mode="min"), TopKSpec(metric="acc", k=1, mode="max")]
    m = CheckpointManager(tmp_path, save_total_limit=2, keep_best=specs)
    rng = random.Random(0)
    history = {}
    best_loss = float("inf")
    for step in range(1, 41):
        wer, acc, loss = rng.random(), rng.random(), rng.random()
        history[step] = (wer, acc)
        is_best = loss < best_loss  # a policy different from either top-k metric
        best_loss = min(best_loss, loss)
        m.save(step, _writer(step), {"wer": wer, "acc": acc, "loss": loss}, is_best=is_best)

        on_disk = _step_dirs(tmp_path)
        want_wer = sorted(history, key=lambda s: (history[s][0], s))[:2]
        want_acc = sorted(history, key=lambda s: (-history[s][1], s))[:1]
        protected = {*want_wer, *want_acc, m.best_step}
        assert protected <= set(on_disk), (step, protected, on_disk)
        assert step in on_disk and os.readlink(tmp_path / "latest") == f"step-{step:06d}"
        assert len(set(on_disk) - protected) <= 2
        ranks = range(1, len(want_wer) + 1)
        assert [_step_of(tmp_path / f"best-wer-{r}") for r in ranks] == want_wer
        assert _step_of(tmp_path / "best-acc-1") == want_acc[0]
        assert _step_of(tmp_path / "best") == m.best_step
    for d in tmp_path.iterdir():
        if d.is_dir() and not d.is_symlink():
            verify(d)
    assert not (tmp_path / "best-wer-3").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.fast
def test_topk_ranks_min_and_max(tmp_path):
    specs = [TopKSpec(metric="wer", k=3, mode="min"), TopKSpec(metric="bleu", k=2, mode="max")]
    m = CheckpointManager(tmp_path, save_total_limit=None, keep_best=specs)
    values = {1: (0.30, 10.0), 2: (0.10, 30.0), 3: (0.20, 20.0), 4: (0.40, 40.0), 5: (0.10, 5.0)}
    for step, (wer, bleu) in values.items():
        m.save(step, _writer(step), {"wer": wer, "bleu": bleu, "n": 10})
    # Ties rank the earlier step first (step 2 before step 5 at wer 0.10).
    assert [_step_of(tmp_path / metric_dir_name("wer", r)) for r in (1, 2, 3)] == [2, 5, 3]
    assert [_step_of(tmp_path / metric_dir_name("bleu", r)) for r in (1, 2)] == [4, 2]
    assert [e["step"] for e in m.top_k["wer"]] == [2, 5, 3]
    assert not (tmp_path / "best").exists()  # is_best was never set
    # A non-finite metric never enters the top-k.
    m.save(6, _writer(6), {"wer": float("nan"), "bleu": float("inf")})
    assert [e["step"] for e in m.top_k["wer"]] == [2, 5, 3]


@pytest.mark.fast
def test_corrupt_newest_falls_back_and_logs(tmp_path, caplog):
    m = CheckpointManager(tmp_path, save_total_limit=None)
    for step in (1, 2, 3):
        m.save(step, _writer(step))
    newest = tmp_path / "step-000003" / "weights.bin"
    data = newest.read_bytes()
    newest.write_bytes(data[:-1] + bytes([data[-1] ^ 0x01]))
    (tmp_path / "step-000004").mkdir()  # incomplete: no manifest
    with caplog.at_level(logging.WARNING):
        assert m.latest_valid() == tmp_path / "step-000002"
    text = caplog.text
    assert "step-000004" in text and "manifest.json is missing" in text
    assert "step-000003" in text and "weights.bin: sha256" in text


@pytest.mark.fast
def test_stale_temporaries_are_cleaned_by_the_writer_only(tmp_path, caplog):
    m = CheckpointManager(tmp_path)
    m.save(1, _writer(1), is_best=True)
    (tmp_path / ".tmp-step-000002-4242-abcd").mkdir()
    (tmp_path / ".tmp-step-000002-4242-abcd" / "model.safetensors").write_bytes(b"half")
    (tmp_path / ".tmp-latest-4242-0000").symlink_to("step-000001")
    os.rename(tmp_path / "best", tmp_path / ".old-best-4242-beef")  # killed mid-replacement
    observer = CheckpointManager(tmp_path)  # only reads: a live writer's temporaries survive it
    assert observer.latest_valid() == tmp_path / "step-000001"
    assert (tmp_path / ".tmp-step-000002-4242-abcd" / "model.safetensors").exists()
    assert (tmp_path / ".old-best-4242-beef").exists()
    with caplog.at_level(logging.WARNING):
        CheckpointManager(tmp_path).recover()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best", "latest", "step-000001"]
    assert _step_of(tmp_path / "best") == 1
    assert "restored" in caplog.text and ".tmp-step-000002-4242-abcd" in caplog.text


@pytest.mark.fast
def test_state_dict_round_trip_and_manifest_copy(tmp_path):
    spec = [TopKSpec(metric="wer", k=2)]
    m = CheckpointManager(tmp_path, save_total_limit=2, keep_best=spec)
    for step, wer in ((1, 0.5), (2, 0.2), (3, 0.4)):
        m.save(step, _writer(step), {"wer": wer}, is_best=wer < 0.45)
    state = json.loads(json.dumps(m.state_dict()))
    assert state["best_step"] == 3 and [e["step"] for e in state["top_k"][0]["entries"]] == [2, 3]
    # The manifest of a checkpoint holds the state *including* that checkpoint.
    assert read_manifest(tmp_path / "step-000003")["checkpoint_manager"] == state

    resumed = CheckpointManager(tmp_path, save_total_limit=2, keep_best=spec)
    resumed.load_state_dict(read_manifest(resumed.latest_valid())["checkpoint_manager"])
    assert resumed.state_dict() == state
    resumed.save(4, _writer(4), {"wer": 0.3})
    assert [e["step"] for e in resumed.top_k["wer"]] == [2, 4]
    # best (3) and top-k (2, 4) do not count against save_total_limit=2: step 1 is the only
    # step that counts, until two newer ordinary ones push it out.
    assert _step_dirs(tmp_path) == [1, 2, 3, 4]
    resumed.save(5, _writer(5), {"wer": 0.9})
    resumed.save(6, _writer(6), {"wer": 0.95})
    assert _step_dirs(tmp_path) == [2, 3, 4, 5, 6]
    # A shrunk k keeps the best entries; a spec that is gone is dropped.
    small = CheckpointManager(tmp_path, keep_best=[TopKSpec(metric="wer", k=1)])
    small.load_state_dict(resumed.state_dict())
    assert small.top_k == {"wer": [{"step": 2, "value": 0.2}]}
    with pytest.raises(UserError, match="listed twice"):
        CheckpointManager(tmp_path, keep_best=[TopKSpec(metric="wer"), TopKSpec(metric="wer")])


@pytest.mark.fast
def test_enospc_during_save_keeps_everything(tmp_path, monkeypatch):
    m = CheckpointManager(tmp_path, save_total_limit=1, keep_best=[TopKSpec(metric="wer")])
    m.save(1, _writer(1), {"wer": 0.5}, is_best=True)
    m.save(2, _writer(2), {"wer": 0.6})
    before = {p.name: read_manifest(p) for p in tmp_path.iterdir() if p.is_dir()}
    state = m.state_dict()

    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic.os, "fsync", full)
    with pytest.raises(CheckpointSaveError, match="No space left on device") as ei:
        m.save(3, _writer(3), {"wer": 0.1}, is_best=True)
    monkeypatch.undo()
    assert "step-000003" in str(ei.value)
    assert {p.name: verify(p) for p in tmp_path.iterdir() if p.is_dir()} == before
    assert m.state_dict() == state and os.readlink(tmp_path / "latest") == "step-000002"


@pytest.mark.fast
def test_training_payload_is_passed_once(tmp_path):
    m = CheckpointManager(tmp_path, keep_best=[TopKSpec(metric="wer")])
    payload = {
        "model": {"w": torch.arange(6.0)},
        "optimizer": {"state": {}, "param_groups": []},
        "scheduler": {"last_epoch": 5},
        "rng": capture_rng_state(),
        "train_state": {"step": 5},
        "config_yaml": "seed: 0\n",
        "meta": {"config_id": "tiny", "seed": 0},
    }
    path = m.save(
        5, CheckpointContents(**payload), {"wer": torch.tensor(0.25), "n": 3}, is_best=True
    )
    ck = load_training_checkpoint(tmp_path / "best")
    assert ck.path != path and torch.equal(ck.model["w"], torch.arange(6.0))
    assert ck.manifest["config_id"] == "tiny" and ck.metrics == {"wer": 0.25, "n": 3}
    assert ck.manifest["step"] == 5 and ck.manifest["kind"] == "training"


# ---------------------------------------------------------------------------------------------
# SIGKILL at random moments

# A zygote: imports torch once, then forks one saving process per "go" line; the test SIGKILLs
# each at a random moment. Forking keeps 8 kills well under the cost of 8 interpreter starts.
_ZYGOTE = r"""
import os, random, sys
from pathlib import Path
import torch
from asrforge.checkpoint import CheckpointContents, CheckpointManager, capture_rng_state, read_manifest
from asrforge.config import TopKSpec

def run(root, once):
    m = CheckpointManager(root, save_total_limit=2, keep_best=[TopKSpec(metric="wer", k=2)])
    m.recover()
    last = m.latest_valid()
    step = 0
    if last is not None:
        manifest = read_manifest(last)
        m.load_state_dict(manifest["checkpoint_manager"])
        step = manifest["step"]
    print(f"saving {os.getpid()}", flush=True)
    while True:
        step += 1
        wer = random.Random(step).random()
        top = m.top_k["wer"]
        payload = {
            "model": {"w": torch.full((128, 256), float(step)), "b": torch.zeros(8)},
            "optimizer": {"state": {0: {"exp_avg": torch.rand(128, 256)}}, "param_groups": []},
            "scheduler": {"last_epoch": step},
            "rng": capture_rng_state(),
            "train_state": {"step": step},
            "config_yaml": "seed: 0\n",
            "tokenizer_save": lambda d: (d / "vocab.json").write_text("{}"),
        }
        m.save(step, CheckpointContents(**payload), {"wer": wer}, is_best=not top or wer < top[0]["value"])
        if once:
            return

root = Path(sys.argv[1])
print("ready", flush=True)
for line in sys.stdin:
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            run(root, once=line.strip() == "once")
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    print(f"exit {status}", flush=True)
"""


def test_sigkill_at_random_moments_leaves_only_verifying_checkpoints(tmp_path):
    root = tmp_path / "checkpoints"
    rng = random.Random(int(os.environ.get("ASRFORGE_KILL_SEED", "1234")))
    kills = 8
    zygote = subprocess.Popen(
        [sys.executable, "-c", _ZYGOTE, str(root)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    try:
        assert zygote.stdout.readline().strip() == "ready"

        def start(cmd: str) -> int:
            zygote.stdin.write(cmd + "\n")
            zygote.stdin.flush()
            word, pid = zygote.stdout.readline().split()
            assert word == "saving"
            return int(pid)

        def exit_status() -> int:
            word, status = zygote.stdout.readline().split()
            assert word == "exit"
            return int(status)

        for _ in range(kills):
            pid = start("go")
            time.sleep(rng.uniform(0.05, 0.5))
            os.kill(pid, signal.SIGKILL)
            status = exit_status()
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL

        def check_visible_dirs() -> None:
            for d in root.iterdir():
                if not d.name.startswith(".") and d.is_dir() and not d.is_symlink():
                    verify(d)

        check_visible_dirs()  # before any recovery: every non-temporary directory is complete
        m = CheckpointManager(root, save_total_limit=2, keep_best=[TopKSpec(metric="wer", k=2)])
        m.recover()
        assert not [p for p in root.iterdir() if p.name.startswith(".")]
        check_visible_dirs()
        last = m.latest_valid()
        assert last is not None and verify(last)["step"] >= kills  # saves really happened
        assert (root / "latest").resolve().is_dir() and verify(root / "latest")

        # One clean save after the last kill puts best/ and top-k in line with the records.
        start("once")
        assert exit_status() == 0
    finally:
        zygote.stdin.close()
        zygote.wait(timeout=30)
    m = CheckpointManager(root, save_total_limit=2, keep_best=[TopKSpec(metric="wer", k=2)])
    m.load_state_dict(read_manifest(m.latest_valid())["checkpoint_manager"])
    top = [e["step"] for e in m.top_k["wer"]]
    assert [_step_of(root / f"best-wer-{r}") for r in (1, 2)] == top
    assert _step_of(root / "best") == m.best_step == top[0]
    check_visible_dirs()
