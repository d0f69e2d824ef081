"""A tokenizer asrforge trains itself has a token for every language of the data: a run on Ganda
(``lg``, which Whisper lacks) needs no mapping and no ``vocab build``."""

from __future__ import annotations

import pytest

from asrforge.data.sources import load_arrow
from asrforge.errors import UserError
from asrforge.model.tokenizer import SpecialTokens, load_tokenizer, train_bpe_tokenizer
from tests.conftest import tiny_config
from tests.test_sources import write_jsonl


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


# Each language's rows repeat one word of its own, so a BPE that read them holds that word whole.
LEFT_OUT_TRAIN = (
    [{"text": "orchard orchard orchard", "language": "EN"}] * 8
    + [{"text": "banana banana banana", "language": "en-US"}] * 8
    + [{"text": "mwebale mwebale mwebale", "language": "Ganda"}] * 8
    + [{"text": "kwagala kwagala kwagala", "language": None}] * 8
)
LEFT_OUT_EVAL = [{"text": "sawubona", "language": "zu"}, {"text": "mwebale", "language": "lg"}]


@pytest.mark.fast
@pytest.mark.parametrize("stream", [False, True], ids=["arrow", "stream"])
@pytest.mark.parametrize("languages", [None, ["English", "Zulu"]], ids=["all", "filtered"])
def test_a_bpe_from_scratch_learns_only_the_languages_data_languages_keeps(
    tmp_path, stream, languages
):
    from types import SimpleNamespace

    from datasets import Dataset

    from asrforge.data.stream import StreamedSplit
    from asrforge.train.setup import run_tokenizer
    from asrforge.train.setup_data import SplitTexts

    def split(rows):
        return Dataset.from_dict({k: [r[k] for r in rows] for k in ("text", "language")})

    data = {"languages": languages}
    if stream:
        (tmp_path / "corpus").mkdir()
        rows = [{"audio": f"{i}.wav", **r} for i, r in enumerate(LEFT_OUT_TRAIN)]
        write_jsonl(tmp_path / "corpus" / "train.jsonl", rows)
        data["stream"] = {"enabled": True, "shard_rows": 10}
    cfg = tiny_config(
        tmp_path / "run", tmp_path / "corpus", data=data, model={"bpe_vocab_size": 400}
    )
    evaluation = split(LEFT_OUT_EVAL)
    if stream:
        texts = SplitTexts(cfg.data, eval_split=evaluation, stream=StreamedSplit(cfg.data, seed=0))
    else:
        texts = SplitTexts(cfg.data, split(LEFT_OUT_TRAIN), evaluation)
    acc = SimpleNamespace(is_main_process=True, num_processes=1)
    tok = run_tokenizer(cfg, tmp_path / "run", acc, texts)

    vocab = tok.get_vocab()
    assert {"Ġorchard", "Ġbanana"} <= set(vocab)  # "EN" and "en-US" are English
    # the evaluation split's kept languages get tokens too: a run selects on them
    assert tok.convert_tokens_to_ids("<|zu|>") != tok.unk_token_id
    kept_all = languages is None
    assert ("Ġmwebale" in vocab) == kept_all
    assert any("kwag" in t for t in vocab) == kept_all  # a row with no language: kept by no filter
    assert any("mweb" in t for t in vocab) == kept_all
    assert (tok.convert_tokens_to_ids("<|lg|>") != tok.unk_token_id) == kept_all


@pytest.mark.fast
def test_another_rank_never_trains_a_bpe_of_its_own(tmp_path):
    """It reads the one rank zero saved; where it cannot see it, it stops and says why."""
    from types import SimpleNamespace

    from datasets import Dataset

    from asrforge.errors import UserError
    from asrforge.train.setup import run_tokenizer
    from asrforge.train.setup_data import SplitTexts

    cfg = tiny_config(tmp_path / "run", tmp_path / "corpus")
    rows = Dataset.from_dict({"text": ["an orchard"], "language": ["en"]})
    other_rank = SimpleNamespace(is_main_process=False, num_processes=1)
    with pytest.raises(UserError, match=r"tokenizer: the tokenizer rank zero saved is not there"):
        run_tokenizer(cfg, tmp_path / "run", other_rank, SplitTexts(cfg.data, rows, rows))
    assert not (tmp_path / "run").exists()
