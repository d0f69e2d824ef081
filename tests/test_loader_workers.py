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
