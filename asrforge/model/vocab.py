"""Per-language vocabulary extension: merge a language BPE into Whisper's, warm-start the rows.

How it works: docs/decoding.md, "How a vocabulary is extended (`model/vocab.py`)".
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from functools import lru_cache
from itertools import islice
from pathlib import Path

import numpy as np

from asrforge.config import DataConfig
from asrforge.data.sources import read_split
from asrforge.errors import UserError
from asrforge.io.small_files import CONFIG_BYTES, TOKENIZER_BYTES, read_json
from asrforge.model.tokenizer import TIME_PRECISION, load_tokenizer
from asrforge.text.languages import find_language_code, resolve_language

log = logging.getLogger(__name__)

EXTENSION_FILE = "vocab_extension.json"
EXTENSION_FORMAT = 1


# ---------------------------------------------------------------------------------------------
# The extension record


@dataclass(frozen=True)
class VocabExtension:
    """What ``vocab_extension.json`` records about an extended tokenizer."""

    language: str
    base_vocab_size: int
    """Tokens of the base tokenizer (and rows of the base model's embedding)."""
    vocab_size: int
    """Tokens of the extended tokenizer: ``base_vocab_size + new_tokens``."""
    new_tokens: int
    base_tokenizer_sha256: str
    """:func:`tokenizer_sha256` of the base tokenizer."""
    base: str | None = None
    """Where the base tokenizer was read from (for ``asrforge vocab report``)."""
    trained_vocab_size: int | None = None
    """Size of the language BPE (256 byte tokens + its merges)."""
    merges_added: int | None = None
    merges_dropped: int | None = None
    """Merges of the language BPE left out: ASCII-only ones, and those building on them."""
    language_token: str | None = None
    """The language token the extension added (e.g. ``<|lg|>``, its last id), when the base
    tokenizer had none for ``language``; counted in ``new_tokens``."""
    format: int = EXTENSION_FORMAT

    def added(self) -> str:
        """What the extension added, text tokens and the language token apart: ``12 new text
        tokens and the language token <|lg|>``."""
        text = self.new_tokens - (self.language_token is not None)
        token = f" and the language token {self.language_token}" if self.language_token else ""
        return f"{text} new {self.language} text token{'s' * (text != 1)}{token}"

    def write(self, directory: Path) -> None:
        text = json.dumps(asdict(self), indent=1, ensure_ascii=False) + "\n"
        (Path(directory) / EXTENSION_FILE).write_text(text, encoding="utf-8")

    @classmethod
    def read(cls, directory: Path) -> VocabExtension | None:
        """The record in ``directory``, or None when it has none.

        Raises:
            UserError: the file exists but is not a valid record (names the file and the field).
        """
        path = Path(directory) / EXTENSION_FILE
        if not path.is_file():
            return None
        raw = read_json(path, CONFIG_BYTES)
        if not isinstance(raw, dict):
            raise UserError(f"{path}: expected a JSON object")
        version = raw.get("format", EXTENSION_FORMAT)
        if not isinstance(version, int) or isinstance(version, bool):
            raise UserError(f"{path}: format must be an integer, got {version!r}")
        if version > EXTENSION_FORMAT:
            raise UserError(f"{path}: format {raw['format']} is newer than this asrforge reads")
        fields = cls.__dataclass_fields__
        for name in (
            "language",
            "base_vocab_size",
            "vocab_size",
            "new_tokens",
            "base_tokenizer_sha256",
        ):
            if name not in raw:
                raise UserError(f"{path}: missing field {name!r}")
        for name in ("base_vocab_size", "vocab_size", "new_tokens"):
            value = raw[name]
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise UserError(f"{path}: {name} must be a non-negative integer, got {value!r}")
        for name in ("language", "base_tokenizer_sha256"):
            if not isinstance(raw[name], str):
                raise UserError(f"{path}: {name} must be a string, got {raw[name]!r}")
        ext = cls(**{k: v for k, v in raw.items() if k in fields})
        if ext.base_vocab_size + ext.new_tokens != ext.vocab_size:
            raise UserError(
                f"{path}: base_vocab_size {ext.base_vocab_size} + new_tokens {ext.new_tokens} "
                f"!= vocab_size {ext.vocab_size}"
            )
        return ext


def tokenizer_sha256(tok) -> str:
    """sha256 of what decides a tokenizer's ids: BPE vocab, merges, added tokens (id, text).

    Args:
        tok: a transformers tokenizer backed by ``tokenizers`` (``WhisperTokenizer``).
    """
    state = json.loads(tok.backend_tokenizer.to_str())
    model = state["model"]
    blob = {
        "vocab": sorted(model.get("vocab", {}).items(), key=lambda kv: kv[1]),
        "merges": [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])],
        "added": sorted((a["id"], a["content"]) for a in state.get("added_tokens", [])),
    }
    return hashlib.sha256(json.dumps(blob, ensure_ascii=False).encode()).hexdigest()


