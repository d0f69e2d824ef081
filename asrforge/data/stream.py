"""The streamed training split (``data.stream``): rows read from their files shard by shard, in an
order that is a pure function of (seed, epoch), so a resumed run sees exactly the batches an
uninterrupted one would have (why not ``datasets.IterableDataset``: docs/decisions.md).

Shards (:mod:`asrforge.data.shards`): a parquet row group, an arrow/csv/tsv file, or
``data.stream.shard_rows`` lines of a JSONL file. Epoch ``e``: the shards permuted by (seed, e) in blocks of
``data.stream.shuffle_shards``, each block's rows permuted by (seed, e, block), cut into batches;
batch ``j`` goes to rank ``j % world`` and that rank's ``i``-th batch to worker ``i % num_workers``
(the DataLoader takes the workers' outputs round-robin, so the order holds to the epoch's end).
Rows are checked as their batch is built (:func:`check_row`: ``prepare_split``'s rules and
reasons); a row ``data.languages`` leaves out is no skip (:meth:`StreamedSplit.left_out`).
With ``data.sampling`` each row appears as many times as its multiplicity for the epoch
(:class:`~asrforge.data.sampling.ShardSampling`: drawn from the language column alone) before
its block is permuted, so the epoch's length is known before it starts and resume stays exact.
With ``data.replay`` the drawn replay utterances (checked before step 1) join every epoch, each
once, spread over its blocks in proportion to their rows (:func:`replay_blocks`).
``stream_position`` records the shard list's fingerprint: a resume on other shards is refused.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from asrforge.config import DataConfig
from asrforge.data.columns import find_column, language_codes, standardize
from asrforge.data.dataset import Collator, SpeechDataset, language_label_after
from asrforge.data.ids import audio_key, audio_source, named, row_id
from asrforge.data.locate import is_url
from asrforge.data.prepare import Utterance
from asrforge.data.replay import ReplayUtterances
from asrforge.data.rules import (
    NOT_FOUND,
    UnusableAudio,
    UtteranceRules,
    check_english_only,
    check_language_tokens,
    header_seconds,
    is_english,
    kept_rows,
    language_filter,
    left_out_counts,
    row_language,
    trained_languages,
    utterance_problem,
)
from asrforge.data.sampling import ShardSampling
from asrforge.data.shards import Shard, find_shards, read_table, shard_list_fingerprint
from asrforge.data.sources import read_split
from asrforge.data.workers import StopSignalLoader, ignore_stop_signals
from asrforge.errors import UserError
from asrforge.hub import hub_ref
from asrforge.text.languages import resolve_language

# -- order -----------------------------------------------------------------------------------


def epoch_blocks(n_shards: int, block: int, seed: int, epoch: int) -> list[list[int]]:
    """The shard indices of each block of ``epoch``, in the order they are read."""
    order = np.random.default_rng([seed, epoch]).permutation(n_shards).tolist()
    return [order[i : i + block] for i in range(0, n_shards, block)]


def block_order(n_rows: int, seed: int, epoch: int, block: int) -> np.ndarray:
    """The order in which a block's rows (numbered across its shards) are read."""
    return np.random.default_rng([seed, epoch, block, 1]).permutation(n_rows)


def replay_blocks(n_replay: int, block_rows: list[int], seed: int, epoch: int) -> list[np.ndarray]:
    """The replay utterances (indices) each block of ``epoch`` holds: a permutation of them cut
    in proportion to the blocks' rows."""
    order = np.random.default_rng([seed, epoch, 2]).permutation(n_replay)
    rows = np.asarray(block_rows, dtype=np.float64)
    share = np.cumsum(rows) / rows.sum() if rows.sum() else np.ones(len(rows))
    return np.split(order, np.round(share[:-1] * n_replay).astype(np.int64))


