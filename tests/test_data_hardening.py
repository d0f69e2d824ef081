"""Data the loop used to lose or crash on: languages by name or locale, Cantonese, Ganda, NaN and
empty audio, evaluation drops, empty splits, missing and non-string transcripts."""

from __future__ import annotations

import io
import json
import logging
import re
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from datasets import Dataset

from asrforge.cli import main
from asrforge.config import DataConfig, SelectionConfig
from asrforge.data.audio import SAMPLE_RATE
from asrforge.data.prepare import prepare_split
from asrforge.data.rules import SkipReport, language_filter
from asrforge.data.sources import load_arrow
from asrforge.errors import UserError
from asrforge.model.tokenizer import WHISPER_SPECIALS, SpecialTokens, train_bpe_tokenizer
from asrforge.selection.selector import build_selector
from asrforge.text.languages import find_language_code, resolve_language
from tests.conftest import save_english_only_model, tiny_config

NAN_REASON = "non-finite audio (NaN/inf samples)"


def variant(tones_dir: Path, out: Path, edit, same_types: bool = True) -> Path:
    """A copy of the tones data set with ``edit(split, rows)`` applied to each split's rows
    (a dict of columns), e.g. to relabel languages or break clips; with ``same_types`` the
    columns keep their types, else they are inferred from the edited rows."""
    from datasets import Dataset, DatasetDict, Features, Value

    dd = load_arrow(tones_dir)
    splits = {}
    for name, split in dd.items():
        rows = split.to_dict()
        edit(name, rows)
        # audio as the plain struct it is stored as (encoding an Audio feature needs torchcodec)
        audio = {"bytes": Value("binary"), "path": Value("string")}
        features = Features({**split.features, "audio": audio}) if same_types else None
        splits[name] = Dataset.from_dict(rows, features=features)
    DatasetDict(splits).save_to_disk(str(out))
    return out


def wav_bytes(samples: np.ndarray, subtype: str = "FLOAT") -> bytes:
    buf = io.BytesIO()
    sf.write(buf, samples.astype(np.float32), SAMPLE_RATE, format="WAV", subtype=subtype)
    return buf.getvalue()


def tokenizer_without(*languages: str):
    """A small BPE tokenizer with Whisper's special tokens except those of ``languages``
    (a pre-v3 Whisper has no ``<|yue|>``)."""
    tok = train_bpe_tokenizer(["la la tone beep boop"] * 20, 300)
    if not languages:
        return tok
    from transformers import WhisperTokenizer

    state = json.loads(tok.backend_tokenizer.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["merges"]]
    out = WhisperTokenizer(vocab=state["vocab"], merges=merges)
    drop = {f"<|{c}|>" for c in languages}
    out.add_special_tokens(
        {"additional_special_tokens": [t for t in WHISPER_SPECIALS if t not in drop]}
    )
    out.pad_token = "<|endoftext|>"
    return out