# ---------------------------------------------------------------------------------------------
# Tokenizer side


@lru_cache(maxsize=1)
def _byte_of() -> dict[str, int]:
    """Byte-level BPE's character -> byte map (the inverse of GPT-2's ``bytes_to_unicode``)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


def _non_ascii(token: str) -> bool:
    byte_of = _byte_of()
    return any(byte_of.get(c, 0x80) >= 0x80 for c in token)


def _pairs(merges: list, where: str) -> list[tuple[str, str]]:
    """Merges as written in tokenizer.json (``"a b"`` or ``["a", "b"]``) -> pairs."""
    out = []
    for i, m in enumerate(merges):
        pair = m.split(" ") if isinstance(m, str) else m
        if (
            not isinstance(pair, list | tuple)
            or len(pair) != 2
            or not all(isinstance(p, str) and p for p in pair)
        ):
            raise UserError(f'{where}: merge {i} is {m!r}, expected "a b" or ["a", "b"]')
        out.append((pair[0], pair[1]))
    return out


def train_language_bpe(texts: Iterable[str], vocab_size: int) -> tuple[dict[str, int], list]:
    """A byte-level BPE with Whisper's pre-tokenizer, trained on ``texts``.

    Args:
        texts: transcripts or sentences; each is given a leading space, as the data set does.
        vocab_size: size of the BPE (256 byte tokens + merges).

    Returns:
        (vocab, merges in rank order as pairs).
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator((" " + t.strip() for t in texts if t and t.strip()), trainer)
    model = json.loads(bpe.to_str())["model"]
    return model["vocab"], _pairs(model["merges"], "the trained language BPE")


@dataclass
class MergedBPE:
    """The merged BPE model: vocab (token -> id), merges in rank order, and what was kept."""

    vocab: dict[str, int]
    merges: list[tuple[str, str]]
    new_tokens: list[str]
    merges_added: int
    merges_dropped: int


def merge_bpe(
    base_vocab: dict[str, int],
    base_merges: list[tuple[str, str]],
    lang_merges: list[tuple[str, str]],
    first_new_id: int,
    reserved: set[str] = frozenset(),
) -> MergedBPE:
    """Merge a language BPE's merges into a base byte-level BPE.

    The language merges that involve a non-ASCII byte come first, in their own order, so a word
    of the language is merged as the language BPE merges it; the base merges follow (those the
    language BPE repeats move up with it). A language merge whose operand only an ASCII-only
    merge would build is dropped with it: it could never fire before the base merges.

    Args:
        base_vocab: the base BPE model's vocabulary (token -> id; added tokens not included).
        base_merges: the base merges in rank order.
        lang_merges: the language BPE's merges in rank order.
        first_new_id: id of the first appended token (the base tokenizer's length).
        reserved: strings that must not become BPE tokens (the added tokens' texts).
    """
    # Single bytes are in the vocabulary before any merge.
    available = set(_byte_of())
    front: list[tuple[str, str]] = []
    dropped = 0
    for a, b in lang_merges:
        usable = a in available and b in available and a + b not in reserved
        if not usable or not (_non_ascii(a) or _non_ascii(b)):
            dropped += 1
            continue
        front.append((a, b))
        available.add(a + b)
    vocab = dict(base_vocab)
    new_tokens = []
    for a, b in front:
        if a + b not in vocab:
            vocab[a + b] = first_new_id + len(new_tokens)
            new_tokens.append(a + b)
    moved = set(front)
    merges = front + [m for m in base_merges if m not in moved]
    return MergedBPE(vocab, merges, new_tokens, len(front), dropped)


