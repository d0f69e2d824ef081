"""Log-mel caching: each utterance's features are computed once and read back every epoch.

How it works: docs/data.md, "The log-mel cache (`data/cache/features.py`)".
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import time
from pathlib import Path

import numpy as np

from asrforge.data.cache.files import NewDataFile, SharedData, remove_unused
from asrforge.errors import UserError
from asrforge.io.small_files import RECORDS_BYTES, read_json

log = logging.getLogger(__name__)

FORMAT_VERSION = 1


def trim(features: np.ndarray) -> tuple[np.ndarray, float]:
    """``(columns, fill)``: the leading columns of ``features`` (n_mels, n_frames) up to the last
    one that is not entirely ``fill``, where ``fill`` is the last column's value when that
    column is constant (otherwise nothing is trimmed)."""
    last = features[:, -1]
    fill = float(last[0])
    if not (last == last[0]).all():
        return features, fill
    constant = (features == last[0]).all(axis=0)
    n = features.shape[1]
    while n > 0 and constant[n - 1]:
        n -= 1
    return features[:, :n], fill


def untrim(columns: np.ndarray, fill: float, n_frames: int) -> np.ndarray:
    """The full (n_mels, n_frames) window that :func:`trim` took ``columns`` and ``fill`` from."""
    out = np.full((columns.shape[0], n_frames), fill, dtype=np.float32)
    out[:, : columns.shape[1]] = columns
    return out


def extractor_key(feature_extractor) -> str:
    """A hash of everything that determines the features: the extractor's settings (mel bins,
    window, hop, chunk length, sampling rate...) and this module's format version."""
    to_json = getattr(feature_extractor, "to_json_string", None)
    settings = to_json() if to_json is not None else repr(feature_extractor)
    return hashlib.sha256(f"v{FORMAT_VERSION}\n{settings}".encode()).hexdigest()[:20]


class _NothingAdded(Exception):
    """No utterance of a build decoded: its new data file is dropped."""


class FeatureCache:
    """Trimmed log-mel windows looked up by audio key (see docs/data.md, "The log-mel cache")."""

    def __init__(
        self, directory: Path, values: str, index: dict[str, list], n_mels: int, n_frames: int
    ):
        self.directory = Path(directory)
        self.values = values
        self.index = index
        self.n_mels, self.n_frames = n_mels, n_frames
        self.data = SharedData(self.directory / values, "f32")  # locked while this object reads

    def __contains__(self, key: str) -> bool:
        return key in self.index

    def __len__(self) -> int:
        return len(self.index)

    def features(self, key: str) -> np.ndarray:
        """The (n_mels, n_frames) float32 window of the utterance with audio key ``key``."""
        offset, n, fill = self.index[key]
        flat = self.data.array[offset : offset + self.n_mels * n]
        return untrim(np.asarray(flat).reshape(self.n_mels, n), fill, self.n_frames)

    @classmethod
    def open(cls, root: Path, feature_extractor, *, hold: bool = True) -> FeatureCache | None:
        """The cache for ``feature_extractor`` under ``root``, or None when none was built (or its
        data file is gone). ``hold``: open and share-lock the data file now, so no other run's
        build removes it while this process (and its DataLoader workers) may read it."""
        directory = Path(root) / extractor_key(feature_extractor)
        try:
            meta = read_json(directory / "index.json", RECORDS_BYTES, error=ValueError)
            cache = cls(directory, meta["values"], meta["rows"], meta["n_mels"], meta["n_frames"])
            if hold:
                cache.data.array  # noqa: B018 - opens and locks
        except (OSError, ValueError, KeyError) as e:
            if (directory / "index.json").is_file():
                log.warning("feature cache %s unusable (%s): starting it afresh", directory, e)
            return None
        return cache

    @classmethod
    def build(cls, root: Path, *datasets) -> FeatureCache:
        """Open the cache for the datasets' feature extractor under ``root``, computing the
        utterances it lacks, all datasets in one pass (clips that fail to decode are left out:
        reading them later fails the way it does without a cache). Returns it held
        (see :meth:`open`).

        Args:
            datasets: ``SpeechDataset`` s sharing one feature extractor (``utts`` with
                ``audio_key``, ``fe``, ``features_of``).
        """
        t0 = time.perf_counter()
        fe = datasets[0].fe
        if getattr(fe, "dither", 0.0):
            raise UserError(
                f"data.cache_features: the feature extractor dithers (dither={fe.dither}), so "
                "its features differ on every call and cannot be cached"
            )
        if len({extractor_key(ds.fe) for ds in datasets}) > 1:
            raise ValueError("FeatureCache.build: the datasets use different feature extractors")
        directory = Path(root) / extractor_key(fe)
        # The previous cache is held open so that its file cannot go while it is copied.
        have = cls.open(root, fe)
        index: dict[str, list] = dict(have.index) if have is not None else {}
        missing: dict[str, tuple] = {}
        for ds in datasets:
            for i, u in enumerate(ds.utts):
                if u.audio_key not in index:
                    missing.setdefault(u.audio_key, (ds, i))
        n_utts = sum(len(ds.utts) for ds in datasets)
        if not missing:
            log.info("feature cache: all %d utterances cached in %s", n_utts, directory)
            return have
        log.info("feature cache: computing %d utterances into %s", len(missing), directory)
        sources = [ds.feature_cache for ds in datasets]
        for ds in datasets:
            ds.feature_cache = None  # compute, do not read back
        shape, failed, added = None, 0, 0
        try:
            with NewDataFile(directory, "values", "f32") as new:
                with open(new.tmp, "wb") as out:
                    if have is not None:  # the previous rows first, their offsets unchanged
                        with open(have.data.path, "rb") as old:
                            shutil.copyfileobj(old, out, 16 << 20)
                    offset = out.tell() // 4
                    for key, (ds, i) in missing.items():
                        try:
                            feats = ds.features_of(i)
                        except Exception:  # noqa: BLE001 - an undecodable clip stays uncached
                            failed += 1
                            continue
                        shape = shape or feats.shape
                        if have is not None and (have.n_mels, have.n_frames) != shape:
                            raise RuntimeError(
                                f"feature cache {directory}: window {shape} differs from the "
                                "cached one"
                            )
                        columns, fill = trim(feats)
                        out.write(np.ascontiguousarray(columns, dtype=np.float32).tobytes())
                        index[key] = [offset, columns.shape[1], fill]
                        offset += columns.size
                        added += 1
                # With nothing decoded, the cache stays as it was.
                if not added:
                    raise _NothingAdded
                meta = {"values": new.name, "n_mels": shape[0], "n_frames": shape[1], "rows": index}
                new.publish(directory / "index.json", meta)
                cache = cls(directory, new.name, index, shape[0], shape[1])
                cache.data.array  # noqa: B018 - held before the writer's lock goes
        except _NothingAdded:
            return have
        finally:
            for ds, source in zip(datasets, sources, strict=True):
                ds.feature_cache = source
        if have is not None:
            have.data.close()
        removed = remove_unused(directory, "values-*.f32", keep=cache.values)
        log.info(
            "feature cache: %d utterances written in %.1f s (%.1f MB in all%s%s)",
            added,
            time.perf_counter() - t0,
            offset * 4 / 1e6,
            f"; {failed} failed to decode" if failed else "",
            f"; removed {len(removed)} unused data files" if removed else "",
        )
        return cache