def save_random_whisper(hf: Path) -> None:
    """A random one-layer Whisper and :func:`tokenizer_without`'s tokenizer saved as a
    transformers directory ``hf``: its text is noise, decoded in a moment."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    tok = tokenizer_without()
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    cfg = WhisperConfig(
        vocab_size=len(tok), d_model=16, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
        decoder_ffn_dim=32, num_mel_bins=80, max_source_positions=100, max_target_positions=32,
        pad_token_id=eot, bos_token_id=eot, eos_token_id=eot,
        decoder_start_token_id=tok.convert_tokens_to_ids("<|startoftranscript|>"),
        begin_suppress_tokens=None, suppress_tokens=None,
    )  # fmt: skip
    WhisperForConditionalGeneration(cfg).save_pretrained(str(hf))
    tok.save_pretrained(str(hf))


def prepare(split, tok, specials, **data):
    cfg = DataConfig(path=Path("unused"), **data)
    return prepare_split(
        split, "train", cfg=cfg, tokenizer=tok, specials=specials,
        max_target_positions=64, max_seconds=30.0,
    )  # fmt: skip


def fit(cfg):
    from asrforge.train.loop import Trainer

    return Trainer(cfg, []).fit()


# ---------------------------------------------------------------------------------------------
# Item 9: languages


@pytest.mark.fast
@pytest.mark.parametrize(
    "given, code",
    [("English", "en"), ("en-US", "en"), ("en_us", "en"), ("zh-CN", "zh"), ("sv-SE", "sv"),
     ("zh-HK", "yue"), ("zh-yue", "yue"), ("yue_Hant_HK", "yue"), ("Cantonese", "yue"),
     ("zh-TW", "zh"), ("Luganda", "lg")],
)  # fmt: skip
def test_codes_names_and_locales_resolve_alike(given, code):
    assert find_language_code(given) == code
    assert resolve_language(given, strict=False) == code


@pytest.mark.fast
def test_an_unknown_language_filter_is_an_error_naming_its_entry():
    assert language_filter(["English", "es-MX"]) == {"en", "es"}
    with pytest.raises(UserError, match=r"data\.languages\.1: unknown language 'klingon'"):
        language_filter(["en", "klingon"])


@pytest.mark.fast
def test_data_languages_match_names_and_locales_in_the_language_column(tmp_path, tones_dir):
    spellings = {"en": ["en-US", "English", "en"], "es": ["es-ES", "Spanish"]}

    def relabel(_split, rows):
        rows["language"] = [
            spellings[x][i % len(spellings[x])] for i, x in enumerate(rows["language"])
        ]

    split = load_arrow(variant(tones_dir, tmp_path / "d", relabel))["train"]
    n_en = sum(resolve_language(x, strict=False) == "en" for x in split["language"])
    tok = tokenizer_without()
    specials = SpecialTokens.from_tokenizer(tok, True)
    utts, report = prepare(split, tok, specials, languages=["english"])
    assert len(utts) == n_en > 0 and report.n_skipped == 0
    assert {u.language for u in utts} == {"en"}
    assert all(u.prompt[1] == specials.languages["en"] for u in utts)
    utts, _ = prepare(split, tok, specials, languages=["en-GB", "es"])
    assert len(utts) == len(split)


@pytest.mark.fast
def test_the_skip_report_holds_each_dropped_id_once_per_reason():
    # workers drop a clip again every epoch, and every rank's drops are gathered into each one
    report = SkipReport("train", 10, {"empty text": ["a"]})
    merged = report.with_dropped({"empty text": ["a", "b", "b"], "unreadable audio": ["b", "c"]})
    assert merged.skipped == {"empty text": ["a", "b"], "unreadable audio": ["b", "c"]}
    assert report.skipped == {"empty text": ["a"]}  # with_dropped leaves the report as it was
    skipped = {"empty text": ["a"]}
    assert SkipReport.merge(skipped, {"empty text": ["b", "a"], "x": ["b"]}) == ["b", "b"]
    assert skipped == {"empty text": ["a", "b"], "x": ["b"]}


@pytest.mark.fast
def test_a_lazily_prepared_split_says_only_what_its_checks_up_front_found(tmp_path, caplog):
    split = Dataset.from_dict({"text": ["a b", "", "c"], "language": ["en"] * 3})
    tok = tokenizer_without()
    specials = SpecialTokens.from_tokenizer(tok, True)
    cfg = DataConfig(path=Path("unused"))
    _, report = prepare_split(split, "train", cfg=cfg, tokenizer=tok, specials=specials,
                              max_target_positions=64, max_seconds=30.0, lazy=True)  # fmt: skip
    later = "audio and label lengths are checked as the rows are read, and what that skips is " \
            "reported at each save"  # fmt: skip
    with caplog.at_level(logging.INFO, logger="asrforge"):
        report.log(tmp_path)
        # what training's reads dropped, once known: the counts up to a step, all of them
        report.with_dropped({"unreadable audio": ["train-2"]}).log(tmp_path, " up to step 3")
    lines = caplog.text.splitlines()
    assert "split train: skipped 1 of 3 utterances up front (1 empty text): train-1; all ids " \
           "in" in lines[0] and lines[0].endswith(f"skipped-train.json; {later}")  # fmt: skip
    assert "split train: skipped 2 of 3 utterances up to step 3 (1 empty text, 1 unreadable " \
           "audio): train-1, train-2; all ids in" in lines[1] and "save" not in lines[1]
    caplog.clear()
    _, clean = prepare_split(Dataset.from_dict({"text": ["a"], "language": ["en"]}), "train",
                             cfg=cfg, tokenizer=tok, specials=specials, max_target_positions=64,
                             max_seconds=30.0, lazy=True)  # fmt: skip
    with caplog.at_level(logging.INFO, logger="asrforge"):
        clean.log(None)
    assert f"split train: 1 utterances, none skipped up front; {later}" in caplog.text


@pytest.mark.fast
def test_rows_left_out_by_data_languages_are_counted_apart_not_skipped(tmp_path, tones_dir, caplog):
    # a deliberate filter is no defect of the data: the log says kept / left out (per language)
    # / skipped, the skip report does not list them; a filter that leaves nothing names the
    # languages the split has (it said "48 utterances, none skipped", then "no usable")
    split = load_arrow(tones_dir)["train"]
    n = {lang: split["language"].count(lang) for lang in ("en", "es")}
    total = len(split)
    tok = tokenizer_without()
    specials = SpecialTokens.from_tokenizer(tok, True)
    _, report = prepare(split, tok, specials, languages=["English"])
    assert (report.left_out, report.n_skipped) == ({"es": n["es"]}, 0)
    with caplog.at_level(logging.INFO, logger="asrforge"):
        report.log(tmp_path)
        report.with_dropped({"unreadable audio": ["u1"]}).log(tmp_path, " up to step 3")
    left = f"left out by data.languages (es {n['es']})"
    assert f"split train: {total} utterances: {n['en']} kept, {n['es']} {left}, none skipped" in (
        caplog.text
    )
    assert f"{total} utterances: {n['en'] - 1} kept, {n['es']} {left}, 1 skipped up to step 3" in (
        caplog.text
    )
    assert json.loads((tmp_path / "skipped-train.json").read_text()) == {"unreadable audio": ["u1"]}

    cfg = tiny_config(tmp_path / "run", tones_dir, data={"languages": ["German"]})
    with pytest.raises(UserError) as e:
        fit(cfg)
    assert str(e.value).endswith(
        f"data.languages ['German'] leaves out {total} of its {total} utterances, whose languages "
        f"are en ({n['en']}), es ({n['es']})"
    )


@pytest.mark.fast
def test_vocab_build_reads_the_transcripts_of_every_spelling_of_its_language(tmp_path):
    from datasets import Dataset, DatasetDict

    from asrforge.model.vocab import read_transcripts

    rows = [("a", "Georgian"), ("b", "ka-GE"), ("c", "ka"), ("d", "en"), (None, "ka")]
    split = Dataset.from_dict({"text": [t for t, _ in rows], "language": [x for _, x in rows]})
    DatasetDict({"train": split}).save_to_disk(str(tmp_path / "d"))
    assert read_transcripts(tmp_path / "d", "georgian") == ["a", "b", "c"]


@pytest.mark.fast
def test_cantonese_is_selected_as_cantonese_and_decoded_with_zh_without_a_yue_token(
    tmp_path, tones_dir, caplog
):
    def cantonese(_split, rows):
        rows["language"] = ["zh-HK"] * len(rows["language"])

    split = load_arrow(variant(tones_dir, tmp_path / "d", cantonese))["train"]
    pre_v3 = tokenizer_without("yue")
    specials = SpecialTokens.from_tokenizer(pre_v3, True)
    assert specials.token_language("zh-HK") == "zh"
    with caplog.at_level(logging.INFO, logger="asrforge"):
        utts, report = prepare(split, pre_v3, specials)
    assert len(utts) == len(split) and report.n_skipped == 0
    assert {u.language for u in utts} == {"yue"}  # what selection and metrics go by
    assert {u.prompt[1] for u in utts} == {specials.languages["zh"]}  # what the decoder sees
    assert "language yue is decoded with <|zh|>" in caplog.text
    # a tokenizer with <|yue|> decodes it with its own token
    v3 = SpecialTokens.from_tokenizer(tokenizer_without(), True)
    assert v3.token_language("zh-HK") == "yue" and v3.prompt("yue")[1] != v3.prompt("zh")[1]
    # selection: Cantonese is in group A (by_wer, 3000 steps), not Chinese's group B
    selector = build_selector(SelectionConfig(), "zh-HK", partial=False)
    assert selector.policy_name == "by_wer" and selector.max_steps == 3000
    assert "cantonese" in selector.why and "group A" in selector.why


def swedish_half(_split, rows):
    """Every utterance not in English becomes Swedish (the tones are English and Spanish)."""
    rows["language"] = ["en" if x == "en" else "sv-SE" for x in rows["language"]]


@pytest.mark.fast
def test_an_english_only_model_refuses_other_languages_naming_them(tmp_path, tones_dir):
    split = load_arrow(variant(tones_dir, tmp_path / "d", swedish_half))["train"]
    n_sv = sum(x == "sv-SE" for x in split["language"])
    tok = tokenizer_without()
    english_only = SpecialTokens.from_tokenizer(tok, False)
    with pytest.raises(UserError, match=rf"English-only.*'sv-SE' \({n_sv} utterances, code 'sv'\)"):
        prepare(split, tok, english_only)
    with pytest.raises(UserError, match=r"data\.languages: \[en\]\), or start from a multilingual Whisper"):
        prepare(split, tok, english_only)
    utts, report = prepare(split, tok, english_only, languages=["English"])  # Swedish left out
    assert len(utts) == len(split) - n_sv and report.n_skipped == 0
    assert {u.language for u in utts} == {"en"}


@pytest.mark.fast
def test_fine_tuning_an_english_only_model_on_swedish_stops_before_training(tmp_path, tones_dir):
    pretrained = save_english_only_model(tmp_path, tones_dir)
    data = variant(tones_dir, tmp_path / "d", swedish_half)
    cfg = tiny_config(tmp_path / "run", data, model={"pretrained": str(pretrained)},
                      train={"max_steps": 1, "log_every": 1}, eval={"eval_steps": None})  # fmt: skip
    with pytest.raises(UserError, match=r"English-only.*'sv-SE' \(\d+ utterances"):
        fit(cfg)
    assert not list((tmp_path / "run").rglob("step-*"))  # not a step trained


@pytest.mark.fast
def test_rows_without_a_language_are_named_with_the_ways_to_give_one(tmp_path, tones_dir):
    def blank_two(name, rows):
        rows["language"][3] = rows["language"][7] = None if name == "train" else "en"

    split = load_arrow(variant(tones_dir, tmp_path / "d", blank_two))["train"]
    tok = tokenizer_without()
    with pytest.raises(UserError) as e:
        prepare(split, tok, SpecialTokens.from_tokenizer(tok, True))
    message = str(e.value)
    ids = split["id"]
    assert f"2 utterance(s) give no language (ids {ids[3]}, {ids[7]})" in message
    assert "data.language" in message and "data.columns.language" in message
    assert "none given" not in message and "{lg: sw}" not in message
    # with a language that has no token as well, both are said
    split = split.map(lambda r, i: {"language": "Klingon" if i == 0 else r["language"]},
                      with_indices=True)  # fmt: skip
    with pytest.raises(UserError, match=r"give no language .*; and language 'Klingon' \(1 utt"):
        prepare(split, tok, SpecialTokens.from_tokenizer(tok, True))


@pytest.mark.fast
def test_language_tokens_must_name_known_languages_with_a_token():
    tok = tokenizer_without()
    specials = SpecialTokens.from_tokenizer(tok, True, {"Ganda": "Swahili"})
    assert specials.token_language("lg") == "sw" and specials.prompt("lg") == specials.prompt("sw")
    with pytest.raises(UserError, match=r"data\.language_tokens\.lg: unknown language 'xx'"):
        SpecialTokens.from_tokenizer(tok, True, {"lg": "xx"})
    with pytest.raises(UserError, match=r"data\.language_tokens\.yue: 'ig' has no token"):
        SpecialTokens.from_tokenizer(tok, True, {"yue": "ig"})


def test_ganda_mapped_to_an_existing_token_trains_under_group_c(tmp_path, tones_dir):
    def ganda(_split, rows):
        rows["language"] = ["lg"] * len(rows["language"])

    data = variant(tones_dir, tmp_path / "d", ganda)
    cfg = tiny_config(
        tmp_path / "run", data, data={"language_tokens": {"lg": "sw"}},
        train={"max_steps": 2, "log_every": 1}, eval={"eval_steps": None, "max_new_tokens": 4},
    )  # fmt: skip
    result = fit(cfg)
    assert result.status == "completed" and result.step == 2
    log_text = (tmp_path / "run" / "train.log").read_text()
    assert "group C" in log_text and "by_loss" in log_text
    assert "language lg is decoded with <|sw|>" in log_text
    assert not (tmp_path / "run" / "skipped-train.json").exists()  # nothing dropped
    records = (tmp_path / "run" / "eval" / "step-000002.jsonl").read_text().splitlines()
    assert {json.loads(r)["language"] for r in records[:-1]} == {"lg"}
    # the bundle keeps the mapping: it transcribes Ganda (by code or name) under <|sw|>
    from asrforge.bundle import export_bundle, load_bundle

    bundle = load_bundle(export_bundle(tmp_path / "run", tmp_path / "bundle"))
    assert bundle.languages == ["lg"] and bundle.specials.token_language("lg") == "sw"
    wave = np.full(8000, 0.01, dtype=np.float32)
    assert bundle.recognize([wave], "Luganda")[0].language == "lg"


# ---------------------------------------------------------------------------------------------
# Items 10 and 20: NaN/inf and empty audio, evaluation drops


CACHES = {
    "no cache": {},
    "log-mel cache": {"data": {"cache_features": True}},
    "encoder cache": {"model": {"freeze_encoder": True}, "data": {"cache_encoder": True}},
}


@pytest.mark.parametrize("cache", list(CACHES))
def test_nan_and_empty_clips_are_skipped_and_reported_in_training_and_evaluation(
    tmp_path, tones_dir, cache
):
    broken: dict[str, dict[str, str]] = {"train": {}, "validation": {}}

    def poison(split, rows):
        if split not in broken:
            return
        nan = np.full(8000, 0.1, dtype=np.float32)
        nan[100] = np.nan
        inf = np.full(8000, 0.1, dtype=np.float32)
        inf[5] = np.inf
        for i, (samples, why) in enumerate(
            [(nan, NAN_REASON), (inf, NAN_REASON), (np.zeros(0), "empty audio (0 samples)")]
        ):
            rows["audio"][i] = {"bytes": wav_bytes(samples), "path": None}
            broken[split][rows["id"][i]] = why

    data = variant(tones_dir, tmp_path / "d", poison)
    cfg = tiny_config(
        tmp_path / "run", data, train={"max_steps": 6, "log_every": 1},
        eval={"eval_steps": None, "max_new_tokens": 4}, **CACHES[cache],
    )  # fmt: skip
    result = fit(cfg)
    run = tmp_path / "run"
    assert result.status == "completed"  # no NaN loss, no divergence (nor a NaN cached)
    log_text = (run / "train.log").read_text()
    # 0-sample clips: the skip report (up front, or found in the workers without a cache)
    nan_train = sorted(u for u, w in broken["train"].items() if w == NAN_REASON)
    for split in ("train", "validation"):
        skipped = json.loads((run / f"skipped-{split}.json").read_text())
        skipped = {reason: sorted(uids) for reason, uids in skipped.items()}
        empty = [u for u, w in broken[split].items() if "empty" in w]
        # the training clips dropped during the run (6 steps of 8: every clip seen) join it
        assert skipped == ({"empty audio (0 samples)": empty} | (
            {NAN_REASON: nan_train} if split == "train" else {}
        ))  # fmt: skip
    # NaN/inf clips: dropped from their batches, by id and reason
    assert "dropped clips: {'non-finite audio (NaN/inf samples)'" in log_text
    assert all(u in log_text for u in nan_train)
    assert "skipped: non-finite" not in log_text  # no step saw a NaN loss or gradient
    # evaluation: n shrinks by the dropped clips, and the record says which and why
    summary = json.loads((run / "eval" / "step-000006.jsonl").read_text().splitlines()[-1])
    nan_eval = sorted(u for u, w in broken["validation"].items() if w == NAN_REASON)
    assert summary["n_dropped"] == len(nan_eval) == 2
    assert sorted(summary["dropped_utterances"][NAN_REASON]) == nan_eval
    assert summary["n"] == 12 - 3  # 12 clips, one skipped up front, two dropped in evaluation
    assert np.isfinite(summary["loss"])
    assert f"evaluation: dropped 2 of 11 clips (2 {NAN_REASON})" in log_text


@pytest.mark.fast
def test_transcribe_warns_about_nan_and_empty_audio(tmp_path, caplog):
    from asrforge.bundle import export_bundle, load_bundle

    hf = tmp_path / "hf"
    save_random_whisper(hf)
    bundle = load_bundle(export_bundle(hf, tmp_path / "bundle"))
    nan = np.full(16000, 0.1, dtype=np.float32)
    nan[7] = np.nan
    with caplog.at_level(logging.WARNING):
        out = bundle.recognize([nan, np.zeros(0, np.float32)], "en")
    assert [t.text for t in out] == ["", ""] and [t.segments for t in out] == [[], []]
    assert f"recording 0: {NAN_REASON}" in caplog.text
    assert "recording 1: empty audio (0 samples)" in caplog.text


# ---------------------------------------------------------------------------------------------
# Item 21: data errors are clear


@pytest.mark.fast
def test_an_empty_train_split_is_a_user_error(tmp_path, tones_dir, capsys):
    def empty(split, rows):
        if split == "train":
            for column in rows.values():
                column.clear()

    data = variant(tones_dir, tmp_path / "d", empty)
    with pytest.raises(UserError, match=r"split\(s\) 'train' have no rows"):
        fit(tiny_config(tmp_path / "run", data))
    config = tmp_path / "c.yaml"
    config.write_text(tiny_config(tmp_path / "run", data).to_yaml())
    assert main(["train", str(config)]) == 2
    assert "have no rows" in capsys.readouterr().err


def test_missing_transcripts_are_skipped_before_the_tokenizer_is_trained(tmp_path, tones_dir):
    missing: list[str] = []

    def holes(split, rows):
        if split == "train":
            for i in range(0, len(rows["text"]), 5):
                rows["text"][i] = None
                missing.append(rows["id"][i])

    data = variant(tones_dir, tmp_path / "d", holes)
    cfg = tiny_config(
        tmp_path / "run", data, train={"max_steps": 1}, eval={"eval_steps": None, "at_end": False}
    )
    assert fit(cfg).status == "completed"
    run = tmp_path / "run"
    assert json.loads((run / "skipped-train.json").read_text()) == {"empty text": missing}
    assert (
        f"{len(missing)} of 48 transcripts are empty or missing" in (run / "train.log").read_text()
    )


@pytest.mark.fast
def test_a_text_column_of_numbers_is_an_error_naming_the_column_and_type(tmp_path, tones_dir):
    def numbers(_split, rows):
        rows["text"] = list(range(len(rows["text"])))

    data = variant(tones_dir, tmp_path / "d", numbers, same_types=False)
    with pytest.raises(UserError, match=r"column 'text' holds int64, expected strings"):
        load_arrow(data)
    config = tmp_path / "c.yaml"
    config.write_text(tiny_config(tmp_path / "run", data).to_yaml())
    assert main(["train", str(config)]) == 2


@pytest.mark.fast
def test_transcripts_of_whitespace_only_are_skipped_as_empty_up_front(tmp_path, tones_dir):
    """Blank as ``str.strip`` sees it (Unicode spaces too), without a trimmed copy of the texts."""
    blanks = {0: None, 1: "", 2: "  ", 3: "\u3000\t", 4: "\u00a0\n"}

    def edit(split, rows):
        for i, text in blanks.items():
            rows["text"][i] = text
        rows["text"][5] = " tone beep "  # padded, not blank: kept

    split = load_arrow(variant(tones_dir, tmp_path / "d", edit))["train"]
    tok = tokenizer_without()
    utts, report = prepare(split, tok, SpecialTokens.from_tokenizer(tok, True))
    ids = list(split["id"])
    assert report.skipped == {"empty text": [ids[i] for i in blanks]}
    assert len(utts) == len(split) - len(blanks) and utts[0].text == "tone beep"


# ---------------------------------------------------------------------------------------------
# A split with no usable clip stops the run, naming it; only some unusable: dropped, counted


def dead_manifest(root: Path, rows: int = 4, *, files: int = 1) -> Path:
    """A NeMo manifest of ``rows`` rows naming ``files`` files in turn (``x.wav``, else
    ``x0.wav``, ``x1.wav``, ...) which hold text: each gives a duration, so only reading the file
    tells that it is no audio."""
    root.mkdir(parents=True, exist_ok=True)
    names = ["x.wav"] if files == 1 else [f"x{i}.wav" for i in range(files)]
    for name in names:
        (root / name).write_text("this is not audio\n" * 50)
    lines = [
        json.dumps({"audio_filepath": names[i % files], "text": "tone beep", "duration": 1.0,
                    "lang": "en"})
        for i in range(rows)
    ]  # fmt: skip
    (root / "train.jsonl").write_text("".join(f"{line}\n" for line in lines))
    return root / "train.jsonl"


@pytest.mark.fast
def test_an_unreadable_file_is_skipped_up_front_though_the_data_gives_its_duration(tmp_path):
    """Rows naming the same file share its path as their id, and each row is counted."""
    from asrforge.data.sources import load_source

    cfg = DataConfig(path=dead_manifest(tmp_path / "d"))
    split = load_source(cfg).splits["train"]
    tok = tokenizer_without()
    table, report = prepare_split(
        split, "validation", cfg=cfg, tokenizer=tok, specials=SpecialTokens.from_tokenizer(tok, True),
        max_target_positions=64, max_seconds=30.0,
    )  # fmt: skip
    assert len(table) == 0 and report.total == 4 and report.n_skipped == 4
    assert report.skipped == {"unreadable audio": ["x.wav"] * 4}
    message = str(report.nothing_usable(cfg.path, None))
    assert message.startswith("data: no usable utterances in split 'validation' of ")
    assert "all 4 clips were skipped (4 unreadable audio: x.wav, x.wav, x.wav ... (+1))" in message


@pytest.mark.fast
def test_a_manifest_of_unreadable_clips_exits_2_before_step_1_leaving_nothing(
    tmp_path, tones_dir, capsys
):
    # four files: rows of one file are one utterance, which a carve holds out whole
    manifest = dead_manifest(tmp_path / "bad", files=4)
    run = tmp_path / "runs" / "dead"
    cfg = tiny_config(
        run, manifest, data={"eval_carve": {"size": 2}},
        train={"max_steps": 3}, eval={"at_start": False, "eval_steps": 2, "max_new_tokens": 4},
    )  # fmt: skip
    config = tmp_path / "c.yaml"
    config.write_text(cfg.to_yaml())
    assert main(["train", str(config)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "no usable utterances in split 'validation'" in err
    assert re.search(r"all 2 clips were skipped \(2 unreadable audio: x\d\.wav, x\d\.wav\)", err)
    assert not (tmp_path / "runs").exists()  # the run made it: nothing of it stays


@pytest.mark.fast
def test_a_training_split_of_unreadable_clips_stops_before_it_trains_leaving_nothing(
    tmp_path, clips
):
    """Checked as the workers read it (lazily prepared), the split is refused once an epoch's
    worth of clips was dropped; the steps on no audio trained nothing, so no trace stays."""
    corpus = tmp_path / "corpus"
    dead_manifest(corpus, rows=12)
    good = [r for r in clips if r["split"] == "validation"]
    (corpus / "validation.jsonl").write_text("".join(
        json.dumps({"audio_filepath": r["file"], "text": r["text"], "lang": r["language"]}) + "\n"
        for r in good
    ))  # fmt: skip
    run = tmp_path / "run"
    cfg = tiny_config(
        run, corpus, data={"batch_size": 4}, train={"max_steps": 5},
        eval={"at_start": False, "eval_steps": None, "at_end": False},
    )  # fmt: skip
    with pytest.raises(UserError) as caught:
        fit(cfg)
    message = str(caught.value)
    assert f"no usable utterances in split 'train' of {corpus}" in message
    # 12 rows naming one file: 12 clips dropped, counted each
    assert "all 12 clips were dropped when read, and none trained (12 unreadable" in message
    assert not run.exists()


@pytest.mark.fast
def test_a_training_split_with_a_usable_clip_is_never_stopped_by_its_dropped_ones():
    from asrforge.data.dataset import UsableClipWatch

    def batch(size, dropped):
        reasons = ["unreadable audio"] * len(dropped)
        return {"size": size, "dropped": dropped, "dropped_reasons": reasons}

    watch = UsableClipWatch("train", "data", clips_per_epoch=4)
    watch.see(batch(0, ["a", "a"]))  # half an epoch dropped: no verdict yet
    watch.see(batch(1, ["a"]))
    for _ in range(10):
        watch.see(batch(0, ["a", "a", "a", "a"]))
    resumed = UsableClipWatch("train", "data", clips_per_epoch=2, kept=True)
    resumed.see(batch(0, ["a", "a", "a"]))
    dead = UsableClipWatch("train", "data", clips_per_epoch=3)
    dead.see(batch(0, ["a", "b"]))
    dead.see({"size": 0, "task": "lm", "dropped": [], "dropped_reasons": []})
    with pytest.raises(UserError, match=r"all 4 clips were dropped when read, and none trained "
                       r"\(4 unreadable audio: a, b, a ... \(\+1\)\)"):  # fmt: skip
        dead.see(batch(0, ["a", "a"]))


@pytest.mark.fast
def test_an_evaluation_that_scored_no_clip_is_refused_and_never_a_reliable_figure():
    from asrforge.evaluation.evaluate import check_scored, dropped_metrics, summarize

    metrics = summarize([])
    assert metrics["n"] == 0 and metrics["wer_reliable"] is False
    metrics.update(dropped_metrics({"unreadable audio": ["x.wav", "x.wav"]}, 0))
    with pytest.raises(UserError, match=r"no usable utterances in split 'validation' of d\.json: "
                       r"all 2 clips were dropped when read \(2 unreadable audio: x\.wav, x\.wav\)"):  # fmt: skip
        check_scored(metrics, "validation", "d.json")
    check_scored({"n": 1}, "validation", "d.json")  # a clip scored: a figure


@pytest.mark.fast
def test_a_language_data_languages_names_that_no_training_clip_holds_is_found():
    from asrforge.data.rules import unheard_languages

    counts = {"en": 12, "es": 0}
    assert unheard_languages(["English", "fr", "es-MX", "en-US"], counts) == ["fr", "es-MX"]
    assert unheard_languages(None, counts) == []