def build_extended_tokenizer(
    base: Path,
    texts: Iterable[str],
    *,
    language: str,
    vocab_size: int,
    out: Path,
) -> VocabExtension:
    """Train a language BPE on ``texts``, merge it into the tokenizer at ``base``, write ``out``.

    Args:
        base: a Whisper tokenizer or model directory (anything ``load_tokenizer`` reads).
        texts: the language's training text (transcripts of the train split, sentences).
        language: ISO code recorded in ``vocab_extension.json``.
        vocab_size: size of the language BPE (256 byte tokens + merges); the number of new
            tokens is smaller (tokens the base has keep their ids; see :func:`merge_bpe`).
        out: the directory to write (must not exist, or be empty). Written beside and renamed.

    Raises:
        UserError: the base is not a byte-level BPE Whisper tokenizer, ``out`` is not empty, or
            the texts are empty.
    """
    base, out = Path(base), Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        what = "is not empty" if out.is_dir() else "is not a directory"
        raise UserError(f"--out {out}: exists and {what}")
    base_tok = load_tokenizer(base)
    lang_vocab, lang_merges = train_language_bpe(texts, vocab_size)
    if len(lang_vocab) <= 256:
        raise UserError(f"no text of language {language!r} to train on (the BPE learned no merges)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        base_tok.save_pretrained(str(tmp))
        tok_path = tmp / "tokenizer.json"
        state = json.loads(tok_path.read_text(encoding="utf-8"))
        model = state["model"]
        if model.get("type") != "BPE" or state.get("pre_tokenizer", {}).get("type") != "ByteLevel":
            raise UserError(f"{base}: not a byte-level BPE tokenizer; cannot extend it")
        added = {a["content"]: a["id"] for a in state["added_tokens"]}
        language_token = _missing_language_token(language, added)
        merged = merge_bpe(
            model["vocab"],
            _pairs(model["merges"], str(base / "tokenizer.json")),
            lang_merges,
            first_new_id=len(base_tok),
            reserved=set(added) | ({language_token} if language_token else set()),
        )
        n_new = len(merged.new_tokens)
        # A language token goes after the BPE tokens, as a special token like Whisper's.
        if language_token is not None:
            added[language_token] = len(base_tok) + n_new
            state["added_tokens"].append(
                {"id": added[language_token], "content": language_token, "single_word": False,
                 "lstrip": False, "rstrip": False, "normalized": False, "special": True}
            )  # fmt: skip
            n_new += 1
        # The added tokens go into the BPE vocabulary too (as GPT-2 has <|endoftext|>): the
        # loader re-adds them at ``len(vocab)`` onwards unless it finds them there, and the new
        # tokens after them would otherwise push them off their ids.
        model["vocab"] = {**merged.vocab, **added}
        model["merges"] = [list(m) for m in merged.merges]
        tok_path.write_text(json.dumps(state, ensure_ascii=False), encoding="utf-8")
        ext = VocabExtension(
            language=language,
            base_vocab_size=len(base_tok),
            vocab_size=len(base_tok) + n_new,
            new_tokens=n_new,
            base_tokenizer_sha256=tokenizer_sha256(base_tok),
            base=str(base.resolve()),
            trained_vocab_size=len(lang_vocab),
            merges_added=merged.merges_added,
            merges_dropped=merged.merges_dropped,
            language_token=language_token,
        )
        ext.write(tmp)
        check_extended_tokenizer(tmp, base_tok, load_tokenizer(tmp))
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info(
        "extended %s by %s to %d (%d merges added, %d dropped): %s",
        base,
        ext.added(),
        ext.vocab_size,
        ext.merges_added,
        ext.merges_dropped,
        out,
    )
    return ext


def _missing_language_token(language: str, added: dict[str, int]) -> str | None:
    """``<|xx|>`` for ``language`` when the base tokenizer has language tokens (a multilingual
    Whisper's ``<|en|>``) but none for it; else None."""
    code = find_language_code(language)
    if code is None or "<|en|>" not in added or f"<|{code}|>" in added:
        return None
    log.info("the base tokenizer has no <|%s|>: adding it as a new special token", code)
    return f"<|{code}|>"


def check_extended_tokenizer(directory: Path, base_tok=None, tok=None) -> VocabExtension:
    """Check an extended tokenizer directory before anything uses it.

    Checks ``tokenizer.json`` (a byte-level BPE; merges as ``"a b"`` or ``["a", "b"]``; each
    merge's parts and result in the vocabulary; ids unique and contiguous) and
    ``vocab_extension.json`` (sizes agree with the tokenizer). With ``base_tok``, also that every
    base id (special and added tokens included) still holds the same token; with ``tok`` (the
    directory as loaded), that the loader kept every id of ``tokenizer.json``.

    Raises:
        UserError: naming the file and what is wrong.
    """
    ext, ids = _check_files(Path(directory))
    path = Path(directory) / "tokenizer.json"
    if base_tok is not None:
        check_base_ids(ext, base_tok, ids, path)
    if tok is not None:
        _check_loaded_ids(tok, ids, path)
    return ext


def _check_files(directory: Path) -> tuple[VocabExtension, dict[int, str]]:
    """(the extension record, id -> token of tokenizer.json); see check_extended_tokenizer."""
    if not Path(directory).is_dir():
        what = "not a directory" if Path(directory).exists() else "no such directory"
        raise UserError(f"{directory}: {what} (a tokenizer `asrforge vocab build` wrote)")
    ext = VocabExtension.read(directory)
    if ext is None:
        raise UserError(f"{directory}: no {EXTENSION_FILE}; not made by `asrforge vocab build`")
    path = directory / "tokenizer.json"
    try:
        state = read_json(path, TOKENIZER_BYTES, error=ValueError)
        model, added = state["model"], state.get("added_tokens", [])
        vocab = model["vocab"]
    except FileNotFoundError:
        raise UserError(f"{path}: missing (an extended tokenizer is a tokenizer.json)") from None
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"{path}: not a tokenizers JSON file ({e!r})") from None
    if model.get("type") != "BPE" or not isinstance(vocab, dict):
        raise UserError(f"{path}: the model is {model.get('type')!r}, expected a BPE")
    for i, (a, b) in enumerate(_pairs(model.get("merges", []), str(path))):
        for part in (a, b, a + b):
            if part not in vocab:
                raise UserError(f"{path}: merge {i} ({a!r}, {b!r}) uses {part!r}, not in the vocab")
    ids = {**{i: t for t, i in vocab.items()}, **{a["id"]: a["content"] for a in added}}
    if sorted(ids) != list(range(len(ids))):
        raise UserError(f"{path}: token ids are not 0..{len(ids) - 1} without gaps or clashes")
    if len(ids) != ext.vocab_size:
        raise UserError(
            f"{directory / EXTENSION_FILE}: records vocab_size {ext.vocab_size} but "
            f"{path} has {len(ids)} tokens (a tokenizer replaced after `asrforge vocab build`?)"
        )
    return ext, ids


