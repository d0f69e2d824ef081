"""Text: normalization, word and character error rates, repetition diagnostics, languages."""

from asrforge.text.languages import (
    LANGUAGES,
    find_language_code,
    is_unspaced,
    language_name,
    primary_metric,
    resolve_language,
)
from asrforge.text.metrics import (
    EditCounts,
    cer,
    corpus_error_rate,
    edit_counts,
    error_rates,
    split_units,
    wer,
)
from asrforge.text.normalizers import normalize
from asrforge.text.repetition import (
    RepetitionFlags,
    repetition_flags,
    repetition_score,
    summarize_flags,
)

__all__ = [
    "LANGUAGES",
    "EditCounts",
    "RepetitionFlags",
    "cer",
    "corpus_error_rate",
    "edit_counts",
    "error_rates",
    "find_language_code",
    "is_unspaced",
    "resolve_language",
    "language_name",
    "normalize",
    "primary_metric",
    "repetition_flags",
    "repetition_score",
    "split_units",
    "summarize_flags",
    "wer",
]
