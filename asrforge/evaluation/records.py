"""The record of one utterance an evaluation writes to disk, in one shape wherever it goes: a
run's ``eval/step-NNNNNN.jsonl``, ``eval/guard-step-NNNNNN.jsonl`` and
``eval/longform-step-NNNNNN.jsonl``, and ``asrforge evaluate --predictions``.

Each record holds the utterance's ``id``, its ``language``, the ``reference`` and the
``hypothesis`` and both as normalized for scoring (``reference_normalized``,
``hypothesis_normalized``), then what its writer measured of it (loss, token counts, repetition
flags, a guard item's kind, a recording's segments). In memory a prediction keeps its short
names (``uid``, ``ref``, ``hyp``: what ``on_predict_end`` callbacks get); only these functions
spell the names on disk.
"""

from __future__ import annotations

from asrforge.config import NormalizerConfig
from asrforge.text import normalize

SHORT_NAMES = {"uid": "id", "ref": "reference", "hyp": "hypothesis"}
"""A prediction's names in memory and the names its record has on disk."""


def utterance_record(
    pred: dict, normalizer: NormalizerConfig | None = None, *, decoded_as: str | None = None
) -> dict:
    """The record on disk of ``pred`` (a prediction with ``uid``, ``language``, ``ref`` and
    ``hyp``; a reference that is None, a guard item's without one, stays None and unnormalized).
    ``decoded_as``: the language whose token carried the prompt, when not the utterance's own.
    """
    language = pred["language"]
    record = {"id": pred["uid"], "language": language}
    if decoded_as is not None:
        record["decoded_as"] = decoded_as
    ref, hyp = pred["ref"], pred["hyp"]
    record.update(
        reference=ref,
        hypothesis=hyp,
        reference_normalized=None if ref is None else normalize(ref, language, normalizer),
        hypothesis_normalized=normalize(hyp, language, normalizer),
    )
    record.update({k: v for k, v in pred.items() if k not in SHORT_NAMES and k != "language"})
    return record


def prediction_records(
    preds: list[dict], specials, normalizer: NormalizerConfig | None = None
) -> list[dict]:
    """The records of an evaluation's predictions (:func:`utterance_record`), each with the
    language its prompt was forced to (the data's) and, when another language's token carried it
    (``data.language_tokens``), ``decoded_as`` naming that one."""
    records = []
    for p in preds:
        token = specials.token_language(p["language"]) if specials.multilingual else None
        decoded_as = token if token is not None and token != p["language"] else None
        records.append(utterance_record(p, normalizer, decoded_as=decoded_as))
    return records
