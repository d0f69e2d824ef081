"""One rule names a row (``asrforge.data.ids.row_id``): the id the data gives, else its audio
path as the data gives it, else ``<split>-<row>``. The prepared table, the items built from it,
the skip report and the streamed split all name rows by it."""

from __future__ import annotations

import json

import pytest

from asrforge.config import DataConfig
from asrforge.data.dataset import dropped_by_reason
from asrforge.data.ids import row_id
from asrforge.data.prepare import prepare_split
from asrforge.data.sources import load_arrow, load_source
from asrforge.data.stream import StreamedSplit
from asrforge.model.build import feature_extractor
from asrforge.model.tokenizer import SpecialTokens, train_bpe_tokenizer

pytestmark = pytest.mark.fast


def test_a_row_is_named_by_the_id_it_gives_else_by_its_split_and_number():
    assert row_id("utt7", "train", 3) == "utt7"
    assert row_id("clips/3.wav", "train", 3) == "clips/3.wav"
    assert row_id("", "train", 3) == ""  # an empty string is an id the data gives
    assert row_id(None, "validation", 3) == "validation-3"


@pytest.mark.parametrize("ids", ["some rows", "none"])
def test_rows_are_named_alike_by_the_table_its_items_the_skip_report_and_the_stream(
    ids, tmp_path, tones_dir
):
    (tmp_path / "clips").mkdir()
    lines = []
    for k, r in enumerate(load_arrow(tones_dir)["train"].select(range(6))):
        (tmp_path / "clips" / f"{k}.wav").write_bytes(r["audio"]["bytes"])
        row = {"audio_filepath": f"clips/{k}.wav", "text": r["text"], "lang": r["language"]}
        if ids == "some rows" and k not in (1, 4):  # rows 1 and 4 give no id
            row["id"] = f"utt{k}"
        lines.append(json.dumps(row))
    lines[4] = json.dumps({**json.loads(lines[4]), "text": " "})  # skipped up front
    (tmp_path / "train.jsonl").write_text("\n".join(lines) + "\n")
    if ids == "some rows":
        kept, skipped = ["utt0", "train-1", "utt2", "utt3", "utt5"], "train-4"
    else:  # no id column: the audio paths as the data gives them
        kept, skipped = [f"clips/{k}.wav" for k in (0, 1, 2, 3, 5)], "clips/4.wav"
    cfg = DataConfig(path=tmp_path / "train.jsonl", cache_dir=tmp_path / "cache", batch_size=2)
    split = load_source(cfg).splits["train"]
    tok = train_bpe_tokenizer(["red blue cat dog sun one two sol mar gato"] * 20, 300)
    specials = SpecialTokens.from_tokenizer(tok, True)
    for lazy in (True, False):
        table, report = prepare_split(split, "train", cfg=cfg, tokenizer=tok, specials=specials,
                                      max_target_positions=32, max_seconds=30.0, lazy=lazy)  # fmt: skip
        assert report.skipped == {"empty text": [skipped]}
        assert table.uids() == [table[i].uid for i in range(len(table))]
        assert table.uids() == kept

    streamed_cfg = DataConfig(**{**cfg.model_dump(), "stream": {"enabled": True, "shard_rows": 4}})
    stream = StreamedSplit(streamed_cfg, 0)
    stream.prepare(tokenizer=tok, specials=specials, features=feature_extractor(80, 2.0),
                   eot=specials.eot, max_target_positions=32, max_seconds=30.0)  # fmt: skip
    streamed, dropped = [], {}
    for batch in stream.loader(0, 0, rank=0, world=1):
        streamed += batch.get("uid", [])
        for reason, uids in dropped_by_reason(batch).items():
            dropped.setdefault(reason, []).extend(uids)
    assert sorted(streamed) == sorted(kept)
    assert dropped == {"empty text": [skipped]}
