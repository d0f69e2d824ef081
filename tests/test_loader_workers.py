"""``data.num_workers: auto``: DataLoader workers that keep a GPU fed, none that would take a
CPU training step's cores."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from asrforge.config import ConfigError, load_config
from asrforge.data import workers as workers_module
from asrforge.data.workers import AUTO_WORKERS_MAX, worker_count

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("cores", "device", "here", "want"),
    [
        (2, "cpu", 1, 0),  # the step needs both cores
        (3, "cpu", 1, 0),
        (8, "cpu", 1, 2),
        (64, "cpu", 1, AUTO_WORKERS_MAX),
        (2, "cuda", 1, 1),  # a GPU is fed by every core but the training process's own
        (16, "cuda", 1, AUTO_WORKERS_MAX),
        (16, "cuda", 8, 1),  # eight ranks on one machine share its 16 cores
        (16, "cuda", 4, 3),
    ],
)
def test_auto_follows_the_device_and_the_cores_this_process_has(
    monkeypatch, cores, device, here, want
):
    monkeypatch.setattr(workers_module.os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert worker_count("auto", device, here) == want
    assert worker_count(min(3, cores), device, here) == min(3, cores)  # a count is a count
    assert worker_count(0, device, here) == 0
    # but never more than the cores this process may use
    assert worker_count(10**9, device, here) == worker_count(cores + 1, device, here) == cores


def test_the_config_takes_auto_or_a_count_and_names_anything_else():
    tiny = ROOT / "configs" / "tiny.yaml"
    assert load_config(tiny, ["data.num_workers=auto"]).data.num_workers == "auto"
    assert load_config(tiny, ["data.num_workers=2"]).data.num_workers == 2
    for bad in ("-1", "many"):
        with pytest.raises(ConfigError) as e:
            load_config(tiny, [f"data.num_workers={bad}"])
        (line,) = e.value.problems
        assert line.startswith("data.num_workers: must be a number of workers (0 or more) or auto")


def test_this_machine_gets_a_count():
    assert 0 <= worker_count("auto", "cpu") <= AUTO_WORKERS_MAX
    assert 1 <= worker_count("auto", "cuda") <= max(1, len(os.sched_getaffinity(0)))


def test_a_count_beyond_the_machine_is_capped_and_the_run_says_so(tmp_path, tones_dir, caplog):
    from asrforge.train.loop import Trainer
    from tests.conftest import tiny_config

    cfg = tiny_config(tmp_path / "run", tones_dir, train={"max_steps": 1},
                      data={"num_workers": 1_000_000_000}, eval={"eval_steps": None})  # fmt: skip
    with caplog.at_level("WARNING", logger="asrforge.train"):
        result = Trainer(cfg).fit()
    assert result.status == "completed"
    cores = len(os.sched_getaffinity(0))
    assert (f"data.num_workers: 1000000000 is more than the {cores} cores this process may use: "
            f"{cores} workers") in caplog.text  # fmt: skip


def test_the_evaluation_workers_start_once_per_run_and_end_with_it(
    tmp_path, tones_dir, monkeypatch
):
    """Every evaluation of a run is served by the same worker, not a new one started (forked)
    each time; none is left once the run returns."""
    import multiprocessing

    import torch

    import asrforge.train.loaders as loaders
    from asrforge.train.loop import Trainer
    from tests.conftest import tiny_config

    started, served = tmp_path / "started", []
    real_init, real_loader = loaders.ignore_stop_signals, loaders.RunLoaders.eval_loader

    def record(worker_id: int) -> None:
        with started.open("a") as f:  # the worker writes: it is another process
            f.write(f"{len(torch.utils.data.get_worker_info().dataset)}\n")
        real_init(worker_id)

    def eval_loader(self, batch_size=None):
        served.append(len(self.eval_set))
        return real_loader(self, batch_size)

    monkeypatch.setattr(loaders, "ignore_stop_signals", record)
    monkeypatch.setattr(loaders.RunLoaders, "eval_loader", eval_loader)
    cfg = tiny_config(tmp_path / "run", tones_dir, data={"num_workers": 1},
                      train={"max_steps": 6}, eval={"eval_steps": 2})  # fmt: skip
    assert Trainer(cfg).fit().status == "completed"
    assert len(served) >= 3  # steps 2, 4 and 6
    assert started.read_text().split().count(str(served[0])) == 1
    assert multiprocessing.active_children() == []


def test_a_batch_joined_from_pieces_is_the_batch_of_all_its_items():
    import torch

    from asrforge.data.dataset import IGNORE, Collator, worker_pieces

    def item(i: int, n: int) -> dict:
        labels = torch.arange(n) + 10 * i
        return {"input_features": torch.full((2, 3), float(i)), "decoder_input_ids": labels + 1,
                "labels": labels, "index": i, "uid": f"u{i}", "language": "en",
                "text": f"t{i}", "replay": i == 3}  # fmt: skip

    items = [item(0, 2), {"dropped": "bad", "reason": "empty audio"}, item(2, 5), item(3, 1),
             {"dropped": "gone"}, {"dropped": "gone too"}, item(6, 3)]  # fmt: skip
    pieces, counts = worker_pieces([list(range(7))], 4)
    assert counts == [4] and [len(p) for p in pieces] == [2, 2, 2, 1]
    collate = Collator(pad_id=99)
    whole = collate(items)
    joined = collate.join([collate([items[i] for i in p]) for p in pieces])
    assert joined.keys() == whole.keys()
    for key, value in whole.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, joined[key]), key
        else:
            assert value == joined[key], key
    assert (whole["labels"][0, 2:] == IGNORE).all()  # padded to the longest piece's length
    nothing = collate.join([collate([items[4]]), collate([items[5]])])
    assert nothing == {"size": 0, "dropped": ["gone", "gone too"],
                       "dropped_reasons": ["failed to decode"] * 2}  # fmt: skip


def test_evaluation_batches_read_by_two_workers_together_score_as_one_reads_them(
    tmp_path, tones_dir, monkeypatch
):
    """Each evaluation batch is cut into a piece per worker and joined again: the predictions
    and metrics are those of one process reading whole batches."""
    import json

    import asrforge.train.loaders as loaders
    from asrforge.train.loop import Trainer
    from tests.conftest import tiny_config

    cut = []

    def pieces(batches, workers):
        out = real_pieces(batches, workers)
        cut.append(out[1])
        return out

    real_pieces = loaders.worker_pieces
    monkeypatch.setattr(loaders, "worker_pieces", pieces)
    records = []
    for workers in (0, 2):
        out = tmp_path / f"w{workers}"
        cfg = tiny_config(out, tones_dir, data={"num_workers": workers, "eval_batch_size": 5},
                          train={"max_steps": 2}, eval={"eval_steps": 2})  # fmt: skip
        result = Trainer(cfg).fit()
        lines = (out / "eval" / "step-000002.jsonl").read_text().splitlines()
        records.append(([json.loads(x) for x in lines[:-1]], result.last_metrics))
    (preds0, metrics0), (preds2, metrics2) = records
    assert set(cut[0]) == {1} and set(cut[-1]) == {2}  # whole batches, then two pieces each
    assert len(preds0) == metrics0["n"] > 5  # more than one batch
    assert preds2 == preds0
    assert {k: metrics2[k] for k in ("loss", "wer", "cer", "n")} == {
        k: metrics0[k] for k in ("loss", "wer", "cer", "n")
    }
