"""A tokenizer asrforge trains itself has a token for every language of the data: a run on Ganda
(``lg``, which Whisper lacks) needs no mapping and no ``vocab build``."""

from __future__ import annotations

import pytest

from asrforge.data.sources import load_arrow
from asrforge.errors import UserError
from asrforge.model.tokenizer import SpecialTokens, load_tokenizer, train_bpe_tokenizer
from tests.conftest import tiny_config


@pytest.mark.fast
def test_a_trained_tokenizer_holds_the_data_languages_after_whispers_own():
    tok = train_bpe_tokenizer(["la la tone"] * 20, 300, languages=["lg", "en", "Klingon"])
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|zh|>", "<|lg|>", "<|translate|>")}
    assert ids["<|zh|>"] < ids["<|lg|>"] < ids["<|translate|>"]
    assert tok.convert_tokens_to_ids("<|Klingon|>") == tok.unk_token_id
    specials = SpecialTokens.from_tokenizer(tok, True)
    assert specials.token_language("lg") == "lg"
    assert specials.prompt("Ganda")[1] == ids["<|lg|>"]
    without = SpecialTokens.from_tokenizer(train_bpe_tokenizer(["la la tone"] * 20, 300), True)
    with pytest.raises(UserError, match="has no token"):
        without.prompt("lg")


def ganda(tones_dir, out):
    """The tones data set with its Spanish rows labelled Ganda."""
    splits = load_arrow(tones_dir)
    relabelled = splits.map(lambda r: {"language": "lg" if r["language"] == "es" else "en"})
    relabelled.save_to_disk(str(out))
    return out


@pytest.mark.parametrize("stream", [False, True], ids=["map", "stream"])
def test_a_run_from_scratch_trains_on_a_language_whisper_lacks(tmp_path, tones_dir, stream):
    from asrforge.train.loop import Trainer

    data = ganda(tones_dir, tmp_path / "ganda")
    sections = {"train": {"max_steps": 2, "log_every": 1}, "eval": {"eval_steps": 2}}
    if stream:  # a directory of parquet files streams; its validation file is read whole
        for name, split in load_arrow(data).items():
            split.to_parquet(str(tmp_path / "files" / f"{name}.parquet"))
        data = tmp_path / "files"
        sections["data"] = {"stream": {"enabled": True}}
    cfg = tiny_config(tmp_path / "run", data, **sections)
    Trainer(cfg, []).fit()
    tok = load_tokenizer(tmp_path / "run" / "tokenizer")
    assert tok.convert_tokens_to_ids("<|lg|>") != tok.unk_token_id
