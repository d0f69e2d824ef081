"""asrforge.io.small_files: the one reader of small files asrforge was handed, within bounds."""

from __future__ import annotations

import os

import pytest

from asrforge.errors import CheckpointCorruptError, UserError
from asrforge.io.small_files import MAX_JSON_DEPTH, parse_json, read_bytes, read_json

pytestmark = pytest.mark.fast


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / "manifest.json"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="a FIFO, not a regular file"):
        read_bytes(fifo, 100)
    with pytest.raises(CheckpointCorruptError, match=f"{fifo}: a FIFO, not a regular file"):
        read_json(fifo, error=CheckpointCorruptError)


def test_a_link_to_a_device_is_refused_unread(tmp_path):
    link = tmp_path / "config.json"
    link.symlink_to("/dev/zero")
    with pytest.raises(UserError, match=f"{link}: a character device, not a regular file"):
        read_json(link)


def test_a_directory_and_a_missing_file(tmp_path):
    with pytest.raises(UserError, match="a directory, not a regular file"):
        read_json(tmp_path)
    with pytest.raises(FileNotFoundError):
        read_json(tmp_path / "missing.json")


def test_a_file_over_its_limit_is_refused_unread(tmp_path):
    path = tmp_path / "big.json"
    path.write_text("[" + "1," * 600 + "1]")
    with pytest.raises(UserError, match=f"{path}: larger than 1000 bytes"):
        read_json(path, 1000)
    assert read_json(path, 2000)[:2] == [1, 1]


@pytest.mark.parametrize(
    "text, message",
    [
        ("[" * 100_000 + "]" * 100_000, "nested deeper than"),
        ('{"a": ' + "[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1) + "}", "deeper"),
        ('{"a": ', "not valid JSON"),
    ],
)
def test_bad_or_deep_json_is_a_value_error_not_a_recursion_error(tmp_path, text, message):
    with pytest.raises(ValueError, match=message):
        parse_json(text)
    path = tmp_path / "x.json"
    path.write_text(text)
    with pytest.raises(CheckpointCorruptError, match=f"{path}: .*{message}"):
        read_json(path, error=CheckpointCorruptError)


def test_json_as_deep_as_allowed_is_read():
    deep = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    expected: list = []
    for _ in range(MAX_JSON_DEPTH - 1):
        expected = [expected]
    assert parse_json(deep) == expected
    assert parse_json('{"a": [1, {"b": null}]}') == {"a": [1, {"b": None}]}
    assert parse_json("5") == 5


@pytest.mark.parametrize("handed", ["fifo", "device", "deep"])
def test_run_and_checkpoint_records_a_user_was_handed_are_read_within_bounds(tmp_path, handed):
    from asrforge.checkpoint.shards import weight_map
    from asrforge.matrix.claims import DONE, read_marker
    from asrforge.run_layout import TRAIN_STATE_FILE, recorded_selection

    def hand(path):
        if handed == "fifo":
            os.mkfifo(path)
        elif handed == "device":
            path.symlink_to("/dev/zero")
        else:
            path.write_text("[" * (MAX_JSON_DEPTH + 5) + "]" * (MAX_JSON_DEPTH + 5))

    hand(tmp_path / TRAIN_STATE_FILE)
    with pytest.raises(ValueError, match=TRAIN_STATE_FILE):
        recorded_selection(tmp_path)
    hand(tmp_path / "model.safetensors.index.json")
    # a FIFO or a device is no index file at all; deep JSON is a damaged one
    with pytest.raises(CheckpointCorruptError, match="has neither|not a safetensors index"):
        weight_map(tmp_path, "model")
    if handed == "deep":  # a marker that is a FIFO or a device is no regular file, so none
        hand(tmp_path / DONE)
        assert read_marker(tmp_path) == ("done", {})  # an unreadable marker, as a torn one