def check_base_ids(ext: VocabExtension, base_tok, ids: dict[int, str], path: Path) -> None:
    """Raise a UserError (naming ``path``) unless every id of ``base_tok`` holds the same token
    in ``ids`` (id -> token of the extended tokenizer)."""
    if len(base_tok) != ext.base_vocab_size:
        raise UserError(
            f"{path.parent / EXTENSION_FILE}: base_vocab_size {ext.base_vocab_size}, but the "
            f"base tokenizer has {len(base_tok)} tokens"
        )
    base_ids = base_tok.convert_ids_to_tokens(list(range(len(base_tok))))
    moved = [i for i, t in enumerate(base_ids) if ids.get(i) != t]
    if moved:
        raise UserError(f"{path}: base ids {moved[:5]} hold other tokens than in the base")


def _check_loaded_ids(tok, ids: dict[int, str], path: Path) -> None:
    loaded = tok.convert_ids_to_tokens(list(range(len(tok))))
    moved = [i for i, t in enumerate(loaded) if ids.get(i) != t]
    if len(loaded) != len(ids) or moved:
        raise UserError(
            f"{path}: loads as {len(loaded)} tokens with other tokens at ids {moved[:5]} than "
            f"the file holds ({len(ids)} tokens): written for another tokenizers/transformers "
            "version? Rebuild it with `asrforge vocab build`"
        )


