"""Atomic writes, manifests and training checkpoints: complete or absent, verified on load."""

from __future__ import annotations

import errno
import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from asrforge.checkpoint import manifest
from asrforge.checkpoint.manifest import FORMAT_VERSION, verify, write_manifest
from asrforge.checkpoint.training import (
    ALIASES_KEY,
    CheckpointContents,
    capture_rng_state,
    load_training_checkpoint,
    load_weights,
    restore_rng_state,
    save_training_checkpoint,
    save_weights,
    weights_aliases,
)
from asrforge.errors import CheckpointCorruptError, CheckpointError, CheckpointSaveError
from asrforge.io import atomic
from asrforge.io.atomic import (
    atomic_directory,
    atomic_write_text,
    directory_problem,
    recover_interrupted,
)

pytestmark = pytest.mark.fast

# ---------------------------------------------------------------------------------------------
# atomic_directory


def _fill(d: Path, text: str) -> None:
    (d / "a.txt").write_text(text)
    (d / "sub").mkdir()
    (d / "sub" / "b.bin").write_bytes(text.encode() * 3)


def _entries(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir())


def test_atomic_directory_exception_leaves_nothing(tmp_path):
    final = tmp_path / "ckpt"
    with pytest.raises(ValueError, match="boom"), atomic_directory(final) as tmp:
        _fill(tmp, "x")
        assert tmp.parent == tmp_path and tmp.name.startswith(".tmp-ckpt-")
        raise ValueError("boom")
    assert _entries(tmp_path) == []


def test_atomic_directory_replaces_existing_wholly(tmp_path):
    final = tmp_path / "ckpt"
    with atomic_directory(final) as tmp:
        _fill(tmp, "old")
        (tmp / "only_in_old.txt").write_text("stale")
    with atomic_directory(final) as tmp:
        _fill(tmp, "new")
    assert (final / "a.txt").read_text() == "new"
    assert (final / "sub" / "b.bin").read_bytes() == b"newnewnew"
    assert not (final / "only_in_old.txt").exists()
    assert _entries(tmp_path) == ["ckpt"]  # no .old-* or .tmp-* left behind


def _enospc(*_a, **_k):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("where", ["fsync", "replace"])
def test_enospc_keeps_previous_and_names_path(tmp_path, monkeypatch, where):
    final = tmp_path / "ckpt"
    with atomic_directory(final) as tmp:
        _fill(tmp, "old")
        write_manifest(tmp, {"step": 1})
    target = {"fsync": (atomic.os, "fsync"), "replace": (atomic.os, "replace")}[where]
    monkeypatch.setattr(*target, _enospc)
    with pytest.raises(CheckpointSaveError) as ei, atomic_directory(final) as tmp:
        _fill(tmp, "new")
    monkeypatch.undo()
    msg = str(ei.value)
    assert str(final) in msg and "No space left on device" in msg
    assert verify(final)["step"] == 1
    assert (final / "a.txt").read_text() == "old"
    assert _entries(tmp_path) == ["ckpt"]


