"""Normalizers and the language table."""

import unicodedata

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asrforge.errors import UserError
from asrforge.text import (
    LANGUAGES,
    is_unspaced,
    language_name,
    normalize,
    primary_metric,
    resolve_language,
)

pytestmark = pytest.mark.fast

_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=60)


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("Hello, World!", "hello world"),
        ("I won't go (laughs) [noise] <unk> there.", "i will not go there"),
        ("Um, so uh, hmm, we mhm start", "so we start"),
        ("Don’t you think it's done?", "do not you think it is done"),  # curly apostrophe
        (
            "We'll see, they're here, I'd say, you've won, I'm in",
            "we will see they are here i would say you have won i am in",
        ),
        ("Mr. Smith and Dr. Jones", "mister smith and doctor jones"),
        ("It costs $1,000 or 3.5% more.", "it costs $1000 or 3.5% more"),
        # Whisper drops a currency or percent sign that a space parts from its number
        ("It costs $ 1,000 or 3.5 % more.", "it costs 1000 or 3.5 more"),
        ("Café naïve façade", "cafe naive facade"),
        ("The colour of the theatre", "the color of the theater"),
        (
            "An aeroplane, analogue paediatricians, ten kilometres",
            "an airplane analog pediatricians 10 kilometers",
        ),
        ("end. Next sentence", "end next sentence"),
        ("50 % off, 100%!", "50 off 100%"),
        ("  lots\tof \n space  ", "lots of space"),
    ],
)
def test_english(raw, expected):
    assert normalize(raw, "en") == expected


def test_english_accepts_names_and_regional_codes():
    raw = "Hello, World!"
    assert normalize(raw, "English") == normalize(raw, "en-US") == normalize(raw, "en")


def test_german_keeps_umlauts_and_folds_case():
    assert normalize("Grüße aus „Köln“ (Lachen)!", "de") == "grüsse aus köln"
    assert normalize("STRASSE", "german") == normalize("Straße", "german")


def test_hindi_keeps_vowel_signs():
    # Whisper's BasicTextNormalizer turns marks into spaces and splits every word; ours keeps
    # them: one word stays one word, with every code point.
    word = "नमस्ते"
    assert any(unicodedata.category(c).startswith("M") for c in word)
    assert normalize(f"{word}, दुनिया!", "hi") == f"{word} दुनिया"


def test_thai_keeps_marks_and_turns_zero_width_space_into_a_space():
    text = "สวัสดีครับ! ผมชื่อ\u200bสมชาย"
    assert normalize(text, "thai") == "สวัสดีครับ ผมชื่อ สมชาย"


def test_basic_normalizer_uses_nfkc():
    assert normalize("ﬁve ①", "fr") == "five 1"


@settings(max_examples=300, deadline=None)
@given(_text, st.sampled_from(["en", "de", "hi", "th", "zh", "ar"]))
def test_output_shape(text, language):
    out = normalize(text, language)
    assert out == out.strip()
    assert "  " not in out
    assert all(not c.isspace() or c == " " for c in out)
    if language != "en":
        assert all(unicodedata.category(c)[0] not in "PS" for c in out)


@pytest.mark.parametrize(
    ("text", "settled"), [("O1", "one"), ("o 1", "one"), ("zero one", "one"), ("ÙM, yes", "yes")]
)
def test_english_rewrites_that_feed_each_other_are_applied_until_the_text_settles(text, settled):
    # Whisper's own rewriting turns "o1" into "0 one", and that into "one"; "ùm" becomes the
    # filler "um" only once its accent is stripped, after fillers were dropped.
    assert normalize(text, "en") == normalize(normalize(text, "en"), "en") == settled


@settings(max_examples=300, deadline=None)
@given(_text, st.sampled_from(["en", "de", "hi", "th"]))
def test_idempotent(text, language):
    once = normalize(text, language)
    assert normalize(once, language) == once


@pytest.mark.parametrize(
    "given_, code",
    [("de", "de"), ("German", "de"), (" GERMAN ", "de"), ("pt_BR", "pt"), ("zh-TW", "zh"),
     ("yue", "yue"), ("cantonese", "yue"), ("haw", "haw"), ("burmese", "my"), ("myanmar", "my"),
     ("jv", "jw"), ("castilian", "es"), ("ganda", "lg"), ("haitian creole", "ht")],
)  # fmt: skip
def test_language_code(given_, code):
    assert resolve_language(given_) == code


def test_an_unknown_language_is_one_message_naming_where_it_came_from():
    with pytest.raises(UserError, match=r"^data\.language: unknown language 'germna' \(did you "
                       r"mean 'german'\?\): give an ISO or Whisper code, an English name"):  # fmt: skip
        resolve_language("germna", "data.language")
    with pytest.raises(UserError, match=r"^unknown language 'Klingon': give"):
        resolve_language("Klingon")
    # a cell of the data's language column: kept as it is, for the checks that name it
    assert resolve_language("Klingon", strict=False) == "Klingon"
    assert resolve_language(None, strict=False) == ""