def load_extended_tokenizer(directory: Path):
    """``load_tokenizer`` for a directory with ``vocab_extension.json``: its files are checked
    first (the loader reports broken merges as a bare ``Exception``) and the ids after.

    Raises:
        UserError: naming the file and what is wrong (see :func:`check_extended_tokenizer`).
    """
    directory = Path(directory)
    _, ids = _check_files(directory)
    tok = load_tokenizer(directory)
    _check_loaded_ids(tok, ids, directory / "tokenizer.json")
    return tok


def ids_read_as_timestamps(tok) -> range:
    """The ids that transformers (``_decode_asr``, ``_compute_offsets``, timestamp generation)
    and faster-whisper take for timestamps though they are not: every id past the timestamp
    tokens, since they read any id >= ``<|notimestamps|>`` + 1 as one. Those are an extended
    vocabulary's new tokens (and a language token it added); empty for Whisper's own."""
    no_timestamps = tok.convert_tokens_to_ids("<|notimestamps|>")
    if no_timestamps is None or no_timestamps == tok.unk_token_id:
        return range(0)
    end, size = no_timestamps + 1, len(tok)
    step = 0  # <|0.00|>, <|0.02|>, ... follow <|notimestamps|>
    while end < size and tok.convert_ids_to_tokens(end) == f"<|{step * TIME_PRECISION:.2f}|>":
        end, step = end + 1, step + 1
    return range(end, size)


def read_transcripts(data: Path | DataConfig, language: str, split: str = "train") -> list[str]:
    """Non-empty transcripts of ``language`` in ``split`` of a data set in any form ``data.path``
    takes (a path, or a data section naming its columns; the audio is neither needed nor read);
    the ``language`` column and ``language`` may be codes, names or locales (resolved alike), and
    data without a language column is all ``language``."""

    wanted = resolve_language(language, strict=False)
    ds = read_split(data, split, required=("text",), default_language=wanted)
    codes: dict[str, str] = {}  # the column's spellings ("English", "en-US") -> code
    texts = []
    for batch in ds.select_columns(["text", "language"]).iter(batch_size=4096):
        for t, lang in zip(batch["text"], batch["language"], strict=True):
            if lang not in codes:
                codes[lang] = resolve_language(str(lang), strict=False)
            if codes[lang] == wanted and isinstance(t, str) and t.strip():
                texts.append(t.strip())
    return texts


def iter_text_file(path: Path, max_lines: int | None = None) -> Iterator[str]:
    """Lines of a UTF-8 text file, streamed (at most ``max_lines``)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"--text {path}: no such file")
    with path.open(encoding="utf-8", errors="replace") as f:
        yield from (line.rstrip("\n") for line in islice(f, max_lines))


# ---------------------------------------------------------------------------------------------
# Report


def token_counts(tok, texts: list[str]) -> np.ndarray:
    """Tokens per utterance as the data set encodes them (leading space, no special tokens)."""
    enc = tok.backend_tokenizer.encode_batch(
        [" " + t.strip() for t in texts], add_special_tokens=False
    )
    return np.array([len(e.ids) for e in enc], dtype=np.int64)


def compare_tokenizers(base_tok, ext_tok, texts: list[str]) -> dict:
    """Tokens per utterance before and after, and the greedy-decode steps that saves.

    A decode step is one decoder pass: the text tokens plus ``<|endoftext|>``.
    """
    if not texts:
        raise UserError("no utterances to compare on")
    before, after = token_counts(base_tok, texts), token_counts(ext_tok, texts)

    def stats(x: np.ndarray) -> dict:
        return {
            "mean": float(x.mean()),
            "p50": float(np.percentile(x, 50)),
            "p95": float(np.percentile(x, 95)),
            "total": int(x.sum()),
        }

    steps_before, steps_after = int(before.sum()) + len(texts), int(after.sum()) + len(texts)
    saved = steps_before - steps_after
    return {
        "n": len(texts),
        "before": stats(before),
        "after": stats(after),
        "decode_steps_before": steps_before,
        "decode_steps_after": steps_after,
        "decode_steps_saved": saved,
        "decode_steps_saved_pct": 100.0 * saved / steps_before,
    }
