"""The espeak-ng corpus: disjoint splits, clips that decode to their recorded duration, the clip
cache, refused languages, and the sentence generator."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from audio_fixtures import requires_espeak

from asrforge.cli import main
from asrforge.cli.corpus import split_sizes
from asrforge.data.audio import SAMPLE_RATE, audio_info, decode_audio
from asrforge.data.sources import load_arrow
from asrforge.errors import UserError
from asrforge.recipes import corpus as corpus_mod
from asrforge.recipes.corpus import (
    LANGUAGES_TABLE,
    SPLITS,
    CorpusSpec,
    build_corpus,
    espeak_voices,
    plan_corpus,
)
from asrforge.recipes.sentences import make_sentences, word_pool

SIZES = {"train": 4, "validation": 1, "test": 1}  # 6 sentences per language


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, Path, dict]:
    """en + es, 6 clips each: (corpus dir, cache dir, card)."""
    root = tmp_path_factory.mktemp("corpus")
    cache = root / "cache"
    card = build_corpus(
        CorpusSpec(["en", "es"], SIZES, seed=3), root / "c", cache_dir=cache, workers=2
    )
    return root / "c", cache, card


@requires_espeak
def test_splits_share_no_sentence_and_no_speaker(built):
    path, _, card = built
    dd = load_arrow(path)
    assert sorted(dd) == sorted(SPLITS)
    texts = {s: set(dd[s]["text"]) for s in SPLITS}
    speakers = {s: set(dd[s]["speaker"]) for s in SPLITS}
    variants = {s: {sp.split("/")[0].split("+")[1] for sp in speakers[s]} for s in SPLITS}
    for i, a in enumerate(SPLITS):
        assert len(dd[a]) == 2 * SIZES[a]
        assert sorted(set(dd[a]["language"])) == ["en", "es"]
        for b in SPLITS[i + 1 :]:
            assert not texts[a] & texts[b], (a, b)
            assert not speakers[a] & speakers[b], (a, b)
            assert not variants[a] & variants[b], (a, b)
    all_texts = [t for s in SPLITS for t in dd[s]["text"]]
    assert len(all_texts) == len(set(all_texts))
    assert card["splits"]["train"]["utterances"] == 8
    assert (path / "README.md").is_file() and (path / "card.json").is_file()
    assert json.loads((path / "card.json").read_text())["languages"]["es"]["voices"]


@requires_espeak
def test_every_clip_decodes_and_matches_its_duration(built):
    path, _, card = built
    dd = load_arrow(path)
    total = 0.0
    for split in SPLITS:
        for row in dd[split]:
            blob = row["audio"]["bytes"]
            sr, seconds = audio_info(blob)
            wave = decode_audio(blob)
            assert sr == SAMPLE_RATE
            assert abs(seconds - row["duration"]) < 1e-3
            assert abs(wave.shape[0] / SAMPLE_RATE - row["duration"]) < 1e-3
            assert 0.5 < row["duration"] < 15.0
            assert 0.01 < float(abs(wave).max()) <= 1.0  # speech, not silence
            total += row["duration"]
    hours = sum(card["splits"][s]["hours"] for s in SPLITS)
    assert hours == pytest.approx(total / 3600, abs=1e-3)


@requires_espeak
def test_the_cache_spares_a_second_build_every_synthesis(built, tmp_path, monkeypatch):
    path, cache, card = built
    ran = []
    real_run = subprocess.run

    def spy(cmd, *a, **k):
        if "espeak" in str(cmd[0]):
            ran.append(cmd)
        return real_run(cmd, *a, **k)

    monkeypatch.setattr(corpus_mod.subprocess, "run", spy)

    def written() -> dict[Path, int]:
        return {f: f.stat().st_mtime_ns for f in path.rglob("*") if f.is_file()}

    # Same args, same place: reused outright, not a file rewritten.
    before = written()
    assert build_corpus(CorpusSpec(["en", "es"], SIZES, seed=3), path, cache_dir=cache) == card
    assert written() == before
    # Elsewhere with the same cache: every clip from the cache.
    card2 = build_corpus(
        CorpusSpec(["en", "es"], SIZES, seed=3), tmp_path / "again", cache_dir=cache
    )
    assert not ran  # espeak-ng never ran
    assert card2["build"]["clips_from_cache"] == 12
    assert card2["splits"] == card["splits"]


@requires_espeak
def test_rebuild_keeps_the_cache_inside_the_corpus_dir(tmp_path):
    spec = CorpusSpec(["en"], {"train": 2, "validation": 1, "test": 1}, seed=5)
    build_corpus(spec, tmp_path / "c")
    assert (tmp_path / "c" / ".cache").is_dir()
    card = build_corpus(spec, tmp_path / "c", force=True)
    assert card["build"]["clips_from_cache"] == 4


@pytest.mark.fast
@pytest.mark.parametrize(
    ("languages", "needle"),
    [
        ("km", "no Khmer voice"),
        ("ja", "kanji"),
        ("th", "no Thai word list"),
        ("xx", "not a language the corpus can speak"),
        ("en,en", "given twice"),
    ],
)
def test_a_language_it_cannot_speak_is_refused(languages, needle, tmp_path, capsys):
    with pytest.raises(UserError, match=needle):
        CorpusSpec(languages.split(","), SIZES)
    rc = main(
        ["corpus", "--languages", languages, "--per-language", "10", "--out", str(tmp_path / "c")]
    )
    assert rc == 2
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


def test_japanese_kana_only_is_allowed_and_uses_kana_words():
    spec = CorpusSpec(["ja"], SIZES, japanese_kana_only=True)
    clips = plan_corpus(spec)
    kana = set(range(0x3040, 0x3100))
    assert all(all(ord(ch) in kana for ch in c.text.rstrip("。")) for c in clips)


@pytest.mark.fast
def test_bad_sizes_are_refused(tmp_path):
    with pytest.raises(UserError, match="validation: needs at least 1"):
        CorpusSpec(["en"], {"train": 3, "validation": 0, "test": 1})
    with pytest.raises(UserError, match="exactly one"):
        split_sizes(None, None)
    with pytest.raises(UserError, match="not split=N"):
        split_sizes(None, "train=3,validation")
    assert split_sizes(100, None) == {"train": 80, "validation": 10, "test": 10}
    assert split_sizes(None, "train=5,validation=2,test=1") == {
        "train": 5,
        "validation": 2,
        "test": 1,
    }
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="holds no corpus"):
        build_corpus(CorpusSpec(["en"], SIZES), tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_sentences_are_deterministic_and_distinct():
    pool = word_pool("en")
    a = make_sentences(pool, 50, "en", seed=1)
    assert a == make_sentences(pool, 50, "en", seed=1)
    assert a != make_sentences(pool, 50, "en", seed=2)
    assert len(set(a)) == 50
    assert all(4 <= len(s.split()) <= 10 and s.endswith(".") and s[0].isupper() for s in a)
    zh = make_sentences(word_pool("zh"), 5, "zh", seed=1)
    assert all(" " not in s and s.endswith("。") for s in zh)


@pytest.mark.fast
def test_wordfreq_falling_back_to_english_is_refused():
    # wordfreq answers an unknown language with its English list; the corpus must not.
    with pytest.raises(UserError, match="no word list"):
        word_pool("sw")


@pytest.mark.fast
@requires_espeak
def test_every_table_voice_exists():
    voices = espeak_voices()
    missing = {lang: v for lang, (_, vs) in LANGUAGES_TABLE.items() for v in vs if v not in voices}
    assert not missing


# A fortune collection as Debian lays it out: cookies separated by "%" lines.
FORTUNE_FILE = """\
The harder I work, the luckier I get.
\t\t-- Anonymous
%
He said "no" to me.  Keep your (round) brackets at home.
%
Call 555 0100 now.  See RFC 822 at the IETF.
%
A Short Title
Time flies like an arrow when you are having fun.
%
Ask Mr. Smith about it.  Dogs bark but the caravan goes on its way.
%
Do or do not, there is no try!  Is it late?  Fine.
"""


@pytest.fixture
def fortunes_root(tmp_path, monkeypatch):
    """A fake /usr/share/games/fortunes holding one allowed English collection and one that the
    allow list leaves out."""
    from asrforge.recipes import sentences

    (tmp_path / "wisdom").write_text(FORTUNE_FILE)
    (tmp_path / "off").mkdir()
    (tmp_path / "off" / "wisdom").write_text("This offensive line must never be read.\n")
    (tmp_path / "ethnic").write_text("This unsuitable collection is never read at all.\n")
    monkeypatch.setattr(sentences, "FORTUNES_ROOT", tmp_path)
    return tmp_path


@pytest.mark.fast
def test_natural_sentences_keep_only_short_speakable_ones(fortunes_root):
    from asrforge.recipes.sentences import natural_sentences

    got = natural_sentences("en", min_words=4, max_words=16)
    assert got == [
        "The harder I work, the luckier I get.",  # the attribution line is dropped
        "Time flies like an arrow when you are having fun.",  # after a title, not joined to it
        "Dogs bark but the caravan goes on its way.",
        "Do or do not, there is no try!",
    ]


@pytest.mark.fast
def test_a_corpus_from_fortunes_uses_natural_sentences_and_records_them(fortunes_root):
    spec = CorpusSpec(["en"], {"train": 2, "validation": 1, "test": 1}, max_words=16)
    assert spec.sources() == {"en": "fortunes"}
    texts = [c.text for c in plan_corpus(spec)]
    assert sorted(texts) == sorted(
        [
            "The harder I work, the luckier I get.",
            "Time flies like an arrow when you are having fun.",
            "Dogs bark but the caravan goes on its way.",
            "Do or do not, there is no try!",
        ]
    )
    assert texts == [c.text for c in plan_corpus(spec)]  # the shuffle is the seed's
    too_many = CorpusSpec(["en"], {"train": 3, "validation": 1, "test": 1}, max_words=16)
    with pytest.raises(UserError, match="holds only 4 speakable sentences"):
        plan_corpus(too_many)
    assert CorpusSpec(["en"], SIZES, text="wordfreq").sources() == {"en": "wordfreq"}


@pytest.mark.fast
def test_missing_fortunes_package_is_named(tmp_path, monkeypatch):
    from asrforge.recipes import sentences

    monkeypatch.setattr(sentences, "FORTUNES_ROOT", tmp_path)
    assert CorpusSpec(["de"], SIZES).sources() == {"de": "wordfreq"}  # auto falls back
    with pytest.raises(UserError, match="apt-get install fortunes-de"):
        plan_corpus(CorpusSpec(["de"], SIZES, text="fortunes"))
    with pytest.raises(UserError, match="no natural sentences"):
        CorpusSpec(["nl"], SIZES, text="fortunes")
