"""Text-only language-model batches for multitask training (``data.asr_ratio < 1``).

How it works: docs/data.md, "Text-only batches (`data/text_only.py`)".
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from asrforge.data.dataset import IGNORE
from asrforge.errors import UserError

log = logging.getLogger(__name__)

SHUFFLE_BLOCK = 1024
"""Lines shuffled together (the most held in memory at once)."""
LINE_LIMIT = 1 << 16
"""Bytes of a line that are read; a longer line is skipped (the decoder holds a few hundred
tokens; a file without newlines must not be read whole)."""
_GOLDEN = 0.6180339887498949


def is_text_batch(seed: int, index: int, asr_ratio: float) -> bool:
    """Whether micro-batch ``index`` (0-based, over the whole run) is a text-only batch.

    Text-only batches are spread evenly: of any ``n`` consecutive micro-batches,
    ``(1 - asr_ratio) * n`` rounded up or down are text-only (with 0.5, every other one). The
    seed shifts the phase.
    """
    if asr_ratio >= 1.0:
        return False
    share = 1.0 - asr_ratio
    phase = (seed * _GOLDEN) % 1.0
    return math.floor((index + 1) * share + phase) > math.floor(index * share + phase)


@dataclass
class _Block:
    """Up to SHUFFLE_BLOCK consecutive lines of one pass: their token ids in shuffled order."""

    examples: list[list[int]]
    n_lines: int
    end: int  # byte offset after the block
    last: bool  # the pass ends with this block


class TextBatches:
    """Streams text-only batches from a text file.

    Args:
        path: a UTF-8 text file, one sentence per line (invalid bytes are replaced).
        tokenizer: the run's tokenizer (a transformers tokenizer backed by ``tokenizers``).
        prompt: decoder prompt ids (``SpecialTokens.prompt(language, "transcribe")``).
        eot: ``<|endoftext|>``'s id (the last label; also pads decoder inputs).
        batch_size: lines per batch.
        max_len: the decoder's positions (``max_target_positions``); longer lines are cut.
        max_lines: use only the first N lines of the file; default all.
        seed: seeds the in-block shuffle.
    """

    def __init__(
        self,
        path: Path,
        *,
        tokenizer,
        prompt: list[int],
        eot: int,
        batch_size: int,
        max_len: int,
        max_lines: int | None = None,
        seed: int = 0,
    ):
        self.path = Path(path)
        self.tokenizer = tokenizer
        self.prompt = list(prompt)
        self.eot = eot
        self.batch_size = batch_size
        self.max_len = max_len
        self.max_lines = max_lines
        self.seed = seed
        self.bytes_read = 0
        """Highest byte offset of the file read so far."""
        self.skipped_long = 0
        if max_len < len(self.prompt) + 2:
            raise UserError(
                f"data.text_path: max_target_positions {max_len} leaves no room for text"
            )

    def check(self) -> None:
        """Read the first block now, so a missing or unusable file fails at start-up.

        Raises:
            UserError: naming ``data.text_path`` and what is wrong.
        """
        if not self.path.is_file():
            raise UserError(f"data.text_path: {self.path} is not a file")
        try:
            with self.path.open("rb") as f:
                block = self._read_block(f, 0, 0, 0)
        except OSError as e:
            raise UserError(f"data.text_path: cannot read {self.path}: {e}") from None
        if not block.examples:
            raise UserError(
                f"data.text_path: {self.path} has no non-empty line in its first "
                f"{block.n_lines} lines"
            )

    # ------------------------------------------------------------------------------------------
    def batches(self, position: dict | None = None) -> Iterator[dict]:
        """Text-only batches forever, from ``position`` (a previous batch's ``text_position``)
        or the start. Each batch is a dict as the speech collator's, without audio:
        ``decoder_input_ids``/``labels`` (batch, seq), ``size``, ``task="lm"``, ``dropped=[]``,
        and ``text_position``: where the stream stands after this batch."""
        pos = {"pass": 0, "offset": 0, "line": 0, "taken": 0, **(position or {})}
        block: _Block | None = None
        # Passes in a row without a usable line, which means the file has none.
        barren_passes = 0
        with self.path.open("rb") as f:
            while True:
                rows: list[list[int]] = []
                while len(rows) < self.batch_size:
                    if block is None:
                        f.seek(pos["offset"])
                        block = self._read_block(f, pos["line"], pos["pass"], pos["offset"])
                    if pos["taken"] < len(block.examples):
                        rows.append(block.examples[pos["taken"]])
                        pos["taken"] += 1
                        barren_passes = 0
                        continue
                    # The last block starts a new pass, with a new shuffle.
                    if block.last:
                        barren_passes += 1
                        if barren_passes > 1:
                            raise UserError(f"data.text_path: {self.path} has no usable line")
                        pos.update({"pass": pos["pass"] + 1, "offset": 0, "line": 0})
                    else:
                        pos.update({"offset": block.end, "line": pos["line"] + block.n_lines})
                    pos["taken"] = 0
                    block = None
                yield self._collate(rows, dict(pos))

    def _read_block(self, f, line: int, pass_: int, offset: int) -> _Block:
        """Read up to SHUFFLE_BLOCK lines from ``f`` (at byte ``offset``, line ``line`` of the
        file), tokenize them and shuffle them (seeded by seed, pass and offset)."""
        limit = (
            SHUFFLE_BLOCK if self.max_lines is None else min(SHUFFLE_BLOCK, self.max_lines - line)
        )
        texts: list[str] = []
        n, last = 0, False
        while n < limit:
            raw = f.readline(LINE_LIMIT)
            if not raw:
                last = True
                break
            n += 1
            if len(raw) == LINE_LIMIT and not raw.endswith(b"\n"):
                self.skipped_long += 1
                while raw and not raw.endswith(b"\n"):  # skip the rest of it, in bounded reads
                    raw = f.readline(LINE_LIMIT)
                continue
            text = raw.decode("utf-8", errors="replace").strip()
            if text:
                texts.append(text)
        end = f.tell()
        self.bytes_read = max(self.bytes_read, end)
        last = last or (self.max_lines is not None and line + n >= self.max_lines)
        examples = self._encode(texts)
        random.Random(f"{self.seed}/{pass_}/{offset}").shuffle(examples)
        return _Block(examples, n, end, last)

    def _encode(self, texts: list[str]) -> list[list[int]]:
        if not texts:
            return []
        enc = self.tokenizer.backend_tokenizer.encode_batch(
            [" " + t for t in texts], add_special_tokens=False
        )
        return [e.ids for e in enc if e.ids]

    def _collate(self, rows: list[list[int]], position: dict) -> dict:
        p = len(self.prompt)
        seqs = [(self.prompt + ids + [self.eot])[: self.max_len + 1] for ids in rows]
        t = max(len(s) for s in seqs) - 1
        dec = torch.full((len(seqs), t), self.eot, dtype=torch.long)
        lab = torch.full((len(seqs), t), IGNORE, dtype=torch.long)
        for r, s in enumerate(seqs):
            dec[r, : len(s) - 1] = torch.tensor(s[:-1])
            lab[r, p - 1 : len(s) - 1] = torch.tensor(s[p:])
        return {
            "task": "lm",
            "decoder_input_ids": dec,
            "labels": lab,
            "size": len(seqs),
            "dropped": [],
            "text_position": position,
        }


def interleave(
    speech: Iterable[dict], text: Iterator[dict], *, seed: int, asr_ratio: float, start: int
) -> Iterator[dict]:
    """Speech batches with text-only batches put in where :func:`is_text_batch` says.

    Args:
        speech: the speech batches of (the rest of) an epoch.
        text: :meth:`TextBatches.batches`, drawn from lazily.
        seed, asr_ratio: as for :func:`is_text_batch`.
        start: the run-wide index of the next micro-batch.

    The epoch ends with its last speech batch; text-only batches due after it come first in
    the next epoch (the index runs on), so the interleaving does not depend on epoch length.
    """
    index = start
    for batch in speech:
        while is_text_batch(seed, index, asr_ratio):
            yield next(text)
            index += 1
        yield batch
        index += 1
