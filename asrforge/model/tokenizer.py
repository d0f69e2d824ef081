"""Tokenizers: a pretrained Whisper tokenizer from a local directory, or a small byte-level BPE
trained on the training transcripts with Whisper's special tokens, for models built from scratch.

The loop never relies on a tokenizer's own prefix logic: :class:`SpecialTokens` resolves the ids
of ``<|startoftranscript|>``, the language and task tokens once, and builds decoder prompts.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import WhisperTokenizer
from transformers.models.whisper.tokenization_whisper import LANGUAGES

from asrforge.errors import UserError
from asrforge.io.small_files import (
    CONFIG_BYTES,
    TOKENIZER_BYTES,
    read_json,
    read_json_object,
    read_text,
)
from asrforge.model.frames import TIME_PRECISION
from asrforge.text.languages import LANGUAGES as KNOWN_LANGUAGES
from asrforge.text.languages import find_language_code, unknown_language

log = logging.getLogger(__name__)

EOT = "<|endoftext|>"
SOT = "<|startoftranscript|>"
TASKS = ("translate", "transcribe")
# Whisper's special tokens after <|endoftext|>, in Whisper's order (timestamp tokens, when a
# run trains them, follow as plain added tokens).
WHISPER_SPECIALS = [
    SOT,
    *[f"<|{code}|>" for code in LANGUAGES],
    "<|translate|>",
    "<|transcribe|>",
    "<|startoflm|>",
    "<|startofprev|>",
    "<|nospeech|>",
    "<|notimestamps|>",
]
TOKENIZER_SIDE_FILES = {
    "tokenizer_config.json": CONFIG_BYTES,
    "special_tokens_map.json": CONFIG_BYTES,
    "added_tokens.json": CONFIG_BYTES,
    "chat_template.json": CONFIG_BYTES,
    "normalizer.json": CONFIG_BYTES,
    "vocab.json": TOKENIZER_BYTES,
    "merges.txt": TOKENIZER_BYTES,
    "chat_template.jinja": CONFIG_BYTES,
}
"""The files besides ``tokenizer.json`` transformers may read from a tokenizer directory, and
the most bytes each may hold: transformers reads them whole, with no bound on size or nesting."""
FALLBACK_TOKENS = {"yue": "zh"}
"""Language -> the language whose token decodes it when the tokenizer has none of its own:
Whisper before large-v3 has no ``<|yue|>`` and learned Cantonese under ``<|zh|>``."""


def language_specials(languages: Iterable[str] = ()) -> list[str]:
    """Whisper's special tokens, with a language token for each code of ``languages`` that
    Whisper has none for (``<|lg|>``), right after Whisper's own languages (where large-v3 put
    ``<|yue|>``). A value that names no known language gets none."""
    extra = sorted({c for c in languages if c in KNOWN_LANGUAGES and c not in LANGUAGES})
    at = WHISPER_SPECIALS.index("<|translate|>")
    return [*WHISPER_SPECIALS[:at], *(f"<|{c}|>" for c in extra), *WHISPER_SPECIALS[at:]]


def train_bpe_tokenizer(
    texts: Iterable[str],
    vocab_size: int,
    timestamp_seconds: float | None = None,
    languages: Iterable[str] = (),
) -> WhisperTokenizer:
    """Train a byte-level BPE on ``texts`` and wrap it as a Whisper tokenizer.

    Args:
        texts: transcripts of the rows that train (training split only: evaluation text must
            not leak into the vocab); empty and missing (None) ones are skipped, with a warning.
        vocab_size: size of the BPE vocabulary (256 byte tokens + merges), before special tokens.
        timestamp_seconds: also add Whisper's timestamp tokens ``<|0.00|>`` ..
            ``<|timestamp_seconds|>`` (0.02 s apart) right after ``<|notimestamps|>``, where
            Whisper and transformers look for them; None: none (the tokenizer stays as before
            timestamp training existed).
        languages: the data's language codes: each gets a token (see :func:`language_specials`).
    """
    from tokenizers import ByteLevelBPETokenizer

    texts = list(texts)
    usable = [t for t in texts if isinstance(t, str) and t.strip()]
    if not usable:
        raise UserError(f"no non-empty transcript to train the tokenizer on ({len(texts)} rows)")
    if len(usable) < len(texts):  # the data set skips the same rows as "empty text"
        log.warning(
            "tokenizer: %d of %d transcripts are empty or missing; trained on the other %d",
            len(texts) - len(usable), len(texts), len(usable),
        )
    bpe = ByteLevelBPETokenizer(add_prefix_space=False)
    bpe.train_from_iterator(
        usable, vocab_size=vocab_size, min_frequency=2, show_progress=False,
        special_tokens=[EOT],
    )
    state = json.loads(bpe._tokenizer.to_str())["model"]  # the trained vocab and merges
    vocab: dict[str, int] = state["vocab"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["merges"]]
    tok = WhisperTokenizer(vocab=vocab, merges=merges)
    tok.add_special_tokens({"additional_special_tokens": language_specials(languages)})
    if timestamp_seconds is not None:
        # Plain added tokens, as in openai/whisper-* tokenizers: transformers takes the first id
        # after the last special token for <|0.00|>, and strips them from decoded text.
        steps = round(timestamp_seconds / TIME_PRECISION)
        tok.add_tokens([f"<|{i * TIME_PRECISION:.2f}|>" for i in range(steps + 1)])
    tok.pad_token = EOT
    return tok


def load_tokenizer(path: Path) -> WhisperTokenizer:
    """Load a Whisper tokenizer from a local directory (never from a hub)."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"tokenizer directory {path} does not exist")
    # A FIFO or a device here is refused by name rather than left for transformers to read.
    if (path / "tokenizer.json").exists():
        check_tokenizer_json(path / "tokenizer.json")
    check_side_files(path)
    try:
        tok = WhisperTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, TypeError) as e:
        raise UserError(f"cannot load a Whisper tokenizer from {path}: {e}") from None
    if tok.convert_tokens_to_ids(SOT) in (None, tok.unk_token_id):
        raise UserError(f"tokenizer in {path} has no {SOT} token: not a Whisper tokenizer")
    if tok.pad_token is None:
        tok.pad_token = EOT
    # transformers ignores this cleanup for BPE tokenizers and warns on every decode when set.
    tok.clean_up_tokenization_spaces = False
    return tok


