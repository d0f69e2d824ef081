"""asrforge.io.locks: the one place that calls flock, for the caches and the matrix."""

from __future__ import annotations

import errno
import fcntl
import os
import types

import pytest

from asrforge.io import locks
from asrforge.io.locks import LOCKING_UNSUPPORTED, exclusive, hold_shared, try_lock, unlock

pytestmark = pytest.mark.fast


def _open(path) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT)


def test_try_lock_sees_other_open_files_locks(tmp_path):
    path = tmp_path / "f"
    first, second = _open(path), _open(path)
    try:
        assert try_lock(first) is True
        assert try_lock(second) is False  # another open file description holds it
        assert try_lock(second, shared=True) is False
        unlock(first)
        assert try_lock(second, shared=True) is True
        assert try_lock(first, shared=True) is True  # shared locks coexist
        assert try_lock(first) is False  # no exclusive lock while another shares the file
        unlock(second)
        assert try_lock(first) is True
    finally:
        os.close(first)
        os.close(second)


def test_a_shared_holder_keeps_writers_out_until_it_closes(tmp_path):
    path = tmp_path / "data"
    path.touch()
    fd = hold_shared(path)
    other = _open(path)
    try:
        assert try_lock(other) is False
        os.close(fd)  # closing drops the lock
        assert try_lock(other) is True
    finally:
        os.close(other)


def test_exclusive_holds_the_lock_file_for_the_block_only(tmp_path):
    lock_file = tmp_path / "data.lock"
    with exclusive(lock_file):
        fd = _open(lock_file)
        assert try_lock(fd, shared=True) is False
        os.close(fd)
    fd = _open(lock_file)
    assert try_lock(fd) is True
    os.close(fd)


@pytest.fixture
def no_flock(monkeypatch):
    """A filesystem that cannot lock (some network and FUSE filesystems)."""

    def flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(locks, "fcntl", types.SimpleNamespace(**{**vars(fcntl), "flock": flock}))


def test_without_flock_the_matrix_claims_by_record_and_the_cache_keeps_files(tmp_path, no_flock):
    from asrforge.data.cache.files import remove_unused
    from asrforge.matrix.claims import Claims, lock_is_held

    claims = Claims(tmp_path / "matrix", launcher="a")
    claim = claims.try_claim("job", tmp_path / "matrix" / "runs" / "job", "cpu:0")
    assert not isinstance(claim, str) and claim.locked is False
    assert lock_is_held(tmp_path / "matrix" / "claims" / "job.lock") is None  # cannot tell
    assert (
        Claims(tmp_path / "matrix", launcher="b").try_claim(
            "job", tmp_path / "matrix" / "runs" / "job", "cpu:1"
        )
        == "held"
    )  # the record guards the job
    claim.release()

    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "values-old.f32").touch()
    assert remove_unused(tmp_path / "cache", "values-*.f32", keep="values-new.f32") == []
    assert errno.ENOLCK in LOCKING_UNSUPPORTED
