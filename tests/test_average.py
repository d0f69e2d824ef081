"""Checkpoint averaging: exact against a hand computation, streamed, and picky about mismatches."""

from __future__ import annotations

import argparse
import shutil
import weakref
from pathlib import Path

import pytest
import torch

from asrforge.checkpoint import average
from asrforge.checkpoint.average import average_checkpoints, average_top_k
from asrforge.checkpoint.manager import CheckpointManager
from asrforge.checkpoint.manifest import read_manifest, verify, write_manifest
from asrforge.checkpoint.training import load_weights, save_weights
from asrforge.cli import average as average_command
from asrforge.errors import CheckpointError, CheckpointNotSupportedError, UserError
from asrforge.model.lora import BASE_KEY as LORA_BASE_KEY

pytestmark = pytest.mark.fast


def _state(i: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    emb = torch.randn(5, 3, generator=g)
    return {
        "emb.weight": emb,
        "out.weight": emb,  # tied, stored once
        "lin.weight": torch.randn(3, 3, generator=g).to(torch.bfloat16),
        "bn.running_mean": torch.randn(3, generator=g, dtype=torch.float64),
        "bn.num_batches_tracked": torch.tensor(10 * (i + 1)),
        "mask": torch.tensor([True, i % 2 == 0]),
    }


def _ckpt(root: Path, i: int, *, state: dict | None = None, metrics: dict | None = None) -> Path:
    d = root / f"step-{i:06d}"
    d.mkdir(parents=True)
    save_weights(d / "model.safetensors", state if state is not None else _state(i))
    (d / "config.yaml").write_text(f"from: {i}\n")
    (d / "tokenizer").mkdir()
    (d / "tokenizer" / "vocab.json").write_text(f'{{"ckpt": {i}}}')
    (d / "optimizer.pt").write_bytes(b"not copied")
    write_manifest(d, {"step": i, "metrics": metrics or {}, "kind": "training"})
    return d


def test_average_matches_hand_computation(tmp_path):
    paths = [_ckpt(tmp_path, i) for i in (1, 2, 3)]
    out = average_checkpoints(paths, tmp_path / "avg")
    got = load_weights(out / "model.safetensors")
    states = [_state(i) for i in (1, 2, 3)]

    def mean(name: str) -> torch.Tensor:
        return sum(s[name].double() for s in states) / 3

    torch.testing.assert_close(got["emb.weight"], mean("emb.weight").float(), rtol=0, atol=0)
    assert got["out.weight"] is got["emb.weight"]  # the tie survives averaging
    assert got["lin.weight"].dtype == torch.bfloat16
    assert torch.equal(got["lin.weight"], mean("lin.weight").to(torch.bfloat16))
    assert got["bn.running_mean"].dtype == torch.float64
    torch.testing.assert_close(got["bn.running_mean"], mean("bn.running_mean"))
    # Integer counters are summed, not averaged (20 + 30 + 40).
    assert got["bn.num_batches_tracked"].dtype == torch.int64
    assert got["bn.num_batches_tracked"].item() == 90
    assert got["mask"].tolist() == [True, False]  # bool: the first (best) checkpoint's

    m = verify(out)
    assert m["kind"] == "average" and m["k"] == 3 and m["averaged_from"] == [str(p) for p in paths]
    assert sorted(m["files"]) == ["config.yaml", "model.safetensors", "tokenizer/vocab.json"]
    assert (out / "config.yaml").read_text() == "from: 1\n"  # non-weight files from the best


def test_lora_adapters_are_never_averaged(tmp_path):
    paths = [_ckpt(tmp_path, i) for i in (1, 2)]
    for p in paths:  # as a model.lora run's checkpoints record their base
        meta = {k: v for k, v in read_manifest(p).items() if k not in ("files", "format_version")}
        write_manifest(p, {**meta, LORA_BASE_KEY: "0" * 64})
    with pytest.raises(CheckpointNotSupportedError, match=r"step-000001: holds LoRA adapters: the "
                       r"mean of LoRA adapters' factors, mean\(B\) @ mean\(A\), is not"):
        average_checkpoints(paths, tmp_path / "avg")
    assert not (tmp_path / "avg").exists()


def test_mismatches_are_named(tmp_path):
    good = _ckpt(tmp_path, 1)
    shape = _state(2)
    shape["lin.weight"] = torch.zeros(3, 4, dtype=torch.bfloat16)
    with pytest.raises(CheckpointNotSupportedError, match=r"'lin\.weight' is BF16\[3, 4\]"):
        average_checkpoints([good, _ckpt(tmp_path, 2, state=shape)], tmp_path / "avg")
    dtype = _state(3)
    dtype["bn.running_mean"] = dtype["bn.running_mean"].float()
    with pytest.raises(CheckpointNotSupportedError, match=r"'bn\.running_mean' is F32\[3\]"):
        average_checkpoints([good, _ckpt(tmp_path, 3, state=dtype)], tmp_path / "avg")
    missing = _state(4)
    del missing["mask"]
    with pytest.raises(CheckpointNotSupportedError, match=r"lacks 'mask'"):
        average_checkpoints([good, _ckpt(tmp_path, 4, state=missing)], tmp_path / "avg")
    assert not (tmp_path / "avg").exists()


def test_average_streams_block_by_block(tmp_path, monkeypatch):
    """Reads go tensor-major (all k copies of one block, then the next), a large tensor in blocks
    of rows, and one input block at most is alive at any time, whatever k."""
    big = {"big": torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8)}
    paths = [_ckpt(tmp_path, i, state=_state(i) | big) for i in range(1, 5)]
    monkeypatch.setattr(average, "_BLOCK_BYTES", 16 * 8 * 16)  # blocks of 16 rows of 8
    reads: list[tuple[str, str, int, int]] = []
    alive = {"now": 0, "max": 0}
    real_rows = average._RowReader.rows

    def spy_rows(self, name, start, stop):
        t = real_rows(self, name, start, stop)
        reads.append((self.path.parent.name, name, start, stop))
        alive["now"] += 1
        alive["max"] = max(alive["max"], alive["now"])
        weakref.finalize(t, lambda: alive.__setitem__("now", alive["now"] - 1))
        return t

    monkeypatch.setattr(average._RowReader, "rows", spy_rows)
    out = average_checkpoints(paths, tmp_path / "avg")
    assert torch.equal(load_weights(out / "model.safetensors")["big"], big["big"])
    names = sorted(n for n in _state(0) | big if n != "out.weight")  # the header's order
    expected = []
    for n in names:
        blocks = [(0, 16), (16, 32), (32, 48), (48, 64)] if n == "big" else [None]
        for block in blocks:
            for p in paths[:1] if n == "mask" else paths:  # bool: the best checkpoint's only
                start, stop = block or (
                    0,
                    1 if n == "bn.num_batches_tracked" else _state(0)[n].shape[0],
                )
                expected.append((p.name, n, start, stop))
    assert reads == expected
    assert alive["max"] == 1


