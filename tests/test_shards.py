"""Sharded weights: transformers' layout, every shard in the manifest, averaging and export shard
by shard (one shard's tensors in memory at a time), exact resume, transformers and CT2 loading."""

from __future__ import annotations

import json
import logging
import weakref
from pathlib import Path

import pytest
import torch

from asrforge.checkpoint import average
from asrforge.checkpoint.average import average_checkpoints
from asrforge.checkpoint.manifest import sha256_file, verify, write_manifest
from asrforge.checkpoint.shards import LazyWeights, plan_shards
from asrforge.checkpoint.training import (
    CheckpointContents,
    capture_rng_state,
    load_training_checkpoint,
    load_weights,
    save_training_checkpoint,
    save_weights_sharded,
)
from asrforge.config import parse_size
from asrforge.errors import CheckpointCorruptError
from tests.conftest import tiny_config

SHARD = 8_000  # bytes: the tiny Whisper below becomes several shards


def _whisper(seed: int = 0):
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(seed)
    cfg = WhisperConfig(
        vocab_size=60, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, num_mel_bins=8,
        max_source_positions=10, max_target_positions=10, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, decoder_start_token_id=1,
    )  # fmt: skip
    return WhisperForConditionalGeneration(cfg)


def _save(path: Path, state: dict, max_shard_bytes: int | None, **kw) -> Path:
    return save_training_checkpoint(
        path, CheckpointContents(model=state, optimizer={}, scheduler={}, rng=capture_rng_state(),
        train_state={"step": 1}, config_yaml="seed: 0\n", max_shard_bytes=max_shard_bytes, **kw),
    )  # fmt: skip


@pytest.mark.fast
def test_parse_size_reads_transformers_sizes():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("500MiB") == 500 * 2**20
    assert parse_size("1.5kB") == 1500
    assert parse_size(4096) == parse_size("4096") == 4096
    for bad in ("5 GBs", "-1MB", "0", True):
        with pytest.raises(ValueError):
            parse_size(bad)


@pytest.mark.fast
def test_plan_shards_is_greedy_in_order_and_keeps_a_large_tensor_alone():
    sizes = {"a": 4, "b": 4, "c": 10, "d": 1, "e": 3, "f": 1}
    assert plan_shards(sizes, 8) == [["a", "b"], ["c"], ["d", "e", "f"]]
    assert plan_shards(sizes, None) == [list(sizes)]


@pytest.mark.fast
def test_a_sharded_checkpoint_lists_every_shard_and_loads_exactly(tmp_path):
    model = _whisper()
    state = model.state_dict()
    ema = {k: v * 0.5 for k, v in model.named_parameters()}
    path = _save(tmp_path / "ck", state, SHARD, ema=ema)

    assert not (path / "model.safetensors").exists()
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    n = len(shards)
    assert n >= 3 and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    # transformers' index: every stored tensor (the tied proj_out is not stored) and the total
    assert set(index["weight_map"]) == set(state) - {"proj_out.weight"}
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for k, t in state.items() if k != "proj_out.weight"
    )
    manifest = verify(path)  # hashed while written: the recorded hashes are the bytes on disk
    for name in [*shards, "model.safetensors.index.json"]:
        assert manifest["files"][name]["sha256"] == sha256_file(path / name)
    assert any(f.startswith("ema-00001-of-") for f in manifest["files"])

    ck = load_training_checkpoint(path)
    assert ck.model.keys() == state.keys()
    for k, t in state.items():
        assert torch.equal(ck.model[k], t), k
    assert ck.model["proj_out.weight"] is ck.model["model.decoder.embed_tokens.weight"]
    assert all(torch.equal(ck.ema[k], t) for k, t in ema.items())


@pytest.mark.fast
def test_a_tampered_shard_is_refused_by_name(tmp_path):
    path = _save(tmp_path / "ck", _whisper().state_dict(), SHARD)
    shard = sorted(path.glob("model-*.safetensors"))[1]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF  # a weight's byte: the file still parses, only the hash can tell
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match=shard.name):
        verify(path)
    with pytest.raises(CheckpointCorruptError, match=shard.name):
        load_training_checkpoint(path)


def _weights_dir(root: Path, i: int, max_shard_bytes: int | None) -> Path:
    d = root / f"step-{i:06d}"
    d.mkdir(parents=True)
    state = _whisper(i).state_dict()
    digests = save_weights_sharded(d, "model", state, None, max_shard_bytes)
    ema = {k: v * 0.5 for k, v in state.items() if k.startswith("model.encoder.")}
    digests |= save_weights_sharded(d, "ema", ema, None, max_shard_bytes)
    (d / "config.yaml").write_text(f"from: {i}\n")
    write_manifest(d, {"step": i, "kind": "training"}, known=digests)
    return d


