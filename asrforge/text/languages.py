"""Languages: their codes and names, and whether their script puts spaces between words.

The table holds Whisper's languages under Whisper's codes (ISO 639-1 where one exists, plus
``haw`` and ``yue``; ``jw`` for Javanese), and a few speech-corpus languages Whisper lacks
(``lg`` Ganda, ...). Every function here takes a code or an English name, in any case, and a
regional tag is tolerated (``en-US``, ``pt_BR`` resolve to ``en``, ``pt``). Cantonese locales
(``zh-HK``, ``zh-yue``, ``yue-Hant-HK``) resolve to ``yue``, not to Chinese: the language a run
is *selected* by is Cantonese even where the model has no ``<|yue|>`` token to *decode* with
(that choice is :class:`asrforge.model.tokenizer.SpecialTokens`').
"""

from __future__ import annotations

import difflib
from functools import lru_cache
from typing import Literal

from asrforge.errors import UserError

# Whisper's languages, in Whisper's order (whisper/tokenizer.py LANGUAGES), except that "my" is
# named "burmese" (Whisper: "myanmar", kept as an alias).
WHISPER_LANGUAGES: dict[str, str] = {
    "en": "english", "zh": "chinese", "de": "german", "es": "spanish", "ru": "russian",
    "ko": "korean", "fr": "french", "ja": "japanese", "pt": "portuguese", "tr": "turkish",
    "pl": "polish", "ca": "catalan", "nl": "dutch", "ar": "arabic", "sv": "swedish",
    "it": "italian", "id": "indonesian", "hi": "hindi", "fi": "finnish", "vi": "vietnamese",
    "he": "hebrew", "uk": "ukrainian", "el": "greek", "ms": "malay", "cs": "czech",
    "ro": "romanian", "da": "danish", "hu": "hungarian", "ta": "tamil", "no": "norwegian",
    "th": "thai", "ur": "urdu", "hr": "croatian", "bg": "bulgarian", "lt": "lithuanian",
    "la": "latin", "mi": "maori", "ml": "malayalam", "cy": "welsh", "sk": "slovak",
    "te": "telugu", "fa": "persian", "lv": "latvian", "bn": "bengali", "sr": "serbian",
    "az": "azerbaijani", "sl": "slovenian", "kn": "kannada", "et": "estonian", "mk": "macedonian",
    "br": "breton", "eu": "basque", "is": "icelandic", "hy": "armenian", "ne": "nepali",
    "mn": "mongolian", "bs": "bosnian", "kk": "kazakh", "sq": "albanian", "sw": "swahili",
    "gl": "galician", "mr": "marathi", "pa": "punjabi", "si": "sinhala", "km": "khmer",
    "sn": "shona", "yo": "yoruba", "so": "somali", "af": "afrikaans", "oc": "occitan",
    "ka": "georgian", "be": "belarusian", "tg": "tajik", "sd": "sindhi", "gu": "gujarati",
    "am": "amharic", "yi": "yiddish", "lo": "lao", "uz": "uzbek", "fo": "faroese",
    "ht": "haitian creole", "ps": "pashto", "tk": "turkmen", "nn": "nynorsk", "mt": "maltese",
    "sa": "sanskrit", "lb": "luxembourgish", "my": "burmese", "bo": "tibetan", "tl": "tagalog",
    "mg": "malagasy", "as": "assamese", "tt": "tatar", "haw": "hawaiian", "ln": "lingala",
    "ha": "hausa", "ba": "bashkir", "jw": "javanese", "su": "sundanese", "yue": "cantonese",
}  # fmt: skip

# Languages of common speech corpora (FLEURS, Common Voice) that Whisper has no token for.
OTHER_LANGUAGES: dict[str, str] = {
    "lg": "ganda", "ga": "irish", "ky": "kyrgyz", "ig": "igbo", "zu": "zulu", "xh": "xhosa",
    "or": "odia", "rw": "kinyarwanda", "om": "oromo", "wo": "wolof", "ny": "nyanja",
}  # fmt: skip

LANGUAGES: dict[str, str] = {**WHISPER_LANGUAGES, **OTHER_LANGUAGES}
"""Code -> English name of every language this package knows."""

# Other spellings -> code (Whisper's TO_LANGUAGE_CODE aliases, plus a few more).
_ALIASES: dict[str, str] = {
    "burmese": "my", "myanmar": "my", "valencian": "ca", "flemish": "nl", "haitian": "ht",
    "letzeburgesch": "lb", "pushto": "ps", "panjabi": "pa", "moldavian": "ro", "moldovan": "ro",
    "sinhalese": "si", "castilian": "es", "mandarin": "zh", "farsi": "fa", "jv": "jw",
    "luganda": "lg", "oriya": "or", "chichewa": "ny", "kirghiz": "ky",
}  # fmt: skip