def test_enospc_in_a_library_write_of_training_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "step-000001"
    save_training_checkpoint(path, CheckpointContents(**_payload(seed=1), meta={"step": 1}))
    before = verify(path)

    def full_disk(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("asrforge.checkpoint.training.torch.save", full_disk)
    with pytest.raises(CheckpointSaveError, match="No space left on device") as ei:
        save_training_checkpoint(path, CheckpointContents(**_payload(seed=2), meta={"step": 1}))
    assert str(path) in str(ei.value)
    monkeypatch.undo()
    assert verify(path) == before
    assert _entries(tmp_path) == ["step-000001"]


def test_atomic_write_text_failure_keeps_old(tmp_path, monkeypatch):
    p = tmp_path / "f.json"
    atomic_write_text(p, "old")
    monkeypatch.setattr(atomic.os, "write", _enospc)
    with pytest.raises(CheckpointSaveError, match="f.json"):
        atomic_write_text(p, "new")
    monkeypatch.undo()
    assert p.read_text() == "old" and _entries(tmp_path) == ["f.json"]


def test_recover_interrupted_restores_moved_aside_and_removes_temps(tmp_path):
    # A kill between "move the old best/ aside" and "rename the new one in".
    (tmp_path / ".old-best-123-abcd").mkdir()
    (tmp_path / ".old-best-123-abcd" / "x").write_text("old best")
    (tmp_path / ".tmp-best-123-ef01").mkdir()
    (tmp_path / ".tmp-latest-5-aa").symlink_to("nowhere")
    (tmp_path / "step-000001").mkdir()
    (tmp_path / ".old-step-000001-9-bb").mkdir()  # its replacement made it: just garbage
    actions = recover_interrupted(tmp_path)
    assert _entries(tmp_path) == ["best", "step-000001"]
    assert (tmp_path / "best" / "x").read_text() == "old best"
    assert len(actions) == 4


# ---------------------------------------------------------------------------------------------
# manifest


@pytest.fixture()
def ckdir(tmp_path):
    d = tmp_path / "ck"
    d.mkdir()
    (d / "weights.bin").write_bytes(bytes(range(256)) * 8)
    (d / "tokenizer").mkdir()
    (d / "tokenizer" / "vocab.json").write_text('{"a": 1}')
    write_manifest(d, {"step": 7, "metrics": {"wer": 0.5}})
    return d


def test_manifest_lists_files_and_meta(ckdir):
    m = json.loads((ckdir / "manifest.json").read_text())
    assert m["format_version"] == FORMAT_VERSION and m["step"] == 7
    assert sorted(m["files"]) == ["tokenizer/vocab.json", "weights.bin"]
    assert m["files"]["weights.bin"]["size"] == 2048
    assert verify(ckdir) == m


def test_flipped_byte_is_named(ckdir):
    p = ckdir / "weights.bin"
    data = bytearray(p.read_bytes())
    data[1000] ^= 0x01
    p.write_bytes(bytes(data))
    verify(ckdir, check_hashes=False)  # same size: only the hash can tell
    with pytest.raises(CheckpointCorruptError, match=r"weights\.bin: sha256"):
        verify(ckdir)


def test_missing_file_is_named(ckdir):
    (ckdir / "tokenizer" / "vocab.json").unlink()
    with pytest.raises(CheckpointCorruptError, match=r"tokenizer/vocab\.json: missing"):
        verify(ckdir)


def test_truncated_file_is_named(ckdir):
    p = ckdir / "weights.bin"
    p.write_bytes(p.read_bytes()[:100])
    expected = r"weights\.bin: size differs: expected 2048 bytes, found 100"
    with pytest.raises(CheckpointCorruptError, match=expected):
        verify(ckdir, check_hashes=False)


def test_bad_manifests(ckdir):
    mpath = ckdir / "manifest.json"
    m = json.loads(mpath.read_text())
    mpath.write_text(json.dumps({**m, "format_version": FORMAT_VERSION + 1}))
    with pytest.raises(CheckpointCorruptError, match="newer than this asrforge supports"):
        verify(ckdir)
    mpath.write_text(mpath.read_text()[:40])
    with pytest.raises(CheckpointCorruptError, match="not valid JSON"):
        verify(ckdir)
    mpath.unlink()
    with pytest.raises(CheckpointCorruptError, match="manifest.json is missing"):
        verify(ckdir)
    with pytest.raises(ValueError, match="reserved"):
        write_manifest(ckdir, {"files": {}})
    assert manifest.list_files(ckdir) == ["tokenizer/vocab.json", "weights.bin"]


# ---------------------------------------------------------------------------------------------
# training checkpoints


class TinyLM(torch.nn.Module):
    """Embedding tied to the output projection, like Whisper's proj_out."""

    def __init__(self, vocab: int = 11, d: int = 6):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.hidden = torch.nn.Linear(d, d)
        self.norm = torch.nn.BatchNorm1d(d)
        self.out = torch.nn.Linear(d, vocab, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(torch.tanh(self.hidden(self.embed(ids)))))


def _trained(seed: int) -> tuple[TinyLM, torch.optim.Optimizer, object, torch.amp.GradScaler]:
    torch.manual_seed(seed)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    scaler = torch.amp.GradScaler("cpu", enabled=True)
    for _ in range(3):
        ids = torch.randint(0, 11, (4,))
        loss = torch.nn.functional.cross_entropy(model(ids), ids)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    return model, opt, sched, scaler


def _payload(seed: int = 0, **over) -> dict:
    model, opt, sched, scaler = _trained(seed)
    payload = {
        "model": model.state_dict(),
        "ema": {k: v.clone() for k, v in model.state_dict().items() if k != "out.weight"},
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "scaler": scaler.state_dict(),
        "rng": capture_rng_state(),
        "train_state": {"step": 3, "epoch": 0, "samples_seen": 12, "best_wer": None},
        "callbacks": {"early_stopping": {"bad_evals": 1}},
        "config_yaml": "seed: 0\n",
        "tokenizer_save": lambda d: (d / "tokenizer.json").write_text('{"v": 1}'),
    }
    payload.update(over)
    return payload


def test_training_checkpoint_round_trip(tmp_path):
    payload = _payload()
    path = save_training_checkpoint(
        tmp_path / "step-000003", CheckpointContents(**payload, meta={"step": 3})
    )
    files = set(json.loads((path / "manifest.json").read_text())["files"])
    assert files == {
        "model.safetensors",
        "ema.safetensors",
        "optimizer.pt",
        "scheduler.pt",
        "scaler.pt",
        "rng.pt",
        "train_state.json",
        "callbacks.json",
        "config.yaml",
        "tokenizer/tokenizer.json",
    }
    ck = load_training_checkpoint(path)
    assert ck.step == 3 and ck.manifest["kind"] == "training"
    assert ck.model.keys() == payload["model"].keys()
    for k, v in payload["model"].items():
        assert torch.equal(ck.model[k], v), k
    assert ck.model["norm.num_batches_tracked"].dtype == torch.int64
    assert ck.model["out.weight"] is ck.model["embed.weight"]  # the tie is restored
    assert weights_aliases(path / "model.safetensors") == {"out.weight": "embed.weight"}
    mode = (path / "config.yaml").stat().st_mode & 0o777  # what the umask gives a plain file
    assert (path / "model.safetensors").stat().st_mode & 0o777 == mode
    assert ck.ema.keys() == payload["ema"].keys()
    torch.testing.assert_close(ck.optimizer, payload["optimizer"], rtol=0, atol=0)
    assert ck.scheduler == payload["scheduler"]
    assert ck.scaler == payload["scaler"]
    assert ck.train_state == payload["train_state"] and ck.callbacks == payload["callbacks"]
    assert ck.config_yaml == "seed: 0\n"
    assert (ck.tokenizer_dir / "tokenizer.json").read_text() == '{"v": 1}'

    # The restored state drives a fresh model and optimizer to the same next step.
    model, opt, sched, _ = _trained(99)
    model.load_state_dict(ck.model)
    opt.load_state_dict(ck.optimizer)
    sched.load_state_dict(ck.scheduler)
    assert model.out.weight is model.embed.weight
    ref_model, ref_opt, _, _ = _trained(0)
    for m, o in ((model, opt), (ref_model, ref_opt)):
        ids = torch.arange(4)
        loss = torch.nn.functional.cross_entropy(m(ids), ids)
        o.zero_grad()
        loss.backward()
        o.step()
    for a, b in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_load_refuses_a_corrupt_checkpoint(tmp_path):
    path = save_training_checkpoint(
        tmp_path / "c", CheckpointContents(**_payload(), meta={"step": 3})
    )
    with open(path / "optimizer.pt", "r+b") as f:
        f.seek(50)
        b = f.read(1)
        f.seek(50)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(CheckpointCorruptError, match="optimizer.pt"):
        load_training_checkpoint(path)


def test_unsafe_objects_are_refused_at_save_time(tmp_path):
    class Custom:
        pass

    sched = {"lr_lambdas": [Custom()], "last_epoch": 3}
    with pytest.raises(CheckpointSaveError, match=r"scheduler\.pt.*\['lr_lambdas'\]\[0\].*Custom"):
        save_training_checkpoint(tmp_path / "c", CheckpointContents(**_payload(scheduler=sched)))
    with pytest.raises(CheckpointSaveError, match="train_state.json"):
        save_training_checkpoint(
            tmp_path / "c", CheckpointContents(**_payload(train_state={"x": object()}))
        )
    assert not (tmp_path / "c").exists()


def test_pickled_objects_are_never_loaded(tmp_path):
    """A checkpoint whose .pt holds an arbitrary class (manifest and all) is refused."""
    path = save_training_checkpoint(
        tmp_path / "c", CheckpointContents(**_payload(), meta={"step": 3})
    )
    torch.save({"x": np.float64(1.0)}, path / "scheduler.pt")  # needs a numpy global to load
    write_manifest(path, {"step": 3, "kind": "training"})
    with pytest.raises(CheckpointError, match="scheduler.pt: cannot be loaded safely"):
        load_training_checkpoint(path)


def test_rng_restore_reproduces_draws(tmp_path):
    payload = _payload()
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np.random.standard_normal()  # leaves a cached gaussian in numpy's state
    state = capture_rng_state()
    save_training_checkpoint(tmp_path / "c", CheckpointContents(**{**payload, "rng": state}))
    # Draw after capturing: the reference sequence.
    expect = (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3))
    random.seed(100)
    np.random.seed(100)
    torch.manual_seed(100)
    restore_rng_state(load_training_checkpoint(tmp_path / "c").rng)
    got = (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3))
    assert got[0] == expect[0] and got[1] == expect[1] and torch.equal(got[2], expect[2])