def test_a_sharded_average_equals_the_unsharded_one(tmp_path):
    sharded = [_weights_dir(tmp_path / "sharded", i, SHARD) for i in (1, 2, 3)]
    single = [_weights_dir(tmp_path / "single", i, None) for i in (1, 2, 3)]
    a = average_checkpoints(sharded, tmp_path / "avg-sharded")
    b = average_checkpoints(single, tmp_path / "avg-single")

    # laid out as the best input is, every shard in the manifest
    assert sorted(p.name for p in a.glob("model*")) == sorted(
        p.name for p in sharded[0].glob("model*")
    )
    manifest = verify(a)
    assert {f for f in manifest["files"] if f.startswith("model")} == {
        p.name for p in a.glob("model*")
    }
    got, want = load_weights(a / "model.safetensors"), load_weights(b / "model.safetensors")
    assert got.keys() == want.keys() == _whisper().state_dict().keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert got["proj_out.weight"] is got["model.decoder.embed_tokens.weight"]
    assert (a / "config.yaml").read_text() == "from: 1\n"
    assert not list(a.glob("ema*"))  # the other weights are not copied along

    ema_a = average_checkpoints(sharded, tmp_path / "ema-sharded", weights_file="ema.safetensors")
    ema_b = average_checkpoints(single, tmp_path / "ema-single", weights_file="ema.safetensors")
    assert len(list(ema_a.glob("ema-*-of-*.safetensors"))) >= 2 and not list(ema_a.glob("model*"))
    got, want = load_weights(ema_a / "ema.safetensors"), load_weights(ema_b / "ema.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def _count_alive(monkeypatch, owner, attr: str) -> dict[str, int]:
    """Wrap ``owner.attr`` (a function returning a tensor): how many of its results are alive at
    once, at most."""
    alive = {"now": 0, "max": 0, "calls": 0}
    real = getattr(owner, attr)

    def spy(*args, **kwargs):
        t = real(*args, **kwargs)
        alive["now"] += 1
        alive["calls"] += 1
        alive["max"] = max(alive["max"], alive["now"])
        weakref.finalize(t, lambda: alive.__setitem__("now", alive["now"] - 1))
        return t

    monkeypatch.setattr(owner, attr, spy)
    return alive


def _largest_shard(directory: Path, stem: str = "model") -> int:
    index = json.loads((directory / f"{stem}.safetensors.index.json").read_text())
    files = list(index["weight_map"].values())
    return max(files.count(f) for f in set(files))


@pytest.mark.fast
def test_averaging_holds_one_output_shard_at_a_time(tmp_path, monkeypatch):
    paths = [_weights_dir(tmp_path, i, SHARD) for i in (1, 2, 3)]
    alive = _count_alive(monkeypatch, average, "_average_one")
    average_checkpoints(paths, tmp_path / "avg")
    total = len(_whisper().state_dict()) - 1  # proj_out is stored once, as embed_tokens
    assert alive["calls"] == total
    assert alive["max"] <= _largest_shard(paths[0]) < total


# ---------------------------------------------------------------------------------------------
# A trained run with sharded checkpoints: export, transformers, CT2, resume

_SECTIONS = dict(  # dropout and EMA on, an evaluation (best/) before the preemption at step 3
    model={"dropout": 0.1},
    train={"max_steps": 6, "grad_accum": 2, "ema_decay": 0.9, "precision": "no"},
    eval={"eval_steps": 2, "max_new_tokens": 4},
    data={"max_eval_samples": 4},
)
_RUN_SHARD = "60kB"  # the tiny config's ~0.5 MB of weights in several shards


def _train(cfg, extra=(), resume=False):
    from accelerate.state import AcceleratorState

    from asrforge.callbacks import build_callbacks
    from asrforge.train.loop import Trainer

    AcceleratorState._reset_state()
    try:
        return Trainer(cfg, [*extra, *build_callbacks(cfg)]).fit(resume=resume)
    finally:
        AcceleratorState._reset_state()
        logging.getLogger("asrforge").handlers = []


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory, tones_dir) -> Path:
    out = tmp_path_factory.mktemp("sharded") / "full"
    checkpoint = {"save_total_limit": 5, "max_shard_size": _RUN_SHARD}
    _train(tiny_config(out, tones_dir, **_SECTIONS, checkpoint=checkpoint))
    return out