def _run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    m = CheckpointManager(run / "checkpoints", save_total_limit=None)
    wers = {1: 0.5, 2: 0.2, 3: 0.4, 4: 0.3, 5: 0.9}
    for step, wer in wers.items():

        def write(d: Path, step: int = step) -> None:
            save_weights(d / "model.safetensors", {"w": torch.full((2,), float(step))})
            (d / "config.yaml").write_text(f"step: {step}\n")

        m.save(step, write, {"wer": wer, "acc": 1 - wer}, is_best=step == 2)
    return run


def test_average_top_k_picks_best_by_metric(tmp_path):
    run = _run_dir(tmp_path)
    out = average_top_k(run, "wer", 3)
    assert out == run / "checkpoints" / "wer.ave_3best"
    m = read_manifest(out)
    assert m["steps"] == [2, 4, 3] and m["metric"] == "wer" and m["mode"] == "min"
    assert (out / "config.yaml").read_text() == "step: 2\n"
    assert load_weights(out / "model.safetensors")["w"].tolist() == [3.0, 3.0]  # (2+4+3)/3
    # acc is higher-is-better by default; best/ (a copy of step 2) is not counted twice.
    assert read_manifest(average_top_k(run / "checkpoints", "acc", 2))["steps"] == [2, 4]
    # An earlier average in the root is never an input.
    assert read_manifest(average_top_k(run, "wer", 10, tmp_path / "all"))["k"] == 5