def test_weights_partial_views_and_non_contiguous(tmp_path):
    fused = torch.arange(12.0).reshape(6, 2)
    state = {"q": fused[:3], "k": fused[3:], "t": torch.arange(6.0).reshape(2, 3).t()}
    save_weights(tmp_path / "w.safetensors", state)
    back = load_weights(tmp_path / "w.safetensors")
    for k, v in state.items():
        assert torch.equal(back[k], v)


def test_whisper_tied_weights_round_trip(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.WhisperConfig(
        vocab_size=60,
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        num_mel_bins=8,
        max_source_positions=16,
        max_target_positions=16,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=3,
    )
    torch.manual_seed(0)
    model = transformers.WhisperForConditionalGeneration(cfg)
    save_weights(tmp_path / "model.safetensors", model.state_dict())
    assert weights_aliases(tmp_path / "model.safetensors") == {
        "proj_out.weight": "model.decoder.embed_tokens.weight"
    }
    state = load_weights(tmp_path / "model.safetensors")
    fresh = transformers.WhisperForConditionalGeneration(cfg)
    fresh.load_state_dict(state, strict=True)
    assert fresh.proj_out.weight is fresh.model.decoder.embed_tokens.weight
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert "proj_out.weight" not in f.keys() and ALIASES_KEY in f.metadata()


def test_a_full_disk_under_safetensors_is_an_os_error_naming_the_file(tmp_path):
    """safetensors reports its write errors as SafetensorError: given back as the OSError it
    is, the atomic writers turn it into one line and remove the half-written directory."""
    resource = pytest.importorskip("resource")
    import signal

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the cap fail, EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (50_000, hard))
    try:
        with pytest.raises(OSError) as ei:
            save_weights(tmp_path / "w.safetensors", {"w": torch.zeros(100_000)})
        with pytest.raises(CheckpointSaveError, match=r"ckpt: File too large \(errno 27\)"):
            with atomic_directory(tmp_path / "ckpt") as tmp:
                save_weights(tmp / "w.safetensors", {"w": torch.zeros(100_000)})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
    assert ei.value.errno == errno.EFBIG and ei.value.filename == str(tmp_path / "w.safetensors")
    assert _entries(tmp_path) == []  # nothing half-written: no ckpt, no .tmp-*