def test_a_list_in_a_language_cell_comes_back_as_its_text():
    # a JSON list in the language column is not hashable: it still resolves, as text
    assert resolve_language(["en", "de"], strict=False) == "['en', 'de']"
    with pytest.raises(UserError, match=r"^unknown language \['xx'\]"):
        resolve_language(["xx"])


def test_language_table_is_a_bijection():
    assert len(set(LANGUAGES.values())) == len(LANGUAGES) >= 100
    for code, name in LANGUAGES.items():
        assert resolve_language(name) == code
        assert language_name(code) == name


def test_unknown_language_raises_user_error():
    with pytest.raises(UserError, match="klingon"):
        normalize("qapla'", "klingon")
    with pytest.raises(UserError, match="xx"):
        is_unspaced("xx")


@pytest.mark.parametrize("language", ["th", "lao", "km", "burmese", "zh", "yue", "Japanese"])
def test_unspaced_scripts_use_cer(language):
    assert is_unspaced(language)
    assert primary_metric(language) == "cer"


@pytest.mark.parametrize("language", ["en", "de", "hindi", "ar", "ko", "vi"])
def test_spaced_scripts_use_wer(language):
    assert not is_unspaced(language)
    assert primary_metric(language) == "wer"


def test_english_numbers_are_scored_alike_whatever_their_style():
    # Whisper's number rewriting: the guard must not count "1" against "one" as drift
    assert normalize("Press 1 for sales.", "en") == normalize("press one for sales", "en")
    assert normalize("twenty five people", "en") == normalize("25 people", "en") == "25 people"
    assert normalize("one hundred and two", "en") == "102"


@pytest.mark.parametrize(
    "text, language, options, expected",
    [
        ("Él está aquí, señor", "es", {}, "él está aquí señor"),
        ("Él está aquí, señor", "es", {"remove_diacritics": True}, "el esta aqui senor"),
        ("Straße Œuvre Łódź", "pl", {"remove_diacritics": True}, "strasse oeuvre lodz"),
        ("twenty five apples", "en", {}, "25 apples"),
        ("twenty five apples", "en", {"numbers": "as_written"}, "twenty five apples"),
        ("I have 25 apples", "en", {"numbers": "as_written"}, "i have 25 apples"),
        ("veinte y cinco", "es", {"numbers": "as_written"}, "veinte y cinco"),
    ],
)
def test_the_normalizer_s_options(text, language, options, expected):
    from asrforge.config import NormalizerConfig

    assert normalize(text, language, NormalizerConfig(**options)) == expected


def test_evaluation_scores_with_the_options_and_names_them():
    from asrforge.config import NormalizerConfig
    from asrforge.evaluation.evaluate import summarize
    from asrforge.text import repetition_flags

    said = [("es", "el nino esta aqui", "El niño está aquí."), ("en", "twenty one", "twenty one")]
    preds = [
        {"uid": str(k), "language": lang, "ref": ref, "hyp": hyp,
         **repetition_flags(hyp, n_tokens=4, max_new_tokens=8)}
        for k, (lang, ref, hyp) in enumerate(said)
    ]  # fmt: skip
    plain, told = summarize(preds), summarize(preds, NormalizerConfig(remove_diacritics=True))
    assert plain["per_language"]["es"]["wer"] == 0.75 and told["per_language"]["es"]["wer"] == 0
    assert plain["normalizer"] == "whisper" and told["normalizer"] == "whisper, no diacritics"


def test_an_evaluation_normalizes_each_transcript_once_and_a_repeated_one_not_again(monkeypatch):
    import asrforge.text.normalizers as normalizers
    from asrforge.evaluation.evaluate import summarize
    from asrforge.text import repetition_flags

    english = []
    real = normalizers._normalize_english
    monkeypatch.setattr(
        normalizers, "_normalize_english", lambda t, **kw: english.append(t) or real(t, **kw)
    )
    normalizers.forget_normalized()
    said = [("en", "Twenty one.", "twenty one"), ("en", "Colour", "color"), ("es", "Sí", "si")]
    preds = [
        {"uid": str(k), "language": lang, "ref": ref, "hyp": hyp,
         **repetition_flags(hyp, n_tokens=4, max_new_tokens=8)}
        for k, (lang, ref, hyp) in enumerate(said)
    ]  # fmt: skip
    first = summarize(preds)
    # four English transcripts, each normalized once although scored overall and per language
    assert sorted(english) == sorted(["Twenty one.", "twenty one", "Colour", "color"])
    assert summarize(preds) == first and len(english) == 4  # the next evaluation: cached
    assert first["per_language"]["en"]["wer"] == 0 and first["per_language"]["es"]["wer"] == 1
    normalizers.forget_normalized()
    summarize(preds)
    assert len(english) == 8
