"""Tokenizers: a pretrained Whisper tokenizer from a local directory, or a small byte-level BPE
trained on the training transcripts with Whisper's special tokens, for models built from scratch.

The loop never relies on a tokenizer's own prefix logic: :class:`SpecialTokens` resolves the ids
of ``<|startoftranscript|>``, the language and task tokens once, and builds decoder prompts.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from transformers import WhisperTokenizer
from transformers.models.whisper.tokenization_whisper import LANGUAGES

from asrforge.errors import UserError

EOT = "<|endoftext|>"
SOT = "<|startoftranscript|>"
TASKS = ("translate", "transcribe")
TIME_PRECISION = 0.02  # seconds per timestamp token
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


def train_bpe_tokenizer(
    texts: Iterable[str], vocab_size: int, timestamp_seconds: float | None = None
) -> WhisperTokenizer:
    """Train a byte-level BPE on ``texts`` and wrap it as a Whisper tokenizer.

    Args:
        texts: transcripts (training split only: evaluation text must not leak into the vocab).
        vocab_size: size of the BPE vocabulary (256 byte tokens + merges), before special tokens.
        timestamp_seconds: also add Whisper's timestamp tokens ``<|0.00|>`` ..
            ``<|timestamp_seconds|>`` (0.02 s apart) right after ``<|notimestamps|>``, where
            Whisper and transformers look for them; None: none (the tokenizer stays as before
            timestamp training existed).
    """
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer(add_prefix_space=False)
    bpe.train_from_iterator(
        list(texts), vocab_size=vocab_size, min_frequency=2, show_progress=False,
        special_tokens=[EOT],
    )
    state = json.loads(bpe._tokenizer.to_str())["model"]  # the trained vocab and merges
    vocab: dict[str, int] = state["vocab"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["merges"]]
    tok = WhisperTokenizer(vocab=vocab, merges=merges)
    tok.add_special_tokens({"additional_special_tokens": WHISPER_SPECIALS})
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
    try:
        tok = WhisperTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, TypeError) as e:
        raise UserError(f"cannot load a Whisper tokenizer from {path}: {e}") from None
    if tok.convert_tokens_to_ids(SOT) in (None, tok.unk_token_id):
        raise UserError(f"tokenizer in {path} has no {SOT} token: not a Whisper tokenizer")
    if tok.pad_token is None:
        tok.pad_token = EOT
    return tok


@dataclass(frozen=True)
class SpecialTokens:
    """Ids of the tokens that frame a Whisper transcript.

    A multilingual model's prompt is ``<|startoftranscript|><|xx|><|task|><|notimestamps|>``; an
    English-only (``.en``) model's is ``<|startoftranscript|><|notimestamps|>``.
    """

    sot: int
    eot: int
    no_timestamps: int
    tasks: dict[str, int]
    languages: dict[str, int] = field(default_factory=dict)
    multilingual: bool = True

    @classmethod
    def from_tokenizer(cls, tok: WhisperTokenizer, multilingual: bool) -> SpecialTokens:
        def tid(token: str) -> int | None:
            i = tok.convert_tokens_to_ids(token)
            return None if i is None or i == tok.unk_token_id and token != EOT else int(i)

        langs = {code: tid(f"<|{code}|>") for code in LANGUAGES}
        missing = [t for t in (SOT, "<|notimestamps|>", "<|transcribe|>") if tid(t) is None]
        if missing:
            raise UserError(f"tokenizer lacks Whisper special tokens {missing}")
        return cls(
            sot=tid(SOT),
            eot=tid(EOT),
            no_timestamps=tid("<|notimestamps|>"),
            tasks={t: tid(f"<|{t}|>") for t in TASKS if tid(f"<|{t}|>") is not None},
            languages={c: i for c, i in langs.items() if i is not None},
            multilingual=multilingual,
        )

    def prompt(self, language: str | None, task: str = "transcribe") -> list[int]:
        """Decoder prompt ids for one utterance (the loss is not computed on these)."""
        if not self.multilingual:
            return [self.sot, self.no_timestamps]
        if language not in self.languages:
            raise UserError(f"language {language!r} has no token in this tokenizer")
        return [self.sot, self.languages[language], self.tasks[task], self.no_timestamps]