def test_a_file_that_is_not_safetensors_is_named(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"not safetensors at all" * 8)
    for read in (load_weights, weights_aliases):
        with pytest.raises(CheckpointCorruptError, match=r"model\.safetensors: not a readable"):
            read(path)


def test_directory_problem_names_what_is_in_the_way(tmp_path):
    (tmp_path / "file").write_text("x")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "dir").mkdir()
    assert directory_problem(tmp_path / "dir") is None
    assert directory_problem(tmp_path / "new" / "deeper") is None  # created with its parents
    problems = {
        "file": "exists and is not a directory",
        "file/sub": "a parent of it is a file",
        "loop": "a symlink loop",
        "dangling": f"a broken symlink (to {tmp_path / 'nowhere'})",
    }
    for rel, want in problems.items():
        assert str(directory_problem(tmp_path / rel)).startswith(f"{tmp_path / rel}: {want}"), rel


def test_a_failed_file_or_symlink_replacement_keeps_the_old_one_and_no_temporary(tmp_path):
    """atomic_write_bytes and atomic_symlink share one replace-from-a-temporary recipe."""
    (tmp_path / "old").write_text("old")
    link = tmp_path / "latest"
    atomic.atomic_symlink(link, "old")
    assert os.readlink(link) == "old"
    atomic.atomic_symlink(link, "new")  # replaced, not refused as existing
    assert os.readlink(link) == "new"

    in_the_way = tmp_path / "dir"
    (in_the_way / "child").mkdir(parents=True)  # a non-empty directory cannot be replaced
    with pytest.raises(CheckpointSaveError, match=r"could not update .*dir: .*errno"):
        atomic.atomic_symlink(in_the_way, "old")
    with pytest.raises(CheckpointSaveError, match=r"could not write .*dir: .*errno"):
        atomic.atomic_write_bytes(in_the_way, b"x")
    assert (in_the_way / "child").is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir", "latest", "old"]


