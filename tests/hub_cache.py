"""A Hugging Face Hub cache built on disk as ``huggingface_hub`` lays it out (``blobs/``,
``snapshots/<commit>/`` of symlinks into them, ``refs/<branch>``, and ``trees/<commit>.json``,
the listing of each commit it keeps once it downloaded one), and a stand-in Hub endpoint on
127.0.0.1 that answers every request with one error: tests resolve ids through the real
``huggingface_hub`` code and never reach a network."""

from __future__ import annotations

import hashlib
import io
import json
import os
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import numpy as np


def add_repo(
    hf_home: Path,
    repo_id: str,
    files: dict[str, bytes | str | Path],
    *,
    repo_type: str = "model",
    commit: str | None = None,
    ref: str = "main",
) -> Path:
    """Put ``files`` (path in the repository -> bytes, text, or a file or directory to copy) in
    the cache under ``hf_home`` as commit ``commit`` (default: a hash of the files) that ``ref``
    points at; returns the snapshot directory."""
    expanded: dict[str, bytes] = {}
    for name, content in files.items():
        if isinstance(content, Path) and content.is_dir():
            for f in sorted(content.rglob("*")):
                if f.is_file():
                    expanded[f"{name}/{f.relative_to(content)}".lstrip("/")] = f.read_bytes()
        elif isinstance(content, Path):
            expanded[name] = content.read_bytes()
        else:
            expanded[name] = content.encode() if isinstance(content, str) else content
    if commit is None:
        digest = hashlib.sha1()
        for name in sorted(expanded):
            digest.update(name.encode() + hashlib.sha1(expanded[name]).digest())
        commit = digest.hexdigest()
    repo = hf_home / "hub" / f"{repo_type}s--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    for name, data in expanded.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    _add_to_listing(repo / "trees" / f"{commit}.json", expanded)
    return snapshot


def _add_to_listing(path: Path, files: dict[str, bytes]) -> None:
    """Add ``files`` to the commit's tree listing, in ``huggingface_hub``'s format (version 1:
    each file's size and git blob id), with which a cached commit needs no request."""
    listing = json.loads(path.read_text()) if path.is_file() else {"format_version": 1, "files": {}}
    for name, data in files.items():
        blob_id = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        listing["files"][name] = {"size": len(data), "blob_id": blob_id}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(listing, indent=1))


@contextmanager
def hub_answering(
    status: int, error_code: str, message: str = "stand-in Hub", seen: list | None = None
):
    """An endpoint on 127.0.0.1 that answers every request with ``status`` and the
    ``X-Error-Code`` the Hub sends (``GatedRepo``, ``RepoNotFound``, ``RevisionNotFound``);
    yields its URL for ``HF_ENDPOINT``. Each request's method and path is appended to
    ``seen``."""

    class Handler(BaseHTTPRequestHandler):
        def _answer(self):
            if seen is not None:
                seen.append(f"{self.command} {self.path}")
            body = json.dumps({"error": message}).encode()
            self.send_response(status)
            self.send_header("X-Error-Code", error_code)
            self.send_header("X-Error-Message", message)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        do_GET = do_HEAD = do_POST = _answer

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def flac_bytes(seconds: float, freq: float, sr: int = 16000) -> bytes:
    """A tone as FLAC file bytes (what a Hub parquet's ``audio.bytes`` holds)."""
    import soundfile as sf

    t = np.arange(int(seconds * sr)) / sr
    buf = io.BytesIO()
    sf.write(buf, (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32), sr, format="FLAC")
    return buf.getvalue()


def audio_parquet(rows: list[dict], row_group_size: int | None = None) -> bytes:
    """Parquet bytes of ``rows`` whose ``audio`` is ``{bytes, path}``, with the ``datasets``
    feature metadata the Hub's parquet files carry (the column reads as an ``Audio``)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(rows)
    features = {name: {"dtype": "string", "_type": "Value"} for name in table.column_names}
    features["audio"] = {"_type": "Audio", "sampling_rate": 16000}
    for name in table.column_names:
        if pa.types.is_integer(table.schema.field(name).type):
            features[name] = {"dtype": "int64", "_type": "Value"}
    meta = {b"huggingface": json.dumps({"info": {"features": features}}).encode()}
    table = table.replace_schema_metadata(meta)
    buf = io.BytesIO()
    pq.write_table(table, buf, row_group_size=row_group_size)
    return buf.getvalue()