@dataclass(frozen=True)
class SpecialTokens:
    """Ids of the tokens that frame a Whisper transcript.

    A multilingual model's prompt is ``<|startoftranscript|><|xx|><|task|><|notimestamps|>``; an
    English-only (``.en``) model's is ``<|startoftranscript|><|notimestamps|>``.

    The language of an utterance (what checkpoint selection goes by) and the token its prompt
    carries are two things: a language without a token of its own is decoded under another's
    when ``data.language_tokens`` maps it (``{lg: sw}``), and Cantonese under ``<|zh|>`` when
    the tokenizer has no ``<|yue|>`` (:data:`FALLBACK_TOKENS`).
    """

    sot: int
    eot: int
    no_timestamps: int
    tasks: dict[str, int]
    languages: dict[str, int] = field(default_factory=dict)
    """Language code -> id of the token its prompt carries (its own, or the mapped one's)."""
    multilingual: bool = True
    token_of: dict[str, str] = field(default_factory=dict)
    """Language code -> code of the other language whose token it is decoded under."""

    @classmethod
    def from_tokenizer(
        cls,
        tok: WhisperTokenizer,
        multilingual: bool,
        language_tokens: Mapping[str, str] | None = None,
    ) -> SpecialTokens:
        """Resolve the ids in ``tok``.

        Args:
            tok: a Whisper tokenizer; its language tokens are those ``<|xx|>`` of Whisper's
                languages and of :data:`asrforge.text.languages.LANGUAGES` it holds (a vocabulary
                extension can add e.g. ``<|lg|>``).
            multilingual: whether prompts carry a language and a task token.
            language_tokens: ``data.language_tokens``: language -> language whose token to use
                (codes, names or locales).

        Raises:
            UserError: Whisper's special tokens are missing, or a mapping names an unknown
                language or a target without a token (by YAML path ``data.language_tokens``).
        """

        def tid(token: str) -> int | None:
            i = tok.convert_tokens_to_ids(token)
            return None if i is None or i == tok.unk_token_id and token != EOT else int(i)

        codes = [*LANGUAGES, *(c for c in KNOWN_LANGUAGES if c not in LANGUAGES)]
        own = {code: tid(f"<|{code}|>") for code in codes}
        own = {code: i for code, i in own.items() if i is not None}
        missing = [t for t in (SOT, "<|notimestamps|>", "<|transcribe|>") if tid(t) is None]
        if missing:
            raise UserError(f"tokenizer lacks Whisper special tokens {missing}")
        token_of = _token_map(language_tokens or {}, own) if multilingual else {}
        return cls(
            sot=tid(SOT),
            eot=tid(EOT),
            no_timestamps=tid("<|notimestamps|>"),
            tasks={t: tid(f"<|{t}|>") for t in TASKS if tid(f"<|{t}|>") is not None},
            languages={**own, **{code: own[target] for code, target in token_of.items()}},
            multilingual=multilingual,
            token_of=token_of,
        )

    def token_language(self, language: str) -> str | None:
        """The code of the language whose token prompts of ``language`` carry (``"zh"`` for
        ``"yue"`` without ``<|yue|>``), or None when there is none."""
        code = language if language in self.languages else find_language_code(language)
        if code is None or code not in self.languages:
            return None
        return self.token_of.get(code, code)

    def prompt(self, language: str | None, task: str = "transcribe") -> list[int]:
        """Decoder prompt ids for one utterance (the loss is not computed on these).

        Args:
            language: a code (or a name or locale, resolved as ``find_language_code`` does).
        """
        if not self.multilingual:
            return [self.sot, self.no_timestamps]
        token = self.token_language(language) if language is not None else None
        if token is None:
            raise UserError(f"language {language!r} has no token in this tokenizer")
        return [self.sot, self.languages[token], self.tasks[task], self.no_timestamps]

    def generation_fields(self, languages: Iterable[str] | None = None) -> dict[str, Any]:
        """The generation-config fields by which transformers' ``generate`` and ASR pipeline
        prompt and stop as asrforge decodes: the start, end, padding and no-timestamps tokens,
        and for a multilingual model the language and task tokens.

        Args:
            languages: the codes ``lang_to_id`` offers (language detection picks among them);
                default every language with a token here. Codes without one are left out.
        """
        fields: dict[str, Any] = {
            "decoder_start_token_id": self.sot,
            "eos_token_id": self.eot,
            "pad_token_id": self.eot,
            "no_timestamps_token_id": self.no_timestamps,
            "is_multilingual": self.multilingual,
        }
        if self.multilingual:
            codes = self.languages if languages is None else languages
            fields["lang_to_id"] = {
                f"<|{c}|>": self.languages[c] for c in codes if c in self.languages
            }
            fields["task_to_id"] = dict(self.tasks)
        return fields


