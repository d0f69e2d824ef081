"""The languages the speech corpus speaks (a wordfreq word list and espeak-ng voices for each),
those it refuses and why, and where its sentences may come from.

Kept apart from :mod:`asrforge.recipes.corpus` so the ``asrforge corpus`` parser lists them
without importing the synthesis code.
"""

TEXT_SOURCES = ("auto", "fortunes", "wordfreq")

# code (Whisper's) -> (wordfreq code, espeak-ng voices; speakers alternate between them)
LANGUAGES_TABLE: dict[str, tuple[str, tuple[str, ...]]] = {
    "en": ("en", ("en-us", "en-gb")), "es": ("es", ("es", "es-419")), "de": ("de", ("de",)),
    "fr": ("fr", ("fr-fr",)), "it": ("it", ("it",)), "pt": ("pt", ("pt-br", "pt")),
    "nl": ("nl", ("nl",)), "sv": ("sv", ("sv",)), "da": ("da", ("da",)), "no": ("nb", ("nb",)),
    "fi": ("fi", ("fi",)), "is": ("is", ("is",)), "pl": ("pl", ("pl",)), "cs": ("cs", ("cs",)),
    "sk": ("sk", ("sk",)), "sl": ("sl", ("sl",)), "hr": ("sh", ("hr",)), "ro": ("ro", ("ro",)),
    "hu": ("hu", ("hu",)), "ca": ("ca", ("ca",)), "lt": ("lt", ("lt",)), "lv": ("lv", ("lv",)),
    "ru": ("ru", ("ru",)), "uk": ("uk", ("uk",)), "bg": ("bg", ("bg",)), "mk": ("mk", ("mk",)),
    "el": ("el", ("el",)), "tr": ("tr", ("tr",)), "id": ("id", ("id",)), "ms": ("ms", ("ms",)),
    "vi": ("vi", ("vi",)), "ar": ("ar", ("ar",)), "fa": ("fa", ("fa",)), "he": ("he", ("he",)),
    "hi": ("hi", ("hi",)), "bn": ("bn", ("bn",)), "ta": ("ta", ("ta",)), "ur": ("ur", ("ur",)),
    "ko": ("ko", ("ko",)), "zh": ("zh", ("cmn-latn-pinyin",)), "ja": ("ja", ("ja",)),
}  # fmt: skip
"""Languages the corpus can speak: each needs a wordfreq word list and an espeak-ng voice."""

REFUSED: dict[str, str] = {
    "km": "espeak-ng has no Khmer voice",
    "ja": "espeak-ng does not read kanji (it says 'Chinese letter'); pass --japanese-kana-only to "
          "draw Japanese sentences from kana-written words only",
    "th": "wordfreq has no Thai word list (espeak-ng has a Thai voice)",
    "my": "wordfreq has no Burmese word list",
    "sw": "wordfreq has no Swahili word list",
    "lg": "neither wordfreq nor espeak-ng knows Ganda",
}
"""Languages asked about often that the corpus cannot speak, and why."""
