"""``asrforge report``: what it reads from run dirs (resumed runs, failed, running, queued jobs,
eval-file fallback), and the page itself in headless Chromium: it renders, has a row per job,
draws the curves, and sorts when a header is clicked."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import tempfile
from html.parser import HTMLParser
from pathlib import Path

import pytest
import yaml

from asrforge.matrix.report import collect, write_report

SEL = {"en": "group B → combined_gate, no step cap", "es": "group A → by_wer, cap 3000",
       "th": "group C → by_loss, no step cap"}


def write_run(root: Path, job: str, lang: str, seed: int, records: list[dict],
              marker: tuple[str, dict] | None = None) -> Path:
    run = root / "runs" / job
    run.mkdir(parents=True)
    cfg = {"output_dir": str(run), "seed": seed, "config_id": "tiny",
           "data": {"path": "x", "languages": [lang]}, "selection": {"language": lang}}
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    lines = [json.dumps(r) for r in records]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if marker:
        (run / marker[0]).write_text(json.dumps(marker[1]))
    return run


def begin(step: int, lang: str) -> dict:
    return {"event": "train_begin", "step": step, "selection": f"language {lang}: {SEL[lang]}"}


def ev(step: int, wer: float, cer: float, loss: float, save: bool, reason: str) -> dict:
    return {"event": "eval", "step": step, "wer": wer, "cer": cer, "loss": loss,
            "rep_trap_rate": 0.25, "save": save, "reason": reason}


def end(step: int, best_step: int) -> dict:
    return {"event": "train_end", "step": step, "status": "completed",
            "reason": f"reached max_steps={step}", "best_step": best_step}


@pytest.fixture
def matrix_root(tmp_path) -> Path:
    """Six jobs in every state a report meets."""
    root = tmp_path / "root"
    train = [{"event": "train", "step": s, "loss": 6.0 - 0.3 * s} for s in range(1, 7)]
    write_run(root, "en-tiny-s0", "en", 0, [
        begin(0, "en"), *train[:2], ev(2, 0.80, 0.60, 5.0, True, "first evaluation"),
        {"event": "save", "step": 2, "kind": "best"}, *train[2:4],
        ev(4, 0.50, 0.40, 4.0, True, "wer 0.5 < best 0.8, within tolerances"),
        {"event": "save", "step": 4, "kind": "best"}, *train[4:],
        ev(6, 0.55, 0.45, 3.9, False, "wer 0.55 is 0.05 over best 0.5: gate closed"),
        {"event": "save", "step": 6, "kind": "step"}, end(6, 4),
    ], ("DONE", {"attempts": 1, "duration_s": 75.0}))
    # crashed after step 4's evaluation (not saved), resumed from step 2, went on to 6
    write_run(root, "es-tiny-s0", "es", 0, [
        begin(0, "es"), ev(2, 0.9, 0.7, 5.0, True, "first evaluation"),
        {"event": "save", "step": 2, "kind": "best"}, ev(4, 0.99, 0.99, 9.9, False, "crashed run"),
        begin(2, "es"), ev(4, 0.7, 0.5, 4.5, True, "wer 0.7 < best 0.9"),
        {"event": "save", "step": 4, "kind": "best"}, ev(6, 0.75, 0.5, 4.4, False, "no"),
        {"event": "save", "step": 6, "kind": "final"}, end(6, 4),
    ], ("DONE", {"attempts": 2, "duration_s": 130.0}))
    write_run(root, "th-tiny-s0", "th", 0, [begin(0, "th")], (
        "FAILED", {"attempts": 3, "reason": "exit code 1", "log_tail": "Traceback\nOOM: boom"}))
    # evaluations only in eval/step-*.jsonl (a run without the metrics_jsonl callback)
    run = write_run(root, "en-tiny-s1", "en", 1, [])
    (run / "eval").mkdir()
    for step, wer in ((2, 0.3), (4, 0.2)):
        lines = [json.dumps({"uid": "u1", "ref": "a", "hyp": "b"}),
                 json.dumps({"summary": True, "step": step, "wer": wer, "cer": 0.1, "loss": 2.0,
                             "save": True, "reason": f"eval file {step}"})]
        (run / "eval" / f"step-{step:06d}.jsonl").write_text("\n".join(lines) + "\n")
    # running: its lock is held (by this test process) and metrics are still being written
    write_run(root, "es-tiny-s1", "es", 1, [begin(0, "es"), ev(2, 0.6, 0.5, 5.0, True, "first")])
    (root / "claims").mkdir()
    jobs = ["en-tiny-s0", "en-tiny-s1", "es-tiny-s0", "es-tiny-s1", "th-tiny-s0", "th-tiny-s1"]
    index = {"jobs": [{"job_id": j, "language": j.split("-")[0], "config_id": "tiny",
                       "seed": int(j[-1])} for j in jobs]}
    (root / "matrix.json").write_text(json.dumps(index))
    return root


@pytest.fixture
def held_lock(matrix_root):
    fd = os.open(matrix_root / "claims" / "es-tiny-s1.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    yield
    os.close(fd)


def test_collect_reads_every_state(matrix_root, held_lock):
    rows = {r.job_id: r for r in collect(matrix_root)}
    assert list(rows) == ["en-tiny-s0", "en-tiny-s1", "es-tiny-s0", "es-tiny-s1", "th-tiny-s0",
                          "th-tiny-s1"]
    en = rows["en-tiny-s0"]
    assert (en.status, en.best_step, en.policy, en.attempts, en.duration_s) == (
        "done", 4, "combined_gate", 1, 75.0)
    assert en.best == {"wer": 0.5, "cer": 0.4, "loss": 4.0, "rep_trap_rate": 0.25}
    assert en.chosen_by == "wer 0.5 < best 0.8, within tolerances"
    assert en.saves == [(2, "best"), (4, "best"), (6, "step")] and len(en.train_loss) == 6
    es = rows["es-tiny-s0"]  # the resumed attempt's step 4 replaces the crashed one's
    assert [(e["step"], e["wer"]) for e in es.evals] == [(2, 0.9), (4, 0.7), (6, 0.75)]
    assert es.best["wer"] == 0.7 and es.policy == "by_wer" and es.attempts == 2
    th = rows["th-tiny-s0"]
    assert th.status == "failed" and th.policy == "by_loss" and "OOM: boom" in th.note
    assert rows["en-tiny-s1"].best_step == 4 and rows["en-tiny-s1"].chosen_by == "eval file 4"
    assert rows["en-tiny-s1"].status == "interrupted"
    assert rows["es-tiny-s1"].status == "running" and rows["es-tiny-s1"].best_step == 2
    assert rows["th-tiny-s1"].status == "queued" and rows["th-tiny-s1"].language == "th"
    # a plain directory of run dirs works too (no matrix.json: only the started jobs)
    assert len(collect(matrix_root / "runs")) == 6
    plain = matrix_root.parent / "plain"
    shutil.copytree(matrix_root / "runs", plain)
    assert sorted(r.job_id for r in collect(plain)) == sorted(set(rows) - {"th-tiny-s1"})


def test_the_page_is_self_contained(matrix_root, tmp_path):
    from asrforge.cli import main

    out = tmp_path / "r.html"
    assert main(["report", str(matrix_root), "--out", str(out), "--title", "T <&>"]) == 0
    page = out.read_text()
    assert "<title>T &lt;&amp;&gt;</title>" in page
    for external in ("http://", "https://", "<link", "src="):
        assert external not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert main(["report", str(tmp_path / "missing")]) == 2


# ---------------------------------------------------------------------------------------------
# Chromium


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("no headless Chromium (Debian: apt-get install chromium)")


def run_chromium(*args: str) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as profile:
        cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
               "--no-first-run", "--disable-background-networking", "--disable-component-update",
               "--disable-sync", f"--user-data-dir={profile}", *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


class DomRows(HTMLParser):
    """The job rows of the dumped DOM (in order) and the root element's attributes."""

    def __init__(self):
        super().__init__()
        self.rows: list[str] = []
        self.html: dict[str, str | None] = {}
        self.table: dict[str, str | None] = {}
        self.polylines: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "tr" and a.get("class") == "job-row":
            self.rows.append(a["data-job"])
        elif tag == "html":
            self.html = a
        elif tag == "table" and a.get("id") == "jobs":
            self.table = a
        elif tag == "polyline":
            self.polylines.append(a.get("points") or "")


