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
import threading
from html import escape as html_escape
from html.parser import HTMLParser
from pathlib import Path

import pytest
import yaml

from asrforge.errors import UserError
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
        lines = [json.dumps({"id": "u1", "reference": "a", "hypothesis": "b"}),
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


@pytest.mark.fast
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
    # a run that names its one language as data.language (no data.languages, no selection's)
    single = yaml.safe_load((matrix_root / "runs" / "es-tiny-s0" / "config.yaml").read_text())
    single["data"] = {"path": "x", "language": "es"}
    del single["selection"]
    (matrix_root / "runs" / "es-tiny-s0" / "config.yaml").write_text(yaml.safe_dump(single))
    (matrix_root / "matrix.json").rename(matrix_root / "plan.json")  # the file gives no language
    assert {r.job_id: r.language for r in collect(matrix_root)}["es-tiny-s0"] == "es"
    (matrix_root / "plan.json").rename(matrix_root / "matrix.json")
    # a plain directory of run dirs works too (no matrix.json: only the started jobs)
    assert len(collect(matrix_root / "runs")) == 6
    plain = matrix_root.parent / "plain"
    shutil.copytree(matrix_root / "runs", plain)
    assert sorted(r.job_id for r in collect(plain)) == sorted(set(rows) - {"th-tiny-s1"})


@pytest.mark.fast
def test_lines_and_records_that_are_not_step_records_are_left_out_with_a_warning(
    tmp_path, caplog
):
    """A list, a string step or deep JSON in metrics.jsonl, and an evaluation record whose
    summary is a string, stopped the report with a traceback."""
    run = write_run(tmp_path / "root", "en-tiny-s0", "en", 0, [begin(0, "en")])
    good = ev(2, 0.5, 0.4, 4.0, True, "first evaluation")
    lines = ["[1, 2]", json.dumps({**good, "step": "x"}), "[" * 100_000 + "]" * 100_000,
             json.dumps(good), '{"event": "train", "step": 3, "lo']  # the last one cut by a crash
    with (run / "metrics.jsonl").open("a") as f:
        f.write("\n".join(lines))
    [job] = collect(run)
    assert [e["step"] for e in job.evals] == [2] and job.status == "interrupted"
    assert "metrics.jsonl: line 2 and 2 more not a record with an integer step" in caplog.text
    assert "line 6" not in caplog.text  # a crash's cut line is no news
    (run / "metrics.jsonl").unlink()
    (run / "eval").mkdir()
    (run / "eval" / "step-000001.jsonl").write_text('"str"\n')
    (run / "eval" / "step-000002.jsonl").symlink_to("/dev/zero")  # read without end, before
    [job] = collect(run)
    assert job.evals == [] and job.status == "queued"
    assert "step-000001.jsonl: line 1 not a record" in caplog.text
    assert "step-000002.jsonl: a character device, not a regular file; shown without" in caplog.text


@pytest.mark.fast
def test_one_run_directory_is_a_report_of_one_job_and_no_run_is_refused(matrix_root, tmp_path):
    [one] = collect(matrix_root / "runs" / "es-tiny-s0")
    assert (one.job_id, one.language, one.best["wer"]) == ("es-tiny-s0", "es", 0.7)
    (tmp_path / "empty").mkdir()
    (tmp_path / "tiny.yaml").write_text("seed: 0\n")
    with pytest.raises(UserError, match="empty: no run there"):
        write_report(tmp_path / "empty", tmp_path / "r.html")
    with pytest.raises(UserError, match=r"tiny\.yaml: not a directory"):
        write_report(tmp_path / "tiny.yaml", tmp_path / "r.html")
    assert not (tmp_path / "r.html").exists()


@pytest.mark.fast
def test_a_change_of_wer_is_coloured_better_or_worse():
    from asrforge.matrix.report import JobReport, render

    class Cells(HTMLParser):
        def __init__(self):
            super().__init__()
            self.classes: list[str] = []

        def handle_starttag(self, tag, attrs):
            if tag == "td":
                self.classes.append(dict(attrs).get("class") or "")

    improved = JobReport("a", "en", "c", 0, "done", best_step=4, best={"wer": 0.5},
                         start={"wer": 0.8})
    worse = JobReport("b", "en", "c", 1, "done", best_step=4, best={"wer": 0.9},
                      start={"wer": 0.8})
    cells = Cells()
    cells.feed(render([improved, worse], "t"))
    # the page's CSS colours td.better / td.worse: each job row's delta cell must carry them
    assert cells.classes.count("n better") >= 1 and cells.classes.count("n worse") >= 1


@pytest.mark.fast
def test_the_page_is_self_contained(matrix_root, tmp_path):
    from asrforge.cli import main

    out = tmp_path / "r.html"
    assert main(["report", str(matrix_root), "--out", str(out), "--title", "T <&>"]) == 0
    page = out.read_text()
    assert "<title>T &lt;&amp;&gt;</title>" in page
    for external in ("http://", "https://", "<link", "src="):
        assert external not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert main(["report", str(tmp_path / "missing")]) == 2


@pytest.mark.fast
def test_a_page_under_a_file_is_refused_naming_the_file(matrix_root, tmp_path, capsys):
    from asrforge.cli import main

    (tmp_path / "afile").write_text("")
    out = tmp_path / "afile" / "x.html"
    assert main(["report", str(matrix_root), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--out {out}: {tmp_path / 'afile'} is a file, not a directory" in err
    assert "File exists" not in err


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


# ---------------------------------------------------------------------------------------------
# At scale: 300 jobs (25 languages × 4 configs × 3 seeds)

LANGS = ["af", "am", "ar", "az", "be", "bg", "bn", "bs", "ca", "cs", "cy", "da", "de", "el",
         "en", "es", "et", "fa", "fi", "fr", "gl", "gu", "ha", "he", "hi"]
CONFIGS = ["base", "lora", "pack", "tiny"]


def synthetic_wer(lang_i: int, cfg_i: int, seed: int, step: int) -> float:
    """A plausible curve: starts at 0.6-0.8, falls with steps, config and seed shift it."""
    start = 0.6 + 0.008 * lang_i
    return round(start - (0.05 + 0.03 * cfg_i) * step / 50 + 0.004 * seed, 6)


@pytest.fixture
def big_matrix(tmp_path) -> Path:
    root = tmp_path / "big"
    jobs = []
    for li, lang in enumerate(LANGS):
        for ci, cfg in enumerate(CONFIGS):
            for seed in range(3):
                job = f"{lang}-{cfg}-s{seed}"
                jobs.append({"job_id": job, "language": lang, "config_id": cfg, "seed": seed})
                if (li, ci, seed) == (3, 1, 2):
                    write_run(root, job, lang, seed, [{"event": "train_begin", "step": 0}],
                              ("FAILED", {"attempts": 3, "reason": "exit code 1",
                                          "log_tail": "CUDA out of memory"}))
                    continue
                recs = [{"event": "train_begin", "step": 0}]
                for step in (0, 50, 100, 150):
                    recs += [{"event": "train", "step": step + s, "loss": 3.0 - step / 100}
                             for s in (10, 30)] if step else []
                    wer = synthetic_wer(li, ci, seed, step)
                    guard = {"guard_wer": 0.1 + 0.01 * seed * step / 150, "guard_start": 0.1}
                    recs.append({"event": "eval", "step": step, "wer": wer, "cer": wer / 2,
                                 "loss": 2.0 - step / 200, "save": step > 0, "reason": "r",
                                 **(guard if cfg == "pack" else {})})
                recs.append({"event": "train_end", "step": 150, "status": "completed",
                             "reason": "reached max_steps=150", "best_step": 150})
                write_run(root, job, lang, seed, recs, ("DONE", {"attempts": 1,
                                                                 "duration_s": 600.0}))
    (root / "claims").mkdir()
    (root / "matrix.json").write_text(json.dumps({"jobs": jobs}))
    return root


def test_seed_spread_and_start_delta_per_language_and_config(big_matrix):
    from statistics import fmean, stdev

    from asrforge.matrix.report import summarize

    rows = collect(big_matrix)
    assert len(rows) == 300
    groups = {(g.language, g.config_id): g for g in summarize(rows)}
    assert len(groups) == 100 and all(len(g.jobs) == 3 for g in groups.values())
    de = groups[("de", "pack")]
    wers = [synthetic_wer(LANGS.index("de"), 2, s, 150) for s in range(3)]
    mean, sd, n = de.spread("wer")
    assert n == 3 and mean == pytest.approx(fmean(wers)) and sd == pytest.approx(stdev(wers))
    deltas = [synthetic_wer(12, 2, s, 150) - synthetic_wer(12, 2, s, 0) for s in range(3)]
    assert de.spread("delta")[0] == pytest.approx(fmean(deltas)) and fmean(deltas) < 0
    guard = de.spread("guard_change")  # the forgetting guard's change from the start
    assert guard[2] == 3 and guard[0] == pytest.approx(0.01) and guard[1] == pytest.approx(0.01)
    assert groups[("de", "base")].spread("guard_change") is None  # that config has no guard
    # a language written without spaces is judged by CER, as selection judges it
    from asrforge.matrix.report import JobReport

    zh = JobReport("z", "zh", "c", 0, "done", best={"wer": 0.9, "cer": 0.2},
                   start={"wer": 0.95, "cer": 0.5})
    assert zh.metric == "cer" and zh.delta() == pytest.approx(-0.3)
    # the failed job counts in its group but not in its spread
    az = groups[("az", "lora")]
    assert az.count("failed") == 1 and az.spread("wer")[2] == 2


def test_report_at_scale_filters_in_chromium(big_matrix, tmp_path):
    page = tmp_path / "report.html"
    write_report(big_matrix, page)
    assert page.stat().st_size < 3_000_000  # ~900 jobs stay a page a browser opens at once

    def shown(query: str) -> tuple[int, int, int]:
        proc = run_chromium("--virtual-time-budget=5000", "--dump-dom", f"{page.as_uri()}?{query}")
        assert proc.returncode == 0, proc.stderr[-2000:]
        parsed = DomRows()
        parsed.feed(proc.stdout)
        a = parsed.html
        return (int(a["data-jobs-shown"]), int(a["data-groups-shown"]),
                int(a["data-sections-shown"]))

    assert shown("x=1") == (300, 100, 25)  # no filter: everything
    assert shown("language=de") == (12, 4, 1)
    assert shown("language=de&config=lora") == (3, 1, 1)
    assert shown("status=failed") == (1, 100, 1)  # the groups table keeps every group
    assert shown("q=out%20of%20memory") == (0, 0, 0)  # the log tail is not searched
    assert shown("q=az-lora") == (3, 1, 1)  # words of job ids match
    assert shown("q=zz") == (0, 0, 0)


def test_report_at_scale_screenshot(big_matrix, tmp_path):
    """A look at the page of 300 jobs filtered to one language: the screenshot is kept in
    the test's tmp dir for a human to open (pytest --basetemp=DIR)."""
    page, shot = tmp_path / "report.html", tmp_path / "shot.png"
    write_report(big_matrix, page)
    proc = run_chromium("--window-size=1400,2400", "--virtual-time-budget=5000",
                        f"--screenshot={shot}", f"{page.as_uri()}?language=de")
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 60_000


@pytest.mark.fast
@pytest.mark.parametrize(
    "entry, named",
    [
        ({"job_id": 5}, ".job_id: 5 is not the plain name of a run directory"),
        ({"job_id": "../../outside"}, ".job_id: '../../outside' is not the plain name"),
        ({"job_id": "/"}, ".job_id: '/' is not the plain name"),  # the whole disk was totalled
        ({"job_id": "zz-tiny-s0", "language": 5}, ".language: 5 is not a string or null"),
        ({"job_id": "zz-tiny-s0", "seed": 1.5}, ".seed: 1.5 is not an integer or null"),
        (["zz-tiny-s0"], ": ['zz-tiny-s0'] is not an object"),
    ],
    ids=["an integer id", "a relative path", "the root directory", "an integer language",
         "a fractional seed", "no object"],
)
def test_a_planned_job_that_is_no_run_inside_the_root_is_shown_unreadable(
    matrix_root, tmp_path, entry, named
):
    """matrix.json is handed with the root: a job id led the report's reads out of it."""
    outside = tmp_path / "outside"  # what a ../ job id would read
    outside.mkdir()
    (outside / "config.yaml").write_text("data: {language: zz}\n")
    (outside / "DONE").write_text("{}")
    index = json.loads((matrix_root / "matrix.json").read_text())
    index["jobs"].append(entry)
    (matrix_root / "matrix.json").write_text(json.dumps(index))
    rows = collect(matrix_root)
    [bad] = [r for r in rows if r.status == "unreadable"]
    assert f"matrix.json: jobs[6]{named}" in bad.note
    assert len(rows) == 7 and "zz" not in {r.language for r in rows}
    assert bad.disk_bytes is None
    write_report(matrix_root, tmp_path / "r.html")
    page = (tmp_path / "r.html").read_text()
    assert 'class="st st-unreadable"' in page and "matrix.json: jobs[6]" in page


@pytest.mark.fast
@pytest.mark.parametrize(
    "name, text, named",
    [
        ("config.yaml", "data: [1, 2]\n", "config.yaml: data: [1, 2] is not an object or null"),
        ("config.yaml", "selection: 5\n", "config.yaml: selection: 5 is not an object or null"),
        ("config.yaml", "data: {languages: 5}\n", "data.languages: 5 is not a list of strings"),
        ("config.yaml", "seed: 0.5\n", "config.yaml: seed: 0.5 is not an integer or null"),
        ("config.yaml", "- en\n", "config.yaml: holds list, not a mapping"),
        ("metrics.jsonl", json.dumps({**begin(0, "en"), "selection": 7}),
         "metrics.jsonl: the train_begin record of step 0: selection: 7 is not a string"),
        ("metrics.jsonl", json.dumps({**end(6, 4), "best_step": [1]}),
         "the train_end record of step 6: best_step: [1] is not an integer or null"),
        ("DONE", json.dumps({"attempts": "1"}), "DONE: attempts: '1' is not an integer >= 0"),
    ],
    ids=["data a list", "selection a number", "languages a number", "seed a fraction",
         "config a list", "begin's selection a number", "best step a list", "marker's attempts"],
)
def test_a_run_whose_files_hold_values_of_the_wrong_kind_is_shown_unreadable(
    matrix_root, tmp_path, name, text, named
):
    """Each stopped the whole report with a traceback (or, the marker, with an error)."""
    run = matrix_root / "runs" / "en-tiny-s0"
    (matrix_root / "matrix.json").unlink()  # the languages and seeds come from the runs alone
    with (run / name).open("w" if name != "metrics.jsonl" else "a") as f:
        f.write(text + "\n")
    rows = {r.job_id: r for r in collect(matrix_root)}
    assert rows["en-tiny-s0"].status == "unreadable" and named in rows["en-tiny-s0"].note
    assert rows["es-tiny-s0"].status == "done" and rows["es-tiny-s0"].best["wer"] == 0.7
    write_report(matrix_root, tmp_path / "r.html")
    assert html_escape(named) in (tmp_path / "r.html").read_text()


@pytest.mark.fast
def test_a_fifo_in_place_of_a_jobs_lock_is_not_waited_on(matrix_root):
    lock = matrix_root / "claims" / "es-tiny-s1.lock"
    os.mkfifo(lock)
    rows: list = []
    reader = threading.Thread(target=lambda: rows.extend(collect(matrix_root)), daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():  # waiting for a writer, as it did before: release it
        os.close(os.open(lock, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(10)
        rows.clear()
    assert {r.job_id: r.status for r in rows}.get("es-tiny-s1") == "interrupted"
