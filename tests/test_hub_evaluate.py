"""``asrforge evaluate MODEL --data google/fleurs --subset es_419 --split test``: a standard
benchmark in one command, model and data by Hub id from a cache this test builds (offline),
FLEURS' own columns (a sentence id shared by its speakers, the language by name) read as they
are. The process is the CLI's own, with ``HF_HUB_OFFLINE=1``: no network."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from asrforge.data.sources import load_arrow
from tests.hub_cache import add_repo, audio_parquet
from tests.test_hub_models import tiny_model  # noqa: F401 - a fixture

FLEURS_README = """---
configs:
- config_name: es_419
  data_files:
  - split: train
    path: es_419/train-*.parquet
  - split: test
    path: es_419/test-*.parquet
---
"""


def fleurs_rows(rows) -> list[dict]:
    """FLEURS' columns: a sentence id its speakers share, the language by its English name."""
    return [
        {"id": 1000 + k // 2, "num_samples": 16000, "path": f"{k}.wav",
         "audio": {"bytes": r["audio"]["bytes"], "path": f"{k}.wav"},
         "transcription": r["text"].lower(), "raw_transcription": r["text"], "gender": k % 2,
         "lang_id": 0, "language": "Spanish", "lang_group_id": 0}
        for k, r in enumerate(rows)
    ]  # fmt: skip


def test_evaluate_scores_fleurs_by_hub_id_from_the_cache(hf_home, tiny_model, tones_dir):  # noqa: F811
    spanish = [r for r in load_arrow(tones_dir)["train"] if r["language"] == "es"][:6]
    add_repo(hf_home, "org/tiny", {"": tiny_model})
    add_repo(hf_home, "google/fleurs", {"README.md": FLEURS_README,
             "es_419/test-00000-of-00001.parquet": audio_parquet(fleurs_rows(spanish))},
             repo_type="dataset")  # fmt: skip
    argv = ["evaluate", "org/tiny", "--data", "google/fleurs", "--subset", "es_419",
            "--split", "test", "--json", "--max-new-tokens", "4"]  # fmt: skip
    run = subprocess.run([sys.executable, "-m", "asrforge", *argv], capture_output=True,
                         text=True, env={**os.environ}, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr
    record = json.loads(run.stdout.strip().splitlines()[-1])
    assert (record["data"], record["split"], record["n"]) == ("google/fleurs", "test", 6)
    assert set(record["per_language"]) == {"es"}


def test_a_command_reads_the_files_of_the_commit_whose_card_it_read(
    hf_home,
    tiny_model,  # noqa: F811
    tones_dir,
    monkeypatch,
    capsys,
):
    """main moves between the data set's card and its files: the command reads both at the
    commit it read first."""
    import asrforge.hub as hub_module
    from asrforge.cli import main

    spanish = [r for r in load_arrow(tones_dir)["train"] if r["language"] == "es"][:6]
    add_repo(hf_home, "org/tiny", {"": tiny_model})
    files = {"README.md": FLEURS_README,
             "es_419/test-00000-of-00001.parquet": audio_parquet(fleurs_rows(spanish))}  # fmt: skip
    add_repo(hf_home, "google/fleurs", files, repo_type="dataset", commit="a" * 40)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    read = []
    snapshot = hub_module._snapshot

    def moving_main(ref, field, patterns, *where, commit=None):
        path = snapshot(ref, field, patterns, *where, commit=commit)
        read.append((ref.repo_id, path.name))
        # the data set's card was read: main moves on
        if ref.repo_id == "google/fleurs" and len(read) == 2:
            add_repo(hf_home, "google/fleurs", {"README.md": "no configurations now"},
                     repo_type="dataset", commit="b" * 40)  # fmt: skip
        return path

    monkeypatch.setattr(hub_module, "_snapshot", moving_main)
    argv = ["evaluate", "org/tiny", "--data", "google/fleurs", "--subset", "es_419",
            "--split", "test", "--json", "--max-new-tokens", "4"]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    assert [c for r, c in read if r == "google/fleurs"] == ["a" * 40, "a" * 40]
