"""Rehearsal (``data.replay``): rows of another data set mixed into the training utterances.

The training data set then reads :class:`JoinedRows` (the training split's rows, then the replay
split's) through :class:`ReplayUtterances` (the training utterances, then the replay utterances
drawn by :func:`replay_picks`, their rows shifted past the training split's and their ids under
``replay/``). Every replay utterance keeps its own language, so its prompt carries its own tag
and packing puts it in windows of that language. The draw is a pure function of (seed, the
replay set's usable rows), fixed for the run: a resumed run trains on the same rows.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from asrforge.config import DataConfig, ReplayConfig
from asrforge.data.ids import row_keys
from asrforge.data.sources import read_split
from asrforge.errors import UserError
from asrforge.io.atomic import atomic_write_text
from asrforge.io.small_files import RECORDS_BYTES, read_json

# "RPLY" in ASCII keeps this draw apart from the run's other (seed, ...) streams.
_SALT = 0x52504C59
REPLAY_PREFIX = "replay/"
"""What a replay utterance's id starts with (skip reports, evaluation records)."""


def read_replay(cfg: ReplayConfig, cache_dir: Path | None):
    """The replay split with the standard columns, read as ``data.path`` is.

    Raises:
        UserError: the data is missing, lacks the split, or a column is wrong.
    """
    data = DataConfig(
        path=cfg.path,
        columns=cfg.columns,
        language=cfg.language,
        audio_dir=cfg.audio_dir,
        cache_dir=cache_dir,
    )
    return read_split(data, cfg.split, option="data.replay.split", section="data.replay")


def replay_count(n_train: int, share: float) -> int:
    """Replay utterances that make ``share`` of the training utterances (at least one)."""
    return max(1, round(n_train * share / (1 - share)))


def replay_picks(n_usable: int, count: int, seed: int) -> np.ndarray:
    """``count`` indices into the ``n_usable`` replay utterances: whole permutations of them,
    as many as fit, then part of one more (each row once before any twice)."""
    rng = np.random.default_rng([_SALT, seed])
    rounds = -(-count // n_usable)
    return np.concatenate([rng.permutation(n_usable) for _ in range(rounds)])[:count]


class JoinedRows:
    """The rows a training data set reads: row ``r`` is the training split's below its length,
    else the replay split's row ``r - len(train)``."""

    def __init__(self, train, replay):
        self.train, self.replay = train, replay
        self.offset = len(train)

    def __len__(self) -> int:
        return self.offset + len(self.replay)

    def __getitem__(self, row: int) -> dict:
        row = int(row)
        return self.train[row] if row < self.offset else self.replay[row - self.offset]


class ReplayUtterances(Sequence):
    """The training utterances, then the picked replay utterances (rows in :class:`JoinedRows`).

    Args:
        train: the training split's usable utterances.
        replay: the replay split's usable utterances.
        picks: indices into ``replay`` (:func:`replay_picks`).
        row_offset: the training split's length (the replay rows' shift).
    """

    def __init__(self, train: Sequence, replay: Sequence, picks: np.ndarray, row_offset: int):
        self.train, self.replay = train, replay
        self.picks, self.row_offset = picks, row_offset

    @property
    def first_replay(self) -> int:
        """The index of the first replay utterance."""
        return len(self.train)

    def __len__(self) -> int:
        return len(self.train) + len(self.picks)

    def replay_uids(self) -> list[str]:
        """The ids of the drawn replay utterances, in order (read from the id column only)."""
        uids = self.replay.uids() if hasattr(self.replay, "uids") else [u.uid for u in self.replay]
        return [REPLAY_PREFIX + uids[int(k)] for k in self.picks]

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        i = int(i)
        if i < 0:
            i += len(self)
        if i < len(self.train):
            return self.train[i]
        u = self.replay[int(self.picks[i - len(self.train)])]
        return replace(u, row=u.row + self.row_offset, uid=REPLAY_PREFIX + u.uid)


RECORD_FILE = "replay.json"
"""The run directory's record of the replay data it drew from."""


def check_same_replay(split, cfg: ReplayConfig, run_dir: Path, *, resuming: bool, is_main: bool):
    """Record the replay data a run draws from (``run_dir/replay.json``: its path, row count and
    a fingerprint of its rows' keys); a resumed run must draw from the same rows, or the replay
    utterances, and with them the data order, would differ from the run it continues.

    Raises:
        UserError: resuming on replay data other than the recorded one.
    """
    keys = row_keys(split)
    digest = hashlib.sha256("\n".join(keys).encode()).hexdigest()
    record = Path(run_dir) / RECORD_FILE
    if resuming and record.is_file():
        saved = read_json(record, RECORDS_BYTES)
        if not isinstance(saved, dict):
            raise UserError(f"data.replay: {record} is not a replay record (a JSON object)")
        if (saved.get("rows"), saved.get("sha256")) != (len(keys), digest):
            raise UserError(
                f"data.replay: {record} records {saved.get('rows')} replay rows of "
                f"{saved.get('path')}; {cfg.path} holds {len(keys)} rows now, or other ones: "
                "resume on the replay data the run started with"
            )
        return
    if is_main:
        record.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(record, json.dumps({"path": str(cfg.path), "rows": len(keys),
                                              "sha256": digest}))  # fmt: skip


def check_apart_from_guard(
    replay_split, cfg: ReplayConfig, guard_path: Path, guard_files: Iterable[Path]
) -> None:
    """Refuse replay data that is the guard's set or holds one of its clips: the guard would
    measure what the run trained on.

    Args:
        guard_files: every audio file the guard set reads or was joined from, resolved.

    Raises:
        UserError: naming the shared path or clip.
    """
    if Path(cfg.path).resolve() == Path(guard_path).resolve():
        raise UserError(
            f"data.replay.path: {cfg.path} is the forgetting guard's set (eval.guard.path): "
            "never train on the guard's clips; replay other data of the languages it measures"
        )
    guard = set(guard_files)
    if not guard:
        return
    for k, path in enumerate(_audio_paths(replay_split)):
        if path is not None and Path(path).resolve() in guard:
            raise UserError(
                f"data.replay.path: row {k} of {cfg.path} reads {path}, a clip of the forgetting "
                f"guard's set ({guard_path}): never train on the guard's clips; leave them out "
                "of the replay data"
            )


def _audio_paths(split) -> Iterable[str | None]:
    for row in split.select_columns(["audio"]):
        audio = row["audio"]
        yield audio.get("path") if isinstance(audio, dict) and not audio.get("bytes") else None