@pytest.mark.fast
def test_a_file_name_the_filesystem_accepts_is_written_however_long(tmp_path) -> None:
    for name in ("x" * 244 + ".txt", "é" * 127):  # 248 and 254 bytes: legal, but no room left
        target = tmp_path / name
        atomic.atomic_write_text(target, "hi\n")
        assert target.read_text() == "hi\n"
        assert atomic.temporaries_of(target) == []
        # a writer killed mid-write leaves a temporary its reader still finds
        leftover = atomic.temp_sibling(target)
        leftover.write_text("half")
        assert len(os.fsencode(leftover.name)) <= 255
        assert atomic.temporaries_of(target) == [leftover]
        leftover.unlink()


@pytest.mark.fast
def test_a_shortened_old_directory_is_kept_not_renamed_to_its_shortened_name(tmp_path) -> None:
    old = atomic.temp_sibling(tmp_path / ("d" * 250), atomic.OLD_PREFIX)
    old.mkdir()
    actions = atomic.recover_interrupted(tmp_path)
    assert old.is_dir() and [p.name for p in tmp_path.iterdir()] == [old.name]
    assert actions == [f"kept {old.name}: the directory it replaced has a longer name"]


@pytest.mark.fast
def test_file_target_problem_names_what_would_fail_the_write(tmp_path) -> None:
    (tmp_path / "dir.txt").mkdir()
    (tmp_path / "file").write_text("")
    assert atomic.file_target_problem(tmp_path / "new" / "deeper" / "a.txt") is None
    in_the_way = tmp_path / "dir.txt"
    assert atomic.file_target_problem(in_the_way) == f"{in_the_way}: a directory"
    long = tmp_path / ("y" * 256)
    assert atomic.file_target_problem(long) == f"{long}: its name is longer than 255 bytes"
    under_file = tmp_path / "file" / "a.txt"
    assert atomic.file_target_problem(under_file) == (
        f"{under_file}: {tmp_path / 'file'} is a file, not a directory"
    )
    assert atomic.file_target_problem(tmp_path / "file" / "sub" / "a.txt") == (
        f"{tmp_path / 'file' / 'sub' / 'a.txt'}: {tmp_path / 'file'} is a file, not a directory"
    )
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "ro"
        locked.mkdir(mode=0o500)
        problem = atomic.file_target_problem(locked / "a.txt")
        assert problem.startswith(f"{locked / 'a.txt'}: cannot create files in {locked}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir.txt", "file", "ro"][
        : 3 if os.geteuid() != 0 else 2
    ]