def test_cli(tmp_path, capsys):
    run = _run_dir(tmp_path)
    parser = argparse.ArgumentParser(prog="asrforge")
    average_command.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["average", str(run), "--metric", "wer", "--k", "2"])
    assert average_command.run(args) == 0
    assert "steps 2, 4" in capsys.readouterr().out
    with pytest.raises(CheckpointError, match="'bleu'"):
        average_command.run(parser.parse_args(["average", str(run), "--metric", "bleu"]))
    with pytest.raises(UserError, match="--k"):
        average_command.run(parser.parse_args(["average", str(run), "--k", "0"]))
    with pytest.raises(UserError, match="no such directory"):
        average_command.run(parser.parse_args(["average", str(tmp_path / "nope")]))
    both = ["--weights", "raw", "--weights-file", "ema.safetensors"]
    with pytest.raises(UserError, match="--weights and --weights-file"):
        average_command.run(parser.parse_args(["average", str(run), *both]))


def test_cli_out_through_a_symlink_names_the_real_path_before_any_work(tmp_path):
    """The link's own entry would be replaced: "Not a directory (errno 20)" after averaging."""
    run = _run_dir(tmp_path)
    parser = argparse.ArgumentParser(prog="asrforge")
    average_command.add_parser(parser.add_subparsers(dest="command"))
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to("real")
    args = parser.parse_args(["average", str(run), "--k", "2", "--out", str(tmp_path / "link")])
    real = tmp_path / "real"
    with pytest.raises(UserError, match=rf"--out .*link: a symlink \(to real\); give the real "
                                        rf"path \({real}\)"):  # fmt: skip
        average_command.run(args)
    assert not any(real.iterdir()) and (tmp_path / "link").is_symlink()


def test_the_library_refuses_weights_with_a_weights_file(tmp_path):
    run = _run_dir(tmp_path)
    ckpt = run / "checkpoints" / "step-000002"
    for call in (
        lambda: average_checkpoints([ckpt], tmp_path / "out", weights="bogus", weights_file="x"),
        lambda: average_top_k(run, "wer", 2, weights="raw", weights_file="ema.safetensors"),
    ):
        with pytest.raises(UserError, match="weights and weights_file .*: give one of them"):
            call()
    assert not (tmp_path / "out").exists()


def test_the_starting_model_is_never_averaged_nor_kept_for_an_average(tmp_path):
    """``eval.at_start`` saves the starting weights as ``step-000000`` with metrics: they are
    no trained checkpoint, so no average takes them in (they tie with or beat undertrained
    steps), and rotation does not keep them for one once they are no longer best."""
    from asrforge.checkpoint.average import rank_checkpoints
    from asrforge.config import TopKSpec

    root = tmp_path / "run" / "checkpoints"
    protect = [TopKSpec(metric="wer", k=2, mode="min")]
    m = CheckpointManager(root, save_total_limit=1, protect_top=protect)
    for step, wer in {0: 0.30, 2: 0.40, 4: 0.25, 6: 0.35}.items():

        def write(d: Path, step: int = step) -> None:
            save_weights(d / "model.safetensors", {"w": torch.full((2,), float(step))})

        m.save(step, write, {"wer": wer}, is_best=step in (0, 4))
    assert [s for _v, s, _d in rank_checkpoints(root, "wer", "min")] == [4, 6, 2]
    out = average_top_k(root, "wer", 5)
    assert read_manifest(out)["steps"] == [4, 6, 2]
    assert load_weights(out / "model.safetensors")["w"].tolist() == [4.0, 4.0]  # (4+6+2)/3
    # not best since step 4 and no member of the top 2 an average will read: rotated out first
    assert [p.name for p in sorted(root.glob("step-*"))] == [
        "step-000002", "step-000004", "step-000006"
    ]  # fmt: skip
    with pytest.raises(CheckpointError, match="the starting model, step 0, is never averaged"):
        only_start = tmp_path / "start" / "checkpoints"
        CheckpointManager(only_start).save(0, write, {"wer": 0.3}, is_best=True)
        average_top_k(only_start, "wer", 5)


