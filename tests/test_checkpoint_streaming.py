"""One-pass checkpoint writes: safetensors streamed and hashed while written, files in parallel."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from asrforge.checkpoint.manifest import sha256_file, verify
from asrforge.checkpoint.streaming import HashingWriter, torch_save
from asrforge.checkpoint.training import (
    ALIASES_KEY,
    CheckpointContents,
    capture_rng_state,
    load_training_checkpoint,
    load_weights,
    save_training_checkpoint,
    save_weights_hashed,
)

pytestmark = pytest.mark.fast


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    emb = torch.randn(11, 6)
    return {
        "model.decoder.embed_tokens.weight": emb,
        "proj_out.weight": emb,  # tied: one storage, two names
        "layer.bias": torch.randn(6).to(torch.float16),
        "layer.scale": torch.randn(3, 2).to(torch.bfloat16),
        "steps": torch.arange(5, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        "transposed": torch.randn(4, 3).t(),  # not contiguous
    }


def test_streamed_safetensors_equal_the_librarys_and_hash_what_is_on_disk(tmp_path):
    state = _state()
    digest = save_weights_hashed(tmp_path / "ours.safetensors", state)
    assert digest.sha256 == sha256_file(tmp_path / "ours.safetensors")
    assert digest.size == (tmp_path / "ours.safetensors").stat().st_size

    ours = load_file(str(tmp_path / "ours.safetensors"))  # the library reads it
    reference = {k: v.contiguous() for k, v in state.items() if k != "proj_out.weight"}
    save_file(reference, str(tmp_path / "lib.safetensors"))
    theirs = load_file(str(tmp_path / "lib.safetensors"))
    assert ours.keys() == theirs.keys()
    for k in theirs:
        assert ours[k].dtype == theirs[k].dtype and torch.equal(ours[k], theirs[k]), k
    with safe_open(str(tmp_path / "ours.safetensors"), framework="pt") as f:
        meta = f.metadata()
    assert json.loads(meta[ALIASES_KEY]) == {"proj_out.weight": "model.decoder.embed_tokens.weight"}
    back = load_weights(tmp_path / "ours.safetensors")
    assert back["proj_out.weight"] is back["model.decoder.embed_tokens.weight"]  # tie survives
    header_len = int.from_bytes((tmp_path / "ours.safetensors").read_bytes()[:8], "little")
    assert header_len % 8 == 0


def test_transformers_loads_streamed_weights(tmp_path):
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    cfg = WhisperConfig(
        vocab_size=60, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, num_mel_bins=8,
        max_source_positions=10, max_target_positions=10, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, decoder_start_token_id=1,
    )  # fmt: skip
    model = WhisperForConditionalGeneration(cfg)
    model.config.save_pretrained(tmp_path)
    save_weights_hashed(tmp_path / "model.safetensors", model.state_dict())
    loaded = WhisperForConditionalGeneration.from_pretrained(tmp_path)
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k


def test_a_training_checkpoint_written_in_one_pass_verifies_and_loads(tmp_path):
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    path = save_training_checkpoint(
        tmp_path / "ck",
        CheckpointContents(
            model=model.state_dict(),
            ema={k: v * 0.5 for k, v in model.state_dict().items()},
            optimizer=opt.state_dict(),
            scheduler={"last_epoch": 1},
            rng=capture_rng_state(),
            train_state={"step": 1},
            config_yaml="seed: 0\n",
            tokenizer_save=lambda d: (d / "vocab.json").write_text("{}"),
            meta={"step": 1},
        ),
    )
    manifest = verify(path, check_hashes=True)  # every recorded hash matches the bytes on disk
    assert "tokenizer/vocab.json" in manifest["files"] and "ema.safetensors" in manifest["files"]
    ck = load_training_checkpoint(path)
    assert torch.equal(ck.model["weight"], model.weight.detach())
    assert ck.optimizer["state"][0]["exp_avg"].shape == (3, 4)


def test_hashing_writer_refuses_an_existing_file_and_hashes_torch_save(tmp_path):
    (tmp_path / "x").write_text("old")
    with pytest.raises(FileExistsError):
        HashingWriter(tmp_path / "x")
    digest = torch_save({"a": torch.ones(3)}, tmp_path / "obj.pt")
    assert digest.sha256 == sha256_file(tmp_path / "obj.pt")
    assert torch.equal(torch.load(tmp_path / "obj.pt", weights_only=True)["a"], torch.ones(3))