_BY_NAME: dict[str, str] = {name: code for code, name in LANGUAGES.items()} | _ALIASES

# Locales whose language is not their head's: Hong Kong's and Macau's Chinese is Cantonese
# (Common Voice's ``zh-HK`` is Cantonese speech), and ``zh-yue`` is the old tag for it.
_LOCALES: dict[str, str] = {"zh-hk": "yue", "zh-mo": "yue", "zh-yue": "yue"}

# Scripts that do not separate words with spaces: word error rate means little there.
UNSPACED_LANGUAGES: frozenset[str] = frozenset({"th", "lo", "km", "my", "zh", "yue", "ja"})


def find_language_code(language: str) -> str | None:
    """The code of ``language`` (a code, an English name or a locale such as ``en-US``,
    ``sv_SE``, ``zh-HK``), or None if it is unknown."""
    key = " ".join(language.strip().lower().replace("_", "-").split())
    if key in LANGUAGES:
        return key
    if key in _BY_NAME:
        return _BY_NAME[key]
    parts = key.split("-")
    for locale in ("-".join(parts[:2]), f"{parts[0]}-{parts[-1]}"):  # zh-yue-hk, zh-hant-hk
        if locale in _LOCALES:
            return _LOCALES[locale]
    # A regional tag maps to its language ("en-us" -> "en", "pt-br" -> "pt").
    head = key.split("-", 1)[0]
    if head != key:
        return find_language_code(head)
    return None


def resolve_language(value: str | None, where: str | None = None, *, strict: bool = True) -> str:
    """The code of a language value a person gave: a code, an English name or a locale
    (``"de"``, ``"German"``, ``"de-AT"`` all give ``"de"``; ``"zh-HK"`` gives ``"yue"``).

    Args:
        where: where the value came from (``data.language``, ``data.languages.1``), named by the
            message; None: the message names the value alone.
        strict: False for a cell of the data's ``language`` column: a value that names no
            language comes back as it is (``""`` for None), for the checks that name it later.

    Raises:
        UserError: (``strict``) the value names no language in :data:`LANGUAGES` (nor an alias
            of one), in the words of :func:`unknown_language`.
    """
    text = "" if value is None else str(value)
    code = _cached_language_code(text)
    if code is not None or not strict:
        return code or text
    raise UserError(unknown_language(value, where))


@lru_cache(maxsize=1024)
def _cached_language_code(text: str) -> str | None:
    # A data column repeats a few values over many rows; the text is hashable where a cell
    # (a JSON list, say) may not be.
    return find_language_code(text)


def unknown_language(value, where: str | None = None) -> str:
    """What to say of a language value that names no known language (``where``: see
    :func:`resolve_language`), with the closest code or name when one is close."""
    names = list(LANGUAGES) + list(LANGUAGES.values())
    close = difflib.get_close_matches(str(value).lower(), names, n=1, cutoff=0.75)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return (
        f"{f'{where}: ' if where else ''}unknown language {value!r}{hint}: give an ISO or Whisper "
        "code, an English name or a locale (e.g. en, English, en-US)"
    )


def config_language_problems(cfg) -> list[str]:
    """One line per value of a run's config (a ``TrainConfig``) that names no language, as
    training would refuse it once its data is read: ``data.language``, each of
    ``data.languages``, ``data.replay.language``, ``selection.language`` and
    ``eval.guard.language``, a value written in several of them told once with each field."""
    guard = cfg.eval.guard
    values = [("data.language", cfg.data.language),
              *((f"data.languages.{i}", v) for i, v in enumerate(cfg.data.languages or ())),
              ("data.replay.language", cfg.data.replay.language if cfg.data.replay else None),
              ("selection.language", cfg.selection.language),
              ("eval.guard.language", guard.language if guard is not None else None)]  # fmt: skip
    unknown: dict[str, list[str]] = {}
    for where, value in values:
        if value is not None and _cached_language_code(str(value)) is None:
            unknown.setdefault(str(value), []).append(where)
    return [unknown_language(value, ", ".join(fields)) for value, fields in unknown.items()]


def language_name(language: str) -> str:
    """The English name of ``language`` (lowercase, e.g. ``"german"``).

    Raises:
        UserError: the language is unknown.
    """
    return LANGUAGES[resolve_language(language)]


def is_unspaced(language: str) -> bool:
    """True for languages whose script does not put spaces between words (Thai, Lao, Khmer,
    Burmese, Chinese, Cantonese, Japanese).

    Raises:
        UserError: the language is unknown.
    """
    return resolve_language(language) in UNSPACED_LANGUAGES


def primary_metric(language: str) -> Literal["wer", "cer"]:
    """The error rate to judge ``language`` by: ``"cer"`` for unspaced scripts, else ``"wer"``.

    Raises:
        UserError: the language is unknown.
    """
    return "cer" if is_unspaced(language) else "wer"
