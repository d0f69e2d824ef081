"""Who runs which job: per-job locks and claim records, result markers, the event log.

How it works: docs/matrix.md, "Claims, locks and markers (`matrix/claims.py`)".
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from asrforge.errors import UserError
from asrforge.io.append import APPEND, open_no_follow
from asrforge.io.atomic import atomic_write_text
from asrforge.io.locks import LOCKING_UNSUPPORTED, try_lock, unlock
from asrforge.io.records import (
    COUNT,
    MAPPING,
    NUMBER,
    TEXT,
    list_of,
    optional,
    record_problems,
)
from asrforge.io.small_files import RECORDS_BYTES, read_json

log = logging.getLogger("asrforge.matrix")

DONE, FAILED = "DONE", "FAILED"
ClaimRefusal = Literal["done", "failed", "held"]


_MARKER_KINDS = {
    "attempts": optional(COUNT), "duration_s": optional(NUMBER), "status": optional(TEXT),
    "reason": optional(TEXT), "log_tail": optional(TEXT), "best": optional(MAPPING),
    "best_step": optional(COUNT), "step": optional(COUNT), "history": optional(list_of(MAPPING)),
}  # fmt: skip
"""The fields of a DONE or FAILED marker the launcher, the search and the report read."""


def read_marker(run_dir: Path) -> tuple[str, dict[str, Any]] | None:
    """``("done" | "failed", summary)`` when the job has a result marker, else None.

    Raises:
        UserError: the marker is JSON with a field of the wrong kind (an altered file), named.
    """
    for name in (DONE, FAILED):
        p = run_dir / name
        if p.is_file():
            try:
                summary = read_json(p, RECORDS_BYTES, error=ValueError)
            except (OSError, ValueError):
                return name.lower(), {}
            problems = record_problems(summary, _MARKER_KINDS)
            if problems:
                raise UserError(f"{p}: {'; '.join(problems)}")
            return name.lower(), summary
    return None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def lock_is_held(lock: Path) -> bool | None:
    """Whether someone holds ``lock`` (a job's lock file) now; None where ``flock`` does not
    work. Takes and drops a shared lock, writes nothing."""
    try:
        # non-blocking: a FIFO in a handed root's claims/ is never waited on
        fd = os.open(lock, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except FileNotFoundError:
        return False
    try:
        return not try_lock(fd, shared=True)
    except OSError:
        return None
    finally:
        os.close(fd)  # closing drops a lock we took


@dataclass
class Claim:
    """A job this launcher owns until :meth:`release`."""

    job_id: str
    lock_fd: int
    record: Path
    locked: bool
    """False where the filesystem refused ``flock`` (the record alone guards the job)."""

    def release(self) -> None:
        """Delete the record, then drop the lock (in this order: see the module doc)."""
        try:
            self.record.unlink()
        except FileNotFoundError:
            pass
        if self.locked:
            unlock(self.lock_fd)
        os.close(self.lock_fd)


class Claims:
    """Claims and markers of one matrix root, for one launcher.

    Args:
        root: the matrix root.
        launcher: this launcher's name in records and events (default ``host:pid``).
    """

    def __init__(self, root: Path, launcher: str | None = None):
        self.root = Path(root)
        self.dir = self.root / "claims"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.host = socket.gethostname()
        self.launcher = launcher or f"{self.host}:{os.getpid()}"

    def try_claim(self, job_id: str, run_dir: Path, device: str, *,
                  retry_failed: bool = False) -> Claim | ClaimRefusal:
        """Claim ``job_id`` for ``device``; else say why not: ``done``, ``failed`` (a FAILED
        marker and not ``retry_failed``) or ``held`` (another live launcher has it)."""
        refusal = self._finished(run_dir, retry_failed)
        if refusal:
            return refusal
        lock = self.dir / f"{job_id}.lock"
        record = self.dir / f"{job_id}.claim"
        fd = open_no_follow(lock, os.O_RDWR | os.O_CREAT)
        locked = True
        try:
            if not try_lock(fd):
                os.close(fd)
                return "held"
        except OSError as e:
            if e.errno not in LOCKING_UNSUPPORTED:
                os.close(fd)
                raise
            locked = False
        claim = Claim(job_id, fd, record, locked)
        old = self._read_record(record)
        if old is not None:
            if not locked and not self._stale_without_lock(old):
                os.close(fd)
                return "held"
            log.warning("%s: stale claim by %s (pid %s) removed: its launcher is gone",
                        job_id, old.get("launcher"), old.get("pid"))
            self.event("stale_claim", job_id, previous=old.get("launcher"))
            record.unlink(missing_ok=True)
        refusal = self._finished(run_dir, retry_failed)  # finished while we were locking?
        if refusal:
            claim.release()
            return refusal
        try:
            rfd = os.open(record, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            # Without a working flock another launcher may have been faster.
            os.close(fd)
            return "held"
        body = {"job_id": job_id, "launcher": self.launcher, "host": self.host,
                "pid": os.getpid(), "device": device, "time": time.time()}
        with os.fdopen(rfd, "w") as f:
            f.write(json.dumps(body) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if retry_failed:
            (run_dir / FAILED).unlink(missing_ok=True)
        self.event("claim", job_id, device=device)
        return claim

    def is_running(self, job_id: str) -> bool:
        """Somebody holds the job's lock right now (a launcher, or a job it left running)."""
        held = lock_is_held(self.dir / f"{job_id}.lock")
        if held is None:
            record = self._read_record(self.dir / f"{job_id}.claim")
            return record is not None and not self._stale_without_lock(record)
        return held

    def finish(self, claim: Claim, run_dir: Path, status: Literal["done", "failed"],
               summary: dict[str, Any]) -> None:
        """Write the DONE or FAILED marker, log the event, release the claim."""
        run_dir.mkdir(parents=True, exist_ok=True)  # an attempt may die before creating it
        atomic_write_text(run_dir / (DONE if status == "done" else FAILED),
                          json.dumps(summary, indent=1, default=str) + "\n")
        self.event(status, claim.job_id, **{k: summary.get(k) for k in ("attempts", "duration_s")})
        claim.release()

    def event(self, event: str, job_id: str, **fields: Any) -> None:
        """Append one line to ``events.jsonl`` (one ``write`` on an O_APPEND file: lines of
        concurrent launchers do not interleave)."""
        line = json.dumps({"time": time.time(), "event": event, "job_id": job_id,
                           "launcher": self.launcher, **fields}, default=str) + "\n"
        fd = open_no_follow(self.root / "events.jsonl", APPEND)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)

    @staticmethod
    def _finished(run_dir: Path, retry_failed: bool) -> ClaimRefusal | None:
        marker = read_marker(run_dir)
        if marker is None or (marker[0] == "failed" and retry_failed):
            return None
        return marker[0]  # type: ignore[return-value]

    @staticmethod
    def _read_record(record: Path) -> dict[str, Any] | None:
        try:
            return read_json(record, RECORDS_BYTES, error=ValueError)
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            # A record half-written by a launcher that died is stale.
            return {}

    def _stale_without_lock(self, record: dict[str, Any]) -> bool:
        if not record:
            # An unreadable record's writer died half-way.
            return True
        if record.get("host") != self.host:
            # Another host's processes cannot be seen, so its record is taken as live.
            return False
        pid = record.get("pid")
        return not isinstance(pid, int) or not pid_alive(pid)
