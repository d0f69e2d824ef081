"""A lazily prepared split under several processes: a clip the workers drop must not leave one
rank out of a step's gradient synchronization."""

from __future__ import annotations

import json
import subprocess
import sys

from asrforge.data.dataset import epoch_batches
from asrforge.data.sources import load_arrow
from tests.conftest import tiny_config

LONG_TEXT = " ".join(["red blue cat dog"] * 20)  # far more than the tiny decoder's 32 positions


def test_a_batch_dropped_whole_on_one_rank_does_not_stall_the_others(tmp_path, tones_dir):
    dd = load_arrow(tones_dir)
    # rank 1's first batch (of one clip) is a clip whose labels are too long: found only in
    # its worker, so rank 1 has nothing to train on in step 1 while rank 0 has
    victim = epoch_batches(len(dd["train"]), 1, 0, 0, rank=1, world=2)[0][0]
    dd["train"] = dd["train"].map(
        lambda row, i: {"text": LONG_TEXT if i == victim else row["text"]}, with_indices=True
    )
    data = tmp_path / "data"
    dd.save_to_disk(str(data))
    run = tmp_path / "run"
    cfg = tiny_config(run, data, data={"batch_size": 1}, train={"max_steps": 3},
                      eval={"eval_steps": None, "at_end": False})  # fmt: skip
    path = tmp_path / "cfg.yaml"
    path.write_text(cfg.to_yaml())
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
               "2", "-m", "asrforge", "train", str(path)]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        # torchrun's workers run in sessions of their own: stopped by torchrun (SIGTERM), which
        # kills them after its grace period; a SIGKILL to torchrun would leave them waiting
        proc.terminate()
        proc.communicate(timeout=120)
        raise AssertionError("the run stalled: rank 0 waits for rank 1's gradients") from None
    assert proc.returncode == 0, stderr[-3000:]
    uid = dd["train"][victim]["id"]
    skipped = json.loads((run / "skipped-train.json").read_text())
    assert skipped == {"labels longer than 32 tokens": [uid]}


def test_a_user_error_of_rank_zero_while_preparing_stops_every_rank_with_it(tmp_path, tones_dir):
    dd = load_arrow(tones_dir)
    dd["train"] = dd["train"].map(
        lambda row, i: {"language": "qqq" if i == 3 else row["language"]}, with_indices=True
    )
    data = tmp_path / "data"
    dd.save_to_disk(str(data))
    cfg = tiny_config(tmp_path / "run", data, train={"max_steps": 2},
                      eval={"eval_steps": None, "at_end": False})  # fmt: skip
    path = tmp_path / "cfg.yaml"
    path.write_text(cfg.to_yaml())
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
               "2", "-m", "asrforge", "train", str(path)]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert out.returncode != 0
    assert "language 'qqq' (1 utterance) has no token" in out.stderr
    # every rank stops on the user error itself: none dies on rank zero's lost connection
    assert "Connection closed by peer" not in out.stderr and "[rank1]" not in out.stderr
