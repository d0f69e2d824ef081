"""The checkpoints directory of a run: step checkpoints, ``latest``, ``best/``, top-k, rotation.

Its layout and rotation rules: docs/training.md, "The checkpoints directory
(`checkpoint/manager.py`)".
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import shutil
import time
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

from asrforge.checkpoint.average import default_mode, rank_checkpoints
from asrforge.checkpoint.disk import (
    GB,
    RESUME_ONLY_FILES,
    estimate_save_bytes,
    exclusive_bytes,
    format_gb,
    tree_bytes,
)
from asrforge.checkpoint.manifest import (
    MANIFEST_NAME,
    PRUNED_KEY,
    read_manifest,
    verify,
    write_manifest,
    write_pruned_manifest,
)
from asrforge.checkpoint.sharded import SHARDED_OPTIMIZER_DIR
from asrforge.checkpoint.training import CheckpointContents, save_training_checkpoint
from asrforge.config import CallbackSpec, TopKSpec
from asrforge.errors import CheckpointCorruptError, CheckpointSaveError, UserError
from asrforge.io.atomic import (
    atomic_directory,
    atomic_symlink,
    atomic_write_text,
    describe_os_error,
    fsync_dir,
    fsync_file,
    recover_interrupted,
    temp_sibling,
)
from asrforge.io.records import (
    COUNT,
    INTEGER,
    MAPPING,
    NUMBER,
    TEXT,
    list_of,
    optional,
    record_problems,
)
from asrforge.run_layout import BEST, CheckpointsLayout, damaged_name, step_dir_name

STATE_VERSION = 1

Payload = CheckpointContents | Callable[[Path], None]


def metric_dir_name(metric: str, rank: int) -> str:
    """``best-<metric>-<rank>``, the metric made filename-safe (``eval/wer`` -> ``eval_wer``)."""
    return f"best-{re.sub(r'[^A-Za-z0-9_.]', '_', metric)}-{rank}"


def link_tree(src: Path, dst: Path) -> None:
    """Make ``dst`` an exact image of the directory ``src``, atomically, with hard links where
    the filesystem allows (copies otherwise)."""
    # Linked files are the source's fsynced inodes: only copies need an fsync of their own.
    with atomic_directory(dst, fsync_files=False) as tmp:
        link_files(src, tmp)


def link_files(src: Path, dst: Path, exclude: Collection[str] = ()) -> None:
    """Hard-link (else copy and fsync) every file under ``src`` into the existing directory
    ``dst``, keeping relative paths; ``exclude``: POSIX relative paths to leave out."""
    for dirpath, _dirnames, filenames in os.walk(src):
        rel = Path(dirpath).relative_to(src)
        (dst / rel).mkdir(parents=True, exist_ok=True)
        for name in filenames:
            if (rel / name).as_posix() in exclude:
                continue
            try:
                os.link(Path(dirpath, name), dst / rel / name)
            except OSError:
                shutil.copy2(Path(dirpath, name), dst / rel / name)
                fsync_file(dst / rel / name)


def _manifest_bytes(directory: Path) -> bytes | None:
    try:
        return (directory / MANIFEST_NAME).read_bytes()
    except OSError:
        return None


def _json_metrics(metrics: Mapping[str, Any] | None) -> dict[str, Any]:
    out = {}
    for k, v in (metrics or {}).items():
        if hasattr(v, "item") and getattr(v, "ndim", 0) == 0:  # tensors, numpy scalars
            v = v.item()
        out[str(k)] = v if isinstance(v, bool | int | float | str | type(None)) else str(v)
    return out


AVERAGING_CALLBACK = "average_checkpoints"


def averaging_specs(callbacks: list[CallbackSpec]) -> list[TopKSpec]:
    """The top-k each configured ``average_checkpoints`` callback will average (its ``metric``,
    ``k`` and ``mode``, with the callback's defaults: wer, 5, :func:`default_mode`), so that
    rotation keeps those checkpoints until the average is written."""
    specs = []
    for spec in callbacks:
        if spec.name != AVERAGING_CALLBACK:
            continue
        opts = spec.options
        metric = str(opts.get("metric", "wer"))
        k = opts.get("k", 5)
        mode = opts.get("mode") or default_mode(metric)
        if isinstance(k, int) and k > 0 and mode in ("min", "max"):  # else the callback refuses
            specs.append(TopKSpec(metric=metric, k=k, mode=mode))
    return specs


def verify_quick(directory: Path) -> bool:
    """True when ``directory``'s files have the sizes its manifest lists."""
    try:
        verify(directory, check_hashes=False)
    except CheckpointCorruptError:
        return False
    return True


_STATE_KINDS = {
    "version": INTEGER, "best_step": optional(COUNT), "unguarded_step": optional(COUNT),
    "top_k": list_of(MAPPING),
}  # fmt: skip
_TOP_K_KINDS = {"metric": TEXT, "mode": TEXT, "entries": list_of(MAPPING)}
_ENTRY_KINDS = {"step": COUNT, "value": NUMBER}
"""What the manager's record in a checkpoint's manifest may hold, field by field."""


class CheckpointManager:
    """Saves step checkpoints under ``root`` and keeps ``latest``, ``best/`` and top-k current.

    Constructing one only reads. The process that writes (rank zero of the run) calls
    :meth:`recover` once before its first save: that cleans what a killed writer left (``.tmp-*``
    entries; an interrupted replacement of ``best/`` is rolled back). Observers — a report, an
    export, a test polling a live run — must not call it: they would delete the running writer's
    half-written checkpoint.

    Args:
        root: the checkpoints directory (``output_dir/checkpoints``).
        save_total_limit: keep at most this many ``step-*`` directories besides the best and
            top-k sources; None keeps all.
        keep_best: top-k specs; each keeps ``best-<metric>-<rank>/`` directories.
        protect_top: top-k rankings (by the manifests' metrics, as :func:`rank_checkpoints`
            ranks them) whose members rotation keeps, without directories of their own: what
            checkpoint averaging will read (:func:`averaging_specs`).
        keep_start: keep ``step-000000/`` through rotation and :meth:`prune_after_run`
            (``TrainConfig.keeps_step_zero``: an export within the guard reads the start there).
        log: where recoveries, skipped corrupt checkpoints and saves are reported.
    """

    def __init__(
        self,
        root: Path,
        *,
        save_total_limit: int | None = None,
        keep_best: list[TopKSpec] | None = None,
        protect_top: list[TopKSpec] | None = None,
        max_disk_gb: float | None = None,
        keep_start: bool = False,
        log: logging.Logger | None = None,
    ):
        self.root = Path(root)
        self.keep_start = keep_start
        self.layout = CheckpointsLayout(self.root)
        self.save_total_limit = save_total_limit
        self.specs = list(keep_best or [])
        self.protect_top = list(protect_top or [])
        self.max_disk_gb = max_disk_gb
        self.log = log or logging.getLogger(__name__)
        names = [metric_dir_name(s.metric, 1) for s in self.specs]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise UserError(f"checkpoint.keep_best: a metric is listed twice ({', '.join(dup)})")
        if save_total_limit is not None and save_total_limit < 1:
            raise UserError(f"checkpoint.save_total_limit: must be >= 1, got {save_total_limit}")
        if max_disk_gb is not None and not max_disk_gb > 0:
            raise UserError(f"checkpoint.max_disk_gb: must be > 0, got {max_disk_gb}")
        self.best_step: int | None = None
        self.unguarded_step: int | None = None
        """The step ``best-unguarded/`` holds: the best one the forgetting guard refused."""
        self._kept_corrupt: set[str] = set()
        self._written: set[str] = set()
        """The step directories this manager saved (the others a save replaces are verified)."""
        self.top_k: dict[str, list[dict[str, Any]]] = {s.metric: [] for s in self.specs}

    def recover(self) -> CheckpointManager:
        """Create the directory and undo what a killed writer left; for the one writing process.

        Raises:
            CheckpointSaveError: the directory cannot be created or cleaned.
        """
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            for action in recover_interrupted(self.root):
                self.log.warning("checkpoints: %s", action)
        except OSError as e:
            raise CheckpointSaveError(
                f"cannot prepare the checkpoints directory {self.root}: {describe_os_error(e)}"
            ) from e
        return self

    # -- queries ----------------------------------------------------------------------------

    def step_dirs(self) -> list[tuple[int, Path]]:
        """``(step, path)`` of every ``step-*`` directory, oldest first."""
        return self.layout.steps()

    def latest(self) -> Path | None:
        """Where ``latest`` points (no verification); None before the first save."""
        return self.layout.latest()

    def latest_valid(self, *, check_hashes: bool = True) -> Path | None:
        """The newest ``step-*`` directory whose manifest verifies; a newer corrupt or
        incomplete one is logged (with the reason) and skipped. None when there is none."""
        for _step, path in reversed(self.step_dirs()):
            try:
                verify(path, check_hashes=check_hashes)
            except CheckpointCorruptError as e:
                self.log.warning("checkpoints: skipping %s, it does not verify: %s", path.name, e)
                continue
            return path
        return None

    def protected_steps(self) -> set[int]:
        """Steps rotation must not delete: the best one, the best one the guard refused, every
        top-k member of a ``keep_best`` spec, and the first ``k`` of each ``protect_top``
        ranking.

        Raises:
            CheckpointCorruptError: a manifest the ranking reads is damaged or edited.
        """
        steps = {e["step"] for entries in self.top_k.values() for e in entries}
        steps.update(s for s in (self.best_step, self.unguarded_step) if s is not None)
        if self.keep_start:
            steps.add(0)
        for spec in self.protect_top:
            ranked = rank_checkpoints(self.root, spec.metric, spec.mode)
            steps.update(step for _value, step, _dir in ranked[: spec.k])
        return steps

    # -- state --------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The best step, the best step the guard refused and the top-k entries, JSON-able."""
        return {
            "version": STATE_VERSION,
            "best_step": self.best_step,
            "unguarded_step": self.unguarded_step,
            "top_k": [
                {
                    "metric": s.metric,
                    "mode": s.mode,
                    "entries": [dict(e) for e in self.top_k[s.metric]],
                }
                for s in self.specs
            ],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`. Entries of specs no longer configured are dropped; a
        spec whose ``k`` shrank keeps its best ``k``; a changed ``mode`` starts empty.

        Raises:
            ValueError: a field is not of its kind (a damaged or altered manifest), by name.
        """
        problems = record_problems(state, _STATE_KINDS, "checkpoint_manager")
        for i, top in enumerate(state.get("top_k", []) if not problems else []):
            problems += record_problems(top, _TOP_K_KINDS, f"checkpoint_manager.top_k.{i}",
                                        ("metric", "mode", "entries"))  # fmt: skip
            for j, entry in enumerate(top.get("entries", []) if not problems else []):
                where = f"checkpoint_manager.top_k.{i}.entries.{j}"
                problems += record_problems(entry, _ENTRY_KINDS, where, ("step", "value"))
        if problems:
            raise ValueError("; ".join(problems))
        if state.get("version", STATE_VERSION) > STATE_VERSION:
            raise UserError(f"checkpoint manager state version {state['version']} is too new")
        self.best_step = state.get("best_step")
        self.unguarded_step = state.get("unguarded_step")
        saved = {(t["metric"], t["mode"]): t["entries"] for t in state.get("top_k", [])}
        for s in self.specs:
            entries = [dict(e) for e in saved.get((s.metric, s.mode), [])]
            self.top_k[s.metric] = self._ranked(s, entries)[: s.k]

    def _ranked(self, spec: TopKSpec, entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
        sign = 1.0 if spec.mode == "min" else -1.0
        # On a tie the earlier step wins.
        return sorted(entries, key=lambda e: (sign * e["value"], e["step"]))

    def _next_state(
        self, step: int, metrics: dict[str, Any], is_best: bool, unguarded_step: int | None
    ) -> dict[str, Any]:
        state = self.state_dict()
        if is_best:
            state["best_step"] = step
        state["unguarded_step"] = unguarded_step
        for spec, rec in zip(self.specs, state["top_k"], strict=True):
            entries = [e for e in rec["entries"] if e["step"] != step]
            value = metrics.get(spec.metric)
            if (
                isinstance(value, int | float)
                and not isinstance(value, bool)
                and math.isfinite(value)
            ):
                entries.append({"step": step, "value": float(value)})
            rec["entries"] = self._ranked(spec, entries)[: spec.k]
        return state

    # -- saving -------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        payload: Payload,
        metrics: Mapping[str, Any] | None = None,
        is_best: bool = False,
        unguarded_step: int | None = None,
    ) -> Path:
        """Write ``step-NNNNNN/``, then update ``latest``, ``best/``, top-k, then rotate.

        Args:
            step: the optimizer step (names the directory).
            payload: what the checkpoint holds (its ``meta`` is merged into the manifest), or a
                function that fills a directory (the manager adds atomicity and the manifest).
            metrics: the evaluation's metrics, e.g. ``{"wer": 0.21, "loss": 1.3}``; stored in the
                manifest and used for top-k (non-finite values never enter a top-k).
            is_best: the selection policy chose this checkpoint: it becomes ``best/``.
            unguarded_step: the step ``best-unguarded/`` holds (this one or an earlier saved
                one): the best the forgetting guard alone refused (None: no such step).

        Returns:
            The step directory.

        Raises:
            CheckpointSaveError: the save failed, or would not fit in ``max_disk_gb`` (refused
                before anything was written); every earlier checkpoint is intact. (When only
                updating ``best``/top-k fails, the step directory itself is complete.)
        """
        t0 = time.perf_counter()
        final = self.layout.step(step)
        metrics = _json_metrics(metrics)
        state = self._next_state(step, metrics, is_best, unguarded_step)
        if self.max_disk_gb is not None:
            self._make_room(step, payload)
        if final.name not in self._written and (final.exists() or final.is_symlink()):
            self._keep_if_damaged(final)
        meta = {"step": step, "metrics": metrics, "is_best": is_best, "checkpoint_manager": state}
        if unguarded_step == step:
            meta["is_best_unguarded"] = True
        if callable(payload):
            with atomic_directory(final) as tmp:
                payload(tmp)
                write_manifest(tmp, meta)
        else:
            meta = {**(payload.meta or {}), **meta}
            save_training_checkpoint(final, dataclasses.replace(payload, meta=meta))
        self._written.add(final.name)
        self.load_state_dict(state)
        self._point_latest(final)
        self._sync_best_dirs()
        self._rotate(keep=step)
        self.log.info("checkpoints: saved %s in %.2f s", final.name, time.perf_counter() - t0)
        return final

    def _keep_if_damaged(self, path: Path) -> None:
        """Move ``path``, a step directory a save is about to replace, aside when it does not
        verify (a resume passed it by): it is kept for inspection, as rotation keeps one."""
        try:
            verify(path)
            return
        except CheckpointCorruptError as e:
            why = e
        aside = damaged_name(path, time.strftime("%Y%m%d-%H%M%S"))
        try:
            os.rename(path, aside)
        except OSError as e:
            raise CheckpointSaveError(
                f"cannot move the damaged {path} aside before saving its step again: "
                f"{describe_os_error(e)}"
            ) from e
        self.log.warning(
            "checkpoints: %s does not verify (%s); kept as %s, and the step is saved anew",
            path.name, why, aside.name,
        )  # fmt: skip

    def _point_latest(self, final: Path) -> None:
        try:
            atomic_symlink(self.layout.latest_link, final.name)
        except CheckpointSaveError:  # no symlinks here (some network filesystems)
            atomic_write_text(self.layout.latest_txt, final.name + "\n")

    def _source_for(self, step: int) -> Path | None:
        """A complete directory holding ``step``: its step dir, else a best dir that has it."""
        path = self.layout.step(step)
        if path.is_dir():
            return path
        for p in sorted(self.root.glob("best*")):
            try:
                if p.is_dir() and verify(p, check_hashes=False).get("step") == step:
                    return p
            except CheckpointCorruptError:
                continue
        return None

    def _make_image(self, dst: Path, step: int) -> None:
        src = self._source_for(step)
        if src is None:
            self.log.warning(
                "checkpoints: no directory holds step %d any more; %s kept", step, dst.name
            )
            return
        if src == dst or (_manifest_bytes(src) == _manifest_bytes(dst) and verify_quick(dst)):
            return
        link_tree(src, dst)

    def _sync_best_dirs(self) -> None:
        """Make ``best/``, ``best-unguarded/`` and every ``best-<metric>-<rank>/`` hold what
        the state says."""
        if self.best_step is not None:
            self._make_image(self.layout.best, self.best_step)
        unguarded = self.layout.best_unguarded
        if self.unguarded_step is not None:
            self._make_image(unguarded, self.unguarded_step)
        elif unguarded.is_dir():
            # A step within the guard beat the refused one, so best/ holds the better one.
            self._delete(unguarded)
        for spec in self.specs:
            entries = self.top_k[spec.metric]
            # Worst rank first: entries only move down when a new one enters, so each source
            # rank directory is still intact when it is copied one rank down.
            for rank in range(len(entries), 0, -1):
                self._make_image(
                    self.root / metric_dir_name(spec.metric, rank), entries[rank - 1]["step"]
                )
            rank = len(entries) + 1
            while (stale := self.root / metric_dir_name(spec.metric, rank)).exists():
                self._delete(stale)
                rank += 1

    def _rotate(self, keep: int) -> None:
        if self.save_total_limit is None:
            return
        try:
            protected = self.protected_steps()
        except CheckpointCorruptError as e:
            # When the top-k steps cannot be known, nothing is deleted.
            self.log.warning("checkpoints: nothing rotated out: %s", e)
            return
        latest = self.latest()
        counted = []
        for s, p in self.step_dirs():
            if s in protected:
                continue
            # A checkpoint that does not verify is evidence of what went wrong, so it is never
            # rotated away.
            if not verify_quick(p):
                if p.name not in self._kept_corrupt:
                    self._kept_corrupt.add(p.name)
                    self.log.warning(
                        "checkpoints: %s does not verify; kept for inspection (rotation never "
                        "deletes it, nor counts it against save_total_limit)",
                        p.name,
                    )
                continue
            counted.append((s, p))
        excess = len(counted) - self.save_total_limit
        for s, p in counted:
            if excess <= 0:
                break
            if s == keep or (latest is not None and p.name == latest.name):
                continue
            self._delete(p)
            excess -= 1
            self.log.info("checkpoints: rotated out %s", p.name)

    # -- disk budget and the end of a run ------------------------------------------------------

    def disk_bytes(self) -> int:
        """Bytes the directory holds (hard-linked files counted once)."""
        return tree_bytes(self.root) if self.root.is_dir() else 0

    def _expected_bytes(self, payload: Payload) -> int:
        """The size of the next checkpoint: estimated from the tensors to save, and at least
        the size of the newest one (same model, same optimizer)."""
        estimate = 0 if callable(payload) else estimate_save_bytes(payload)
        # Optimizer shards every process wrote already (fsdp) are on disk: they move in.
        staged = 0
        if not callable(payload) and payload.optimizer_dir is not None:
            staged = tree_bytes(payload.optimizer_dir)
        dirs = self.step_dirs()
        return max(estimate, tree_bytes(dirs[-1][1]) - staged if dirs else 0)

    def _disposable(self, step: int) -> list[tuple[int, Path]]:
        """Step directories rotation may delete to make room, oldest first: not the best or a
        top-k source, not ``latest`` (the one intact checkpoint should this save fail), not
        ``step`` itself, not one that does not verify (kept for inspection)."""
        try:
            protected = self.protected_steps()
        except CheckpointCorruptError as e:
            self.log.warning("checkpoints: nothing can be rotated out to make room: %s", e)
            return []
        latest = self.latest()
        return [
            (s, p)
            for s, p in self.step_dirs()
            if s not in protected
            and s != step
            and (latest is None or p.name != latest.name)
            and verify_quick(p)
        ]

    def _make_room(self, step: int, payload: Payload) -> None:
        """Delete the oldest disposable step directories until the next save fits in
        ``max_disk_gb``; when it cannot fit even then, refuse before deleting anything."""
        budget = int(self.max_disk_gb * GB)
        need = self._expected_bytes(payload)
        used = self.disk_bytes()
        if used + need <= budget:
            return
        candidates = self._disposable(step)
        freeable = exclusive_bytes(self.root)
        can_free = sum(freeable.get(p.name, 0) for _s, p in candidates)
        if used - can_free + need > budget:
            raise CheckpointSaveError(
                f"checkpoint.max_disk_gb: saving {step_dir_name(step)} needs about "
                f"{format_gb(need)}; {self.root} holds {format_gb(used)} of its "
                f"{format_gb(budget)} budget (checkpoint.max_disk_gb={self.max_disk_gb:g}) "
                f"and rotation may free only {format_gb(can_free)} "
                "(the latest, best and top-k checkpoints are kept). Nothing was written or "
                "deleted. Raise checkpoint.max_disk_gb to at least "
                f"{_rounded_up((used - can_free + need) / GB)} (what is kept and "
                "this save: with the best and the latest apart, three checkpoints), or keep "
                "fewer (checkpoint.keep_best, average_checkpoints k)"
            )
        for _s, p in candidates:
            if used + need <= budget:
                break
            self._delete(p)
            used -= freeable.get(p.name, 0)
            self.log.info(
                "checkpoints: rotated out %s to keep within checkpoint.max_disk_gb=%g",
                p.name,
                self.max_disk_gb,
            )

    def pruned_result(self) -> Path | None:
        """The directory :meth:`prune_after_run` kept (``best/``, else the final step), when
        the run was pruned; None otherwise."""
        latest = self.latest()
        for d in (self.layout.best, latest):
            if d is not None and (d / MANIFEST_NAME).is_file():
                try:
                    if PRUNED_KEY in read_manifest(d):
                        return d
                except CheckpointCorruptError:
                    continue
        return None

    def prune_after_run(self, *, keep_latest: bool = False) -> list[str]:
        """``checkpoint.after_run: best``: keep ``best/`` (else the final step directory) and
        the ``best-<metric>-<rank>/`` directories without their resume-only files
        (:data:`RESUME_ONLY_FILES`), delete every other step directory and ``latest``.
        ``keep_latest``: keep the final step directory beside ``best/`` too (no evaluation
        judged it). With ``keep_start``, ``step-000000/`` is kept as ``best/`` is, unless
        ``best/`` holds step 0.
        Directories that are not checkpoints of this manager (averages) are left alone.

        Each kept directory is rebuilt atomically (hard links, a new sealed manifest that lists
        what was removed) before anything is deleted; when one cannot be read, nothing is
        pruned. Returns one line per action, for the log.
        """
        latest = self.latest()
        kept = [
            p
            for p in sorted(self.root.iterdir())
            if p.is_dir()
            and not p.is_symlink()
            and (p.name == BEST or p.name.startswith(f"{BEST}-"))
        ]
        # no evaluation chose a best, or none judged the final weights: they are a result
        no_best = not self.layout.best.is_dir()
        if (no_best or keep_latest) and latest is not None and latest.is_dir():
            kept.append(latest)
        start = self.layout.step(0)
        add_start = (
            self.keep_start and start.is_dir() and not start.is_symlink() and start not in kept
        )
        if add_start:
            kept.append(start)
        try:
            manifests = {d: verify(d, check_hashes=False) for d in kept}
        except CheckpointCorruptError as e:
            self.log.warning(
                "checkpoints: not pruned after the run, a kept directory is bad: %s", e
            )
            return []
        # best/ holding the start keeps it for the export within the guard on its own
        if add_start and manifests.get(self.layout.best, {}).get("step") == 0:
            del manifests[start]
            kept.remove(start)
        actions = []
        before = self.disk_bytes()
        for d, manifest in manifests.items():
            files = manifest["files"]
            removed = [f for f in RESUME_ONLY_FILES if f in files]
            removed += [f for f in files if f.startswith(f"{SHARDED_OPTIMIZER_DIR}/")]
            if not removed:
                continue
            try:
                with atomic_directory(d, fsync_files=False) as tmp:
                    link_files(d, tmp, exclude={*removed, MANIFEST_NAME})
                    write_pruned_manifest(tmp, manifest, removed)
            except CheckpointSaveError as e:
                # The run itself succeeded, so a failed clean-up keeps everything.
                self.log.warning("checkpoints: not pruned after the run: %s", e)
                return actions
            actions.append(f"kept {d.name} without {', '.join(removed)}")
        for _s, p in self.step_dirs():
            if p in kept:
                continue
            if not verify_quick(p):
                actions.append(f"kept {p.name}: it does not verify (for inspection)")
                continue
            self._delete(p)
            actions.append(f"deleted {p.name}")
        if latest is None or latest not in kept:
            for link in (self.layout.latest_link, self.layout.latest_txt):
                if link.is_symlink() or link.is_file():
                    link.unlink()
        fsync_dir(self.root)
        actions.append(
            f"{format_gb(before)} -> {format_gb(self.disk_bytes())} (checkpoint.after_run: best)"
        )
        for line in actions:
            self.log.info("checkpoints after the run: %s", line)
        return actions

    def _delete(self, path: Path) -> None:
        """Rename to a ``.tmp-`` name first, so a half-deleted directory never looks real."""
        doomed = temp_sibling(path)
        try:
            os.rename(path, doomed)
            fsync_dir(path.parent)
        except OSError as e:
            self.log.warning("checkpoints: could not delete %s: %s", path, describe_os_error(e))
            return
        shutil.rmtree(doomed, ignore_errors=True)


def _rounded_up(x: float) -> str:
    """``x`` > 0 rounded up to three significant digits, written without an exponent (a
    budget to give in the config: ``0.000203``, ``1235``)."""
    digits = max(0, 2 - math.floor(math.log10(x)))
    return f"{math.ceil(x * 10**digits) / 10**digits:.{digits}f}"