def test_the_checkpoint_the_guard_refused_is_never_averaged(tmp_path):
    """``best-unguarded/`` holds the step the forgetting guard refused: an average takes it in
    neither through that copy nor through its step directory (which rotation keeps)."""
    from asrforge.checkpoint.average import rank_checkpoints

    root = tmp_path / "run" / "checkpoints"
    m = CheckpointManager(root, save_total_limit=1)
    for step, wer in {2: 0.40, 4: 0.10, 6: 0.35}.items():

        def write(d: Path, step: int = step) -> None:
            save_weights(d / "model.safetensors", {"w": torch.full((2,), float(step))})

        m.save(step, write, {"wer": wer}, is_best=step != 4, unguarded_step=4)
    assert (root / "best-unguarded").is_dir() and (root / "step-000004").is_dir()
    assert [s for _v, s, _d in rank_checkpoints(root, "wer", "min")] == [6, 2]
    shutil.rmtree(root / "step-000004")
    assert [s for _v, s, _d in rank_checkpoints(root, "wer", "min")] == [6, 2]


def test_one_checkpoint_averaged_of_several_asked_for_is_said_in_the_singular(
    tmp_path, capsys, caplog
):
    run = tmp_path / "run"
    m = CheckpointManager(run / "checkpoints", save_total_limit=None)
    m.save(1, lambda d: save_weights(d / "model.safetensors", {"w": torch.ones(2)}), {"wer": 0.5})
    parser = argparse.ArgumentParser(prog="asrforge")
    average_command.add_parser(parser.add_subparsers(dest="command"))
    with caplog.at_level("WARNING", logger="asrforge.checkpoint.average"):
        assert average_command.run(parser.parse_args(["average", str(run), "--k", "3"])) == 0
    # the average's own records: another test may have left the checkpoints' INFO lines on
    said = [r.getMessage() for r in caplog.records if r.name == "asrforge.checkpoint.average"]
    assert said == ["average: only 1 checkpoint has 'wer'; averaging it"]
    out = capsys.readouterr().out
    assert " of 1 checkpoint, the best by wer" in out
    assert "only 1 of the 3 requested has wer in its manifest" in out


def test_every_step_the_guard_refused_is_left_out_and_named(tmp_path, caplog):
    """Not only the one ``best-unguarded/`` holds: an average of refused steps would route
    round the guard."""
    from asrforge.checkpoint.average import rank_checkpoints

    root = tmp_path / "run" / "checkpoints"
    m = CheckpointManager(root, save_total_limit=None)
    for step, wer, within in ((2, 0.40, False), (4, 0.10, False), (6, 0.35, True)):

        def write(d: Path, step: int = step) -> None:
            save_weights(d / "model.safetensors", {"w": torch.full((2,), float(step))})

        metrics = {"wer": wer, "guard_within": within}
        m.save(step, write, metrics, is_best=step == 6, unguarded_step=4)
    assert [s for _v, s, _d in rank_checkpoints(root, "wer", "min")] == [6]
    with caplog.at_level("WARNING", logger="asrforge.checkpoint.average"):
        out = average_top_k(root, "wer", 2)
    assert read_manifest(out)["steps"] == [6]
    said = [r.getMessage() for r in caplog.records if r.name == "asrforge.checkpoint.average"]
    assert said == ["average: only 1 checkpoint has 'wer'; the forgetting guard refused step(s) "
                    "2, 4, never averaged; averaging it"]  # fmt: skip
    from asrforge.cli.average import describe_average

    assert "only 1 of the 2 requested has wer in its manifest (the forgetting guard refused " \
        "step(s) 2, 4)" in describe_average(read_manifest(out), 2, out)