def local_batches(total_rows: int, batch_size: int, rank: int, world: int) -> int:
    """Batches of an epoch of ``total_rows`` rows that rank ``rank`` of ``world`` takes."""
    return len(range(rank, -(-total_rows // batch_size), world))


# -- checks ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RowRules:
    """What :func:`check_row` needs: the rules ``prepare_split`` applies (one set: its limits
    and reason strings), and what only a stream checks row by row: the split's name (its
    messages) and the language filter."""

    utterance: UtteranceRules
    split: str
    # data.languages' codes, or None for all.
    keep: set[str] | None


def check_row(row: dict, uid: str, rules: RowRules) -> Utterance | str | None:
    """The utterance of one standardized row (``audio``, ``text``, ``language``), why it is
    skipped (the ``SkipReport`` reason ``prepare_split`` gives: :func:`utterance_problem` and
    the audio header's), or None when ``data.languages`` leaves its language out (on purpose,
    not a skip: counted up front, :meth:`StreamedSplit.left_out`). ``Utterance.row`` is 0.

    Raises:
        UserError: its language has no token (every utterance of it would be dropped), or is
            not English under an English-only model.
    """
    value = row.get("language")
    utterance, specials = rules.utterance, rules.utterance.specials
    lang = row_language(value, specials.multilingual)
    if rules.keep is not None and lang not in rules.keep:
        return None
    if specials.multilingual and specials.token_language(lang) is None:
        check_language_tokens(Counter([value]), rules.split, specials, rules.keep, [uid])
    if not specials.multilingual and not is_english(value):
        check_english_only(Counter([value]), rules.split, False, rules.keep)
    text = row.get("text")
    prompt = utterance.prompt(lang)
    text_ids = utterance.text_ids(text) if text and text.strip() else []
    duration = row.get("duration")
    # what the text and the data's duration tell (as prepare_split), then the audio's header
    problem = utterance_problem(
        utterance,
        text=text,
        n_prompt=len(prompt),
        n_text=len(text_ids),
        seconds=math.nan if duration is None else float(duration),
    )
    if problem is not None:
        return problem
    audio = row.get("audio") or {}
    try:
        seconds = header_seconds(audio)
    except UnusableAudio as e:
        return e.reason
    problem = utterance.seconds_problem(seconds)
    if problem is not None:
        return problem
    return Utterance(0, uid, lang, text.strip(), prompt, text_ids, audio_key(audio), seconds)


def _count_languages(column) -> Counter:
    """The rows per language code of a pyarrow ``column`` of language values."""
    counts: Counter = Counter()
    codes, index = language_codes(column)
    for code, n in zip(codes, np.bincount(index, minlength=len(codes)), strict=True):
        counts[code] += int(n)
    return counts


def _row_languages(table, multilingual: bool) -> np.ndarray:
    """Each row's language code as it trains (:func:`row_language`) of a standardized shard (a
    ``datasets.Dataset``)."""
    codes, index = language_codes(table.data.column("language"))
    codes = [row_language(code, multilingual) for code in codes]
    return np.asarray(codes, dtype=object)[index] if len(codes) else np.zeros(0, dtype=object)


# -- the stream ------------------------------------------------------------------------------


class StreamedSplit:
    """The training split as a stream of shards (see the module docstring).

    Args:
        cfg: the data section (``path``, ``columns``, ``language``, ``audio_dir``, ``stream``,
            ``batch_size``, ``num_workers``, ``train_split``).
        seed: the run's seed: the order of every epoch.

    Raises:
        UserError: the files cannot be read, or the first shard lacks a column.
    """

    def __init__(self, cfg: DataConfig, seed: int):
        self.cfg, self.seed = cfg, seed
        self.split = cfg.train_split
        self.shards, self.audio_root = find_shards(cfg)
        self.language = (
            resolve_language(cfg.language, "data.language") if cfg.language is not None else None
        )
        self.fingerprint = shard_list_fingerprint(self.shards)
        self.first_rows = np.cumsum([0] + [s.rows for s in self.shards])  # global row numbers
        self.rules: RowRules | None = None  # set by prepare()
        self.features = None
        self.eot = 0
        # An Augmenter, set from data.augment.
        self.augment = None
        # SpeechDataset.language_after of the streamed rows, set by prepare().
        self.language_after: int | None = None
        self.epoch = 0
        """The epoch :meth:`loader` last served."""
        # data.sampling's draw, set by prepare().
        self.sampling: ShardSampling | None = None
        # data.replay's drawn utterances, set by join_replay().
        self.replay: SpeechDataset | None = None
        self.languages: Counter = Counter()
        """The languages of the first shard (the run's language when none is configured)."""
        # Rows per language of each shard. With data.language set every row has it; otherwise
        # the shards are counted when asked.
        self._shard_languages: list[Counter] | None = (
            [Counter({self.language: s.rows}) for s in self.shards]
            if self.language is not None
            else None
        )
        first = self.read_shard(0)  # a missing column or a bad type fails now, not mid-epoch
        self.languages.update(resolve_language(x, strict=False) for x in first["language"])

    def __len__(self) -> int:
        return int(self.first_rows[-1])

    def read_shard(self, index: int):
        """Shard ``index`` with the standard columns (a ``datasets.Dataset`` in memory)."""
        import datasets
        from datasets.table import InMemoryTable

        shard = self.shards[index]
        where = (
            shard.path
            if shard.fmt != "json"
            else f"{shard.path} (lines from {shard.first_line + 1})"
        )
        table = read_table(shard)
        if table.num_rows != shard.rows:
            raise UserError(f"data.path: {where} changed while training ({table.num_rows} rows, "
                            f"{shard.rows} when the run started)")  # fmt: skip
        ds = datasets.Dataset(InMemoryTable(table))
        columns_log = logging.getLogger("asrforge.data.columns")  # standardize's
        level = columns_log.level
        # What standardize says of one shard it says of all, so it is said once.
        if index or self.languages:
            columns_log.setLevel(max(level, logging.WARNING))
        try:
            return standardize(
                ds, self.cfg, where=where, audio_root=self.audio_root, language=self.language
            )
        finally:
            columns_log.setLevel(level)

    def read_columns(self, shard: Shard, keys: list[str]) -> list:
        """The pyarrow columns of ``shard`` holding ``keys`` (``text``, ``language``), in that
        order, not standardized; a parquet file reads these alone."""
        found: dict[str, str] = {}

        def keep(names: list[str]) -> list[str]:
            named = self.cfg.columns.model_dump()
            for key in keys:
                taken = {c for k, c in named.items() if k != key}
                found[key] = find_column(names, key, named[key], shard.path, required=True,
                                         taken=taken)  # fmt: skip
            return list(dict.fromkeys(found.values()))

        table = read_table(shard, keep)
        return [table.column(found[key]) for key in keys]

    def texts(self) -> Iterator[str | None]:
        """The transcripts of the rows ``data.languages`` keeps, shard by shard in file order (a
        tokenizer trained here reads them, and is multilingual: a row with no language is kept
        only when every row is); a pass to the end counts every row per language too, which
        :meth:`language_counts` then gives without reading the shards again."""
        keep = language_filter(self.cfg.languages)
        if self.language is not None and keep is not None and self.language not in keep:
            return
        counting = self._shard_languages is None
        # with data.language every row has it, so the files need no language column
        by_row = self.language is None and (counting or keep is not None)
        counts: list[Counter] = []
        for shard in self.shards:
            columns = self.read_columns(shard, ["text", "language"] if by_row else ["text"])
            texts = columns[0]
            if by_row:
                if counting:
                    counts.append(_count_languages(columns[1]))
                texts = texts.filter(kept_rows(columns[1], keep, multilingual=True))
            yield from texts.to_pylist()
        if counting:
            self._shard_languages = counts

    def prepare(self, *, tokenizer, specials, features, eot: int, max_target_positions: int,
                max_seconds: float) -> None:  # fmt: skip
        """Give the stream what its rows are checked and featurized with; the first shard's
        languages are checked for a token now, and ``data.sampling``'s draw is set up (every
        shard's language column is read, once a run).

        Raises:
            UserError: a language of the first shard has no token, or ``data.sampling.weights``
                misses a language of the split.
        """
        keep = language_filter(self.cfg.languages)
        rules = UtteranceRules(
            tokenizer, specials, self.cfg.task, max_target_positions, max_seconds
        )
        self.rules = RowRules(rules, self.split, keep)
        self.features, self.eot = features, eot
        self.language_after = language_label_after(specials, self.cfg.language_target)
        if specials.multilingual:
            check_language_tokens(self.languages, self.split, specials, keep)
        check_english_only(self.languages, self.split, specials.multilingual, keep)
        if self.cfg.sampling is not None:
            counts = [self.as_trained(c) for c in self.shard_language_counts()]
            self.sampling = ShardSampling.of(counts, keep, self.cfg.sampling, self.seed)

    def as_trained(self, counts: Counter) -> Counter:
        """``counts`` (rows per language code as the data names them, ``""`` for none) keyed
        as the rows train under the model :meth:`prepare` was given (:func:`row_language`);
        as they are before it, when no model is known."""
        if self.rules is None:
            return Counter(counts)
        return trained_languages(counts, self.rules.utterance.specials.multilingual)

    def left_out(self) -> dict[str, int]:
        """Rows per language code that ``data.languages`` leaves out, over every shard (their
        language column alone is read: a pass over the metadata, made only with the filter),
        keyed as the rows train, as :func:`check_row` filters them."""
        keep = language_filter(self.cfg.languages)
        if keep is None:
            return {}
        return left_out_counts(self.as_trained(self.language_counts()), keep)

    def language_counts(self) -> Counter:
        """Rows per language code over every shard (their language column alone is read, once
        a run)."""
        return sum(self.shard_language_counts(), Counter())

    def shard_language_counts(self) -> list[Counter]:
        """Rows per language code of each shard (read as :meth:`language_counts` reads them)."""
        if self._shard_languages is None:
            self._shard_languages = [
                _count_languages(self.read_columns(shard, ["language"])[0]) for shard in self.shards
            ]
        return [Counter(c) for c in self._shard_languages]

    def shard_rows(self, epoch: int) -> list[int]:
        """Rows each shard gives ``epoch``: its rows, or with ``data.sampling`` their copies."""
        if self.sampling is None:
            return [s.rows for s in self.shards]
        return self.sampling.shard_rows(epoch).tolist()

    def epoch_rows(self, epoch: int) -> int:
        """Rows (skipped ones too, replay utterances too) of ``epoch``, known before it is
        read."""
        return sum(self.shard_rows(epoch)) + (len(self.replay) if self.replay is not None else 0)

    def join_replay(self, split, utts, picks: np.ndarray) -> None:
        """``data.replay``: the replay utterances ``picks`` (into ``utts``, the usable ones of
        ``split``, checked in full) join every epoch, each once, their ids under ``replay/``."""
        drawn = ReplayUtterances([], utts, picks, row_offset=0)
        self.replay = SpeechDataset(split, drawn, self.features, self.eot)
        self.replay.replay_from = 0
        self.replay.language_after = self.language_after

    def batches_per_epoch(self, rank: int, world: int, epoch: int | None = None) -> int:
        """Batches rank ``rank`` of ``world`` takes in ``epoch`` (default the one :meth:`loader`
        last served: with ``data.sampling`` each epoch has its own length)."""
        rows = self.epoch_rows(self.epoch if epoch is None else epoch)
        return local_batches(rows, self.cfg.batch_size, rank, world)

    def loader(
        self,
        epoch: int,
        start_batch: int,
        *,
        rank: int,
        world: int,
        workers: int = 0,
        pin_memory: bool = False,
    ) -> Iterator[dict]:
        """The batches of ``epoch`` on this rank from its ``start_batch``-th on; a batch's
        skipped rows are in its ``dropped``/``dropped_reasons``, as a map-style split's.

        Raises:
            UserError: (while iterated) a row's language has no token, or a shard cannot be read.
        """
        self.epoch = epoch
        batches = _EpochBatches(self, epoch, start_batch, rank, world)
        loader = StopSignalLoader(
            batches,
            batch_size=None,  # each item is a collated batch
            num_workers=workers,
            persistent_workers=False,
            prefetch_factor=4 if workers else None,
            pin_memory=pin_memory,
            # a private generator: starting the loader must not draw from the global RNG
            # (dropout's), or a resumed run would see other dropout masks
            generator=torch.Generator().manual_seed(self.seed * 7919 + epoch),
            worker_init_fn=ignore_stop_signals,  # a SIGTERM is the training process's to handle
        )
        return _stopping(loader)

    # -- what a worker does ---------------------------------------------------------------------
    def batch(self, rows: list[tuple[dict, str] | int], epoch: int, position: dict) -> dict:
        """One collated batch of standardized rows ``(row, uid)`` and replay utterances (an
        index into :attr:`replay`): checked, decoded, featurized (as ``SpeechDataset`` does,
        augmentation included); skipped rows are dropped with their reasons."""
        utts, items, replayed = [], [], []
        for entry in rows:
            if isinstance(entry, int):  # a replay utterance, checked before step 1
                replayed.append(entry)
                continue
            row, uid = entry
            checked = check_row(row, uid, self.rules)
            if checked is None:  # left out by data.languages
                continue
            if isinstance(checked, str):
                if checked == NOT_FOUND:  # the id may not say which file (as prepare_split)
                    uid = named(uid, audio_source(row.get("audio")))
                items.append({"dropped": uid, "reason": checked})
                continue
            checked.row = len(utts)
            utts.append((checked, row))
        ds = SpeechDataset([r for _, r in utts], [u for u, _ in utts], self.features, self.eot)
        ds.augment, ds.epoch, ds.language_after = self.augment, epoch, self.language_after
        items += [ds[i] for i in range(len(utts))]
        if replayed:
            self.replay.augment, self.replay.epoch = self.augment, epoch
            items += [self.replay[q] for q in replayed]
        batch = Collator(pad_id=self.eot)(items)
        batch["stream_position"] = position
        return batch


class _EpochBatches(IterableDataset):
    """One rank's batches of one epoch, from ``start`` on; worker ``w`` of ``W`` yields the
    rank's batches ``start + w``, ``start + w + W``, ..."""

    def __init__(self, stream: StreamedSplit, epoch: int, start: int, rank: int, world: int):
        self.stream, self.epoch, self.start, self.rank, self.world = (
            stream,
            epoch,
            start,
            rank,
            world,
        )

    def __iter__(self) -> Iterator[dict]:
        s = self.stream
        info = get_worker_info()
        worker, n_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        shard_rows = s.shard_rows(self.epoch)
        size, total = s.cfg.batch_size, sum(shard_rows)
        blocks = epoch_blocks(len(s.shards), s.cfg.stream.shuffle_shards, s.seed, self.epoch)
        block_rows = [sum(shard_rows[i] for i in b) for b in blocks]
        n_replay = len(s.replay) if s.replay is not None else 0
        replayed = replay_blocks(n_replay, block_rows, s.seed, self.epoch)
        block_rows = [n + len(r) for n, r in zip(block_rows, replayed, strict=True)]
        total += n_replay
        block_first = np.cumsum([0, *block_rows])  # the epoch's row position each block starts at
        cache: dict[int, tuple] = {}  # block -> (its rows in read order, their tables)
        n_local = local_batches(total, size, self.rank, self.world)
        try:
            for i in range(self.start + worker, n_local, n_workers):
                j = i * self.world + self.rank  # the batch's number in the epoch
                lo, hi = j * size, min((j + 1) * size, total)
                rows = []
                for pos in range(lo, hi):
                    b = int(np.searchsorted(block_first, pos, side="right")) - 1
                    if b not in cache:
                        for old in [k for k in cache if k < b]:  # blocks are read in order
                            del cache[old]
                        cache[b] = self._load_block(blocks[b], b, replayed[b])
                    rows.append(self._row(cache[b], pos - int(block_first[b])))
                position = {"fingerprint": s.fingerprint, "epoch": self.epoch, "batch": j,
                            "rows_before": hi}  # fmt: skip
                yield s.batch(rows, self.epoch, position)
        except UserError as e:
            # A language without a token or a file gone bad stops the run.
            yield {"stop": str(e), "size": 0, "dropped": [], "dropped_reasons": []}

    def _load_block(self, shard_ids: list[int], b: int, replayed: np.ndarray) -> tuple:
        s = self.stream
        tables = [s.read_shard(i) for i in shard_ids]
        if s.sampling is None:
            index = [(k, r) for k, t in enumerate(tables) for r in range(len(t))]
        else:  # each row as many times as the epoch's draw says, copies side by side
            multilingual = s.rules.utterance.specials.multilingual
            index = [
                (k, int(r))
                for k, (i, t) in enumerate(zip(shard_ids, tables, strict=True))
                for r in np.repeat(
                    np.arange(len(t)),
                    s.sampling.multiplicity(self.epoch, i, _row_languages(t, multilingual)),
                )
            ]
        index += [(-1, int(q)) for q in replayed]  # replay utterances, read from s.replay
        order = block_order(len(index), s.seed, self.epoch, b)
        return [index[o] for o in order], tables, shard_ids

    def _row(self, block: tuple, k: int) -> tuple[dict, str] | int:
        """Row ``k`` (in read order) of a loaded block and its id, or a replay utterance's
        index."""
        rows, tables, shard_ids = block
        t, r = rows[k]
        if t < 0:
            return r
        row = tables[t][r]
        first = int(self.stream.first_rows[shard_ids[t]])  # the shard's first row in the split
        return row, row_id(row.get("id"), self.stream.split, first + r)


def _stopping(batches) -> Iterator[dict]:
    """``batches``, raising in the training process the error a worker met (a language without
    a token, a file gone bad), which it passes on as a ``stop`` batch."""
    for batch in batches:
        if "stop" in batch:
            raise UserError(batch["stop"])
        yield batch


def stream_eval_split(cfg: DataConfig):
    """The evaluation split of a streamed run: ``data.stream.eval_path``'s, else ``data.path``'s
    ``data.eval_split`` files (read as :func:`~asrforge.data.sources.load_source` reads them;
    the training files are not read).

    Raises:
        UserError: there is none.
    """
    path = cfg.stream.eval_path or cfg.path
    elsewhere = is_url(path) or hub_ref(path, "dataset") is not None
    if cfg.stream.eval_path is not None and not elsewhere and not Path(path).exists():
        # read_split would name it data.path, the field it is read as
        raise UserError(f"data.stream.eval_path: {path}: no such file or directory")
    if cfg.stream.eval_path is None and not elsewhere and not Path(path).is_dir():
        raise UserError(
            f"data.stream.eval_path: data.path {path} is one file, the training split; name the "
            f"evaluation split's data (data.stream.eval_path)"
        )
    # one file (or one saved Dataset) is the evaluation split; a directory's named split is read
    # alone, so the training files are never converted
    update = {"path": path}
    if cfg.stream.eval_path is not None and Path(path).is_file():
        update["subset"] = None  # one file is the split, whatever configuration data.path has
    return read_split(cfg.model_copy(update=update), cfg.eval_split, option="data.eval_split")