def check_tokenizer_json(path: Path) -> None:
    """Refuse a ``tokenizer.json`` the tokenizers library cannot read, naming the file
    (transformers would stop with a KeyError or a bare Exception from deep inside).

    Raises:
        UserError: not a regular file, too large, not JSON (or nested too deeply), not shaped
            as a tokenizers file, or a model it cannot build.
    """
    from tokenizers import Tokenizer

    try:
        data = read_json(path, TOKENIZER_BYTES)
    except FileNotFoundError:
        raise UserError(f"{path}: missing") from None
    if not (
        isinstance(data, dict)
        and isinstance(data.get("model"), dict)
        and isinstance(data.get("added_tokens"), list)
    ):
        raise UserError(
            f"{path}: not a tokenizers file (a JSON object with a 'model' object and an "
            "'added_tokens' list)"
        )
    try:
        Tokenizer.from_str(json.dumps(data))
    except Exception as e:  # tokenizers raises a bare Exception for what it cannot parse
        raise UserError(f"{path}: not a tokenizers file: {e}") from None


def check_side_files(directory: Path) -> None:
    """Refuse a file of :data:`TOKENIZER_SIDE_FILES` in ``directory`` that is no regular file,
    is larger than its limit, or (a JSON one) is no JSON object or is nested too deeply, naming
    it, before transformers reads it (where a deep one stops with a RecursionError).

    Raises:
        UserError: naming the file and what is wrong.
    """
    for name, limit in TOKENIZER_SIDE_FILES.items():
        path = Path(directory) / name
        if not path.exists():
            continue
        try:
            if name.endswith(".json"):
                read_json_object(path, limit)
            else:
                read_text(path, limit)
        except ValueError as e:
            raise UserError(f"{path}: {e}") from None
        except OSError as e:
            raise UserError(f"{path}: cannot be read: {e.strerror or e}") from None


def _token_map(language_tokens: Mapping[str, str], own: Mapping[str, int]) -> dict[str, str]:
    """Language code -> code of the token it is decoded under: ``language_tokens`` (checked),
    then :data:`FALLBACK_TOKENS` for languages without a token of their own."""
    out: dict[str, str] = {}
    problems = []
    for source, target in language_tokens.items():
        where = f"data.language_tokens.{source}"
        code, target_code = find_language_code(str(source)), find_language_code(str(target))
        if code is None:
            problems.append(unknown_language(source, where))
        elif target_code is None:
            problems.append(unknown_language(target, where))
        elif target_code not in own:
            problems.append(f"{where}: {target!r} has no token <|{target_code}|> in the tokenizer")
        elif code != target_code:
            out[code] = target_code
    if problems:
        raise UserError("; ".join(problems))
    for code, target in FALLBACK_TOKENS.items():
        if code not in own and code not in out and target in own:
            out[code] = target
    return out
