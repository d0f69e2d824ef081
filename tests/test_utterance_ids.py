"""A row whose ``id`` cell is empty is named one way everywhere: in the skip report, by the
items built from it, and where the table's ids are read whole (packing's augmentation draws)."""

from __future__ import annotations

import json

from asrforge.config import DataConfig
from asrforge.data.prepare import prepare_split
from asrforge.data.sources import load_arrow, load_source
from asrforge.model.tokenizer import SpecialTokens, train_bpe_tokenizer


def test_rows_without_an_id_are_named_by_their_row_everywhere(tmp_path, tones_dir):
    (tmp_path / "clips").mkdir()
    lines = []
    for k, r in enumerate(load_arrow(tones_dir)["train"].select(range(6))):
        (tmp_path / "clips" / f"{k}.wav").write_bytes(r["audio"]["bytes"])
        row = {"audio_filepath": f"clips/{k}.wav", "text": r["text"], "lang": r["language"]}
        if k not in (1, 4):  # rows 1 and 4 give no id
            row["id"] = f"utt{k}"
        lines.append(json.dumps(row))
    lines[4] = json.dumps({**json.loads(lines[4]), "text": " "})  # skipped up front
    (tmp_path / "train.jsonl").write_text("\n".join(lines) + "\n")
    cfg = DataConfig(path=tmp_path / "train.jsonl", cache_dir=tmp_path / "cache")
    split = load_source(cfg).splits["train"]
    tok = train_bpe_tokenizer(["red blue cat dog sun one two sol mar gato"] * 20, 300)
    specials = SpecialTokens.from_tokenizer(tok, True)
    for lazy in (True, False):
        table, report = prepare_split(split, "train", cfg=cfg, tokenizer=tok, specials=specials,
                                      max_target_positions=32, max_seconds=30.0, lazy=lazy)  # fmt: skip
        assert report.skipped == {"empty text": ["train-4"]}
        assert table.uids() == [table[i].uid for i in range(len(table))]
        assert table.uids() == ["utt0", "train-1", "utt2", "utt3", "utt5"]