def test_resume_from_sharded_checkpoints_is_bit_identical(sharded_run, tmp_path, tones_dir):
    from tests.test_resume import Losses, PreemptAt

    latest = sharded_run / "checkpoints" / "latest"
    assert len(list(latest.glob("model-*-of-*.safetensors"))) >= 3
    assert len(list(latest.glob("ema-*-of-*.safetensors"))) >= 2

    checkpoint = {"save_total_limit": 5, "max_shard_size": _RUN_SHARD}
    cfg = tiny_config(tmp_path / "split", tones_dir, **_SECTIONS, checkpoint=checkpoint)
    first, second = Losses(), Losses()
    assert _train(cfg, [first, PreemptAt(3)]).status == "interrupted"
    _train(cfg, [second], resume=True)
    assert sorted(second.by_step) == [4, 5, 6]
    full = json.loads((latest / "train_state.json").read_text())
    split = json.loads((tmp_path / "split/checkpoints/latest/train_state.json").read_text())
    assert full["step"] == split["step"] == 6
    for stem in ("model", "ema"):
        a = load_weights(latest / f"{stem}.safetensors")
        b = load_weights(tmp_path / "split/checkpoints/latest" / f"{stem}.safetensors")
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), (stem, k)


def test_a_sharded_export_loads_in_transformers_holding_one_shard_at_a_time(
    sharded_run, tmp_path, monkeypatch
):
    from transformers import WhisperForConditionalGeneration

    from asrforge.bundle.export import export_bundle
    from asrforge.bundle.load import load_bundle

    ckpt = sharded_run / "checkpoints" / "best"
    alive = _count_alive(monkeypatch, LazyWeights, "__getitem__")
    out = export_bundle(sharded_run, tmp_path / "sharded", max_shard_size="40kB")
    stored = len(json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"])
    assert alive["calls"] >= stored  # every tensor was read lazily ...
    assert alive["max"] <= _largest_shard(out) < stored  # ... one output shard at a time
    monkeypatch.undo()
    single = export_bundle(sharded_run, tmp_path / "single", max_shard_size=None)
    assert (single / "model.safetensors").is_file()
    assert not (out / "model.safetensors").exists()
    assert len(list(out.glob("model-*-of-*.safetensors"))) >= 3

    ours = load_bundle(out).model.state_dict()
    reference = load_bundle(single).model.state_dict()
    hf = WhisperForConditionalGeneration.from_pretrained(out).state_dict()
    assert ours.keys() == reference.keys() == hf.keys()
    for k, t in reference.items():
        assert torch.equal(ours[k], t) and torch.equal(hf[k], t), k


def test_a_sharded_export_refuses_a_tampered_shard(sharded_run, tmp_path):
    from asrforge.bundle.export import export_bundle
    from asrforge.bundle.load import load_bundle

    out = export_bundle(sharded_run, tmp_path / "b", max_shard_size="40kB")
    shard = sorted(out.glob("model-*-of-*.safetensors"))[-1]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match=shard.name):
        load_bundle(out)


def test_ct2_export_of_a_sharded_model_equals_the_unsharded_one(sharded_run, tmp_path):
    pytest.importorskip("ctranslate2")
    from asrforge.bundle.export import export_bundle

    a = export_bundle(sharded_run, tmp_path / "a", fmt="ct2", max_shard_size="40kB")
    b = export_bundle(sharded_run, tmp_path / "b", fmt="ct2", max_shard_size=None)
    assert (a / "model.bin").read_bytes() == (b / "model.bin").read_bytes()


def test_export_cli_shards_on_request_and_refuses_a_bad_size(sharded_run, tmp_path, capsys):
    from asrforge.cli import main

    bad = ["export", str(sharded_run), "--out", str(tmp_path / "bad"), "--max-shard-size", "lots"]
    assert main(bad) == 2
    assert "--max-shard-size: expected a size such as 5GB" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()
    good = ["export", str(sharded_run), "--out", str(tmp_path / "b"), "--max-shard-size", "40kB"]
    assert main(good) == 0
    assert (tmp_path / "b" / "model.safetensors.index.json").is_file()
    assert main([*good[:3], str(tmp_path / "c"), "--max-shard-size", "0"]) == 0
    assert (tmp_path / "c" / "model.safetensors").is_file()