def dump(page: Path, query: str) -> DomRows:
    proc = run_chromium("--virtual-time-budget=3000", "--dump-dom", f"{page.as_uri()}?{query}")
    assert proc.returncode == 0 and "</html>" in proc.stdout, proc.stderr[-2000:]
    parsed = DomRows()
    parsed.feed(proc.stdout)
    return parsed


def test_report_renders_and_sorts_in_chromium(matrix_root, held_lock, tmp_path):
    page = tmp_path / "report.html"
    write_report(matrix_root, page)
    dom = dump(page, "selftest=1")
    assert len(dom.rows) == 6  # a row per job, in matrix order
    assert dom.rows[0] == "en-tiny-s0" and dom.table.get("data-sorted-by") is None
    # curves: 3 eval plots for each job with data, plus the training loss where logged; every
    # polyline has points and a drawn length > 0
    assert len(dom.polylines) == 13 and all(p.count(",") >= 1 for p in dom.polylines)
    assert dom.html["data-polylines-drawn"] == "10"  # es-tiny-s1 has a single evaluation

    dom = dump(page, "sort=wer")  # one click on the WER header: ascending, blanks last
    assert dom.table["data-sorted-by"] == "wer:asc"
    assert dom.rows[:4] == ["en-tiny-s1", "en-tiny-s0", "es-tiny-s1", "es-tiny-s0"]
    assert set(dom.rows[4:]) == {"th-tiny-s0", "th-tiny-s1"}
    dom = dump(page, "sort=wer,wer")  # a second click: descending
    assert dom.table["data-sorted-by"] == "wer:desc"
    assert dom.rows[:4] == ["es-tiny-s0", "es-tiny-s1", "en-tiny-s0", "en-tiny-s1"]
    dom = dump(page, "sort=status")  # failed first, done last
    assert dom.rows == ["th-tiny-s0", "es-tiny-s1", "en-tiny-s1", "th-tiny-s1", "en-tiny-s0",
                        "es-tiny-s0"]


def test_report_screenshot(matrix_root, tmp_path):
    page, shot = tmp_path / "report.html", tmp_path / "shot.png"
    write_report(matrix_root, page)
    proc = run_chromium("--window-size=1280,2000", f"--screenshot={shot}", page.as_uri())
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000  # a blank page is ~5 KB
