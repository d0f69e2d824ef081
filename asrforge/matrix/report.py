"""``asrforge report``: one self-contained HTML page of a matrix's runs.

How it works: docs/matrix.md, "What the report shows and reads (`matrix/report.py`)".
"""

from __future__ import annotations

import html
import logging
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asrforge.checkpoint.disk import format_gb, tree_bytes
from asrforge.config.yaml_limits import load_yaml, read_yaml_text
from asrforge.errors import UserError
from asrforge.io.atomic import atomic_write_text
from asrforge.io.directories import plain_name
from asrforge.io.records import INTEGER, MAPPING, TEXT, Kind, optional, record_problems
from asrforge.io.small_files import CONFIG_BYTES, read_json
from asrforge.matrix.claims import lock_is_held, read_marker
from asrforge.run_layout import (
    CONFIG_FILE,
    METRICS_FILE,
    RunLayout,
    current_metrics,
    read_step_records,
    recorded_selection,
)
from asrforge.text.languages import primary_metric

log = logging.getLogger(__name__)

METRICS = ("wer", "cer", "loss")
STATUS_ORDER = ("unreadable", "failed", "running", "interrupted", "queued", "done")
POLICY_RE = re.compile(r"→ (by_wer|by_loss|combined_gate)")


@dataclass
class JobReport:
    """What the page shows of one job."""

    job_id: str
    language: str | None = None
    config_id: str | None = None
    seed: int | None = None
    status: str = "queued"
    """``done``, ``failed``, ``running``, ``interrupted`` (started, nobody runs it now),
    ``queued``, or ``unreadable`` (what the report reads of it holds a value of the wrong kind:
    :attr:`note` names it)."""
    best_step: int | None = None
    best: dict[str, float | None] = field(default_factory=dict)
    """``wer``, ``cer``, ``loss``, ``rep_trap_rate`` (and ``longform_wer`` with
    ``eval.longform_items``) of the evaluation at ``best_step``."""
    chosen_by: str | None = None
    """The ``reason`` of the evaluation whose checkpoint was selected."""
    policy: str | None = None
    last_step: int | None = None
    attempts: int | None = None
    duration_s: float | None = None
    evals: list[dict[str, Any]] = field(default_factory=list)
    train_loss: list[tuple[int, float]] = field(default_factory=list)
    saves: list[tuple[int, str]] = field(default_factory=list)
    disk_bytes: int | None = None
    """Bytes the run directory holds (checkpoints, logs, TensorBoard; hard links once)."""
    note: str | None = None
    """Why it failed / how it ended, and for a failed job the tail of its log; why it is
    unreadable."""
    start: dict[str, float] = field(default_factory=dict)
    """``wer`` and ``cer`` of the evaluation at step 0 (the starting model), when the run made
    one."""

    @property
    def metric(self) -> str:
        """The error rate the language is judged by: CER for unspaced scripts, else WER (as
        evaluation and selection judge it)."""
        try:
            return primary_metric(self.language) if self.language else "wer"
        except UserError:  # a language the table does not know
            return "wer"

    def delta(self) -> float | None:
        """The selected checkpoint's error rate (:attr:`metric`) minus the starting model's:
        negative is better."""
        now, then = self.best.get(self.metric), self.start.get(self.metric)
        if not isinstance(now, int | float) or then is None:
            return None
        return now - then


# ---------------------------------------------------------------------------------------------
# What the files of a run must hold where the report reads them


class UnreadableRun(ValueError):
    """A file of a run holds a value of the wrong kind where the report reads one; the message
    names the file and the field. The run is shown as ``unreadable``, the others as ever."""


_LANGUAGES = Kind(lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
                  "a list of strings")  # fmt: skip
_CONFIG_KINDS = {
    "data": optional(MAPPING), "selection": optional(MAPPING), "config_id": optional(TEXT),
    "seed": optional(INTEGER),
}  # fmt: skip
_CONFIG_SECTION_KINDS = {
    "data": {"language": optional(TEXT), "languages": optional(_LANGUAGES)},
    "selection": {"language": optional(TEXT)},
}
"""The fields of ``config.yaml`` the report shows, by section."""
_RECORD_KINDS = {
    "train_begin": {"selection": optional(TEXT)},
    "train_end": {"best_step": optional(INTEGER), "status": optional(TEXT),
                  "reason": optional(TEXT)},
    "eval": {"reason": optional(TEXT)},
    "save": {"kind": optional(TEXT)},
}  # fmt: skip
"""The fields of each event's step record the report reads beside ``step`` (an evaluation's
metrics that are not numbers are shown as none)."""


def _run_config(path: Path) -> dict[str, Any]:
    """The run's ``config.yaml`` at ``path``, its fields in :data:`_CONFIG_KINDS` checked; {}
    when there is none or it cannot be read (with a warning naming it).

    Raises:
        UnreadableRun: it is no mapping, or a field it shows is of the wrong kind (named).
    """
    if not path.is_file():
        return {}
    try:
        cfg = load_yaml(read_yaml_text(path))
    except (ValueError, OSError) as e:
        log.warning("report: %s: %s; shown without it", path, getattr(e, "strerror", None) or e)
        return {}
    if cfg is None:
        return {}
    if not isinstance(cfg, dict):
        raise UnreadableRun(f"{path}: holds {type(cfg).__name__}, not a mapping")
    problems = record_problems(cfg, _CONFIG_KINDS)
    for section, kinds in _CONFIG_SECTION_KINDS.items():
        if not problems:
            problems = record_problems(cfg.get(section) or {}, kinds, section)
    if problems:
        raise UnreadableRun(f"{path}: {'; '.join(problems)}")
    return cfg


def _check_record(path: Path, record: dict[str, Any]) -> dict[str, Any]:
    """``record``, a step record of the file ``path``, once its fields in :data:`_RECORD_KINDS`
    are checked.

    Raises:
        UnreadableRun: a field of the wrong kind (named with the record's event and step).
    """
    event = record.get("event")
    problems = record_problems(record, _RECORD_KINDS.get(event, {}) if TEXT(event) else {})
    if problems:
        raise UnreadableRun(f"{path}: the {event} record of step "
                            f"{record['step']}: {'; '.join(problems)}")  # fmt: skip
    return record


def read_run(run_dir: Path) -> dict[str, Any]:
    """Parse ``metrics.jsonl``: evals, train losses, saves, the last train_begin / train_end.

    Only the records of the run the checkpoints continue count
    (:func:`~asrforge.run_layout.current_metrics`): a file a resume appended to before runs cut
    it holds the records of an earlier attempt's steps that were trained again.

    Raises:
        UnreadableRun: a record holds a field of the wrong kind (named).
    """
    evals: list[dict[str, Any]] = []
    train: list[tuple[int, float]] = []
    saves: list[tuple[int, str]] = []
    begin = end = None
    path = RunLayout(run_dir).metrics
    # a run that began writing its metrics has started, whatever its lines hold
    started = path.is_file() and path.stat().st_size > 0
    for rec in current_metrics((_records(path) if started else None) or []):
        _check_record(path, rec)
        event, step = rec.get("event"), rec["step"]
        if event == "train_begin":
            begin, end = rec, None
        elif event == "train" and isinstance(rec.get("loss"), int | float):
            train.append((step, float(rec["loss"])))
        elif event == "eval":
            evals.append(rec)
        elif event == "save":
            saves.append((step, rec.get("kind", "step")))
        elif event == "train_end":
            end = rec
    if not evals:
        for f in RunLayout(run_dir).eval_records():
            summary = (_records(f, last=True) or [{}])[-1]
            if summary.get("summary"):
                evals.append(_check_record(f, summary))
    return {"evals": evals, "train": train, "saves": saves, "begin": begin, "end": end,
            "started": started}


def _records(path: Path, *, last: bool = False) -> list[dict[str, Any]] | None:
    """:func:`~asrforge.run_layout.read_step_records` of ``path``; None when the file cannot be
    read.

    A file that is no regular file or too large, or lines that hold no step record, are left out
    with one warning naming the file.
    """
    try:
        records, left_out = read_step_records(path, last=last)
    except (OSError, ValueError) as e:
        log.warning("report: %s: %s; shown without it", path, getattr(e, "strerror", None) or e)
        return None
    if left_out:
        more = f" and {len(left_out) - 1} more" if len(left_out) > 1 else ""
        log.warning("report: %s: line %d%s not a record with an integer step; left out",
                    path, left_out[0], more)  # fmt: skip
    return records


def collect(runs_dir: Path) -> list[JobReport]:
    """Every job under ``runs_dir`` (a matrix root, or a directory of run dirs), or the one run
    ``runs_dir`` is."""
    runs_dir = Path(runs_dir)
    signs = (CONFIG_FILE, METRICS_FILE, "DONE", "FAILED")
    if any((runs_dir / n).exists() for n in signs):
        runs_dir, only = runs_dir.parent, runs_dir.name
    else:
        only = None
    if (runs_dir / "runs").is_dir():
        root, runs = runs_dir, runs_dir / "runs"
    else:
        root, runs = runs_dir.parent, runs_dir
    planned, refused = _planned(root / "matrix.json")
    found = sorted(
        d.name for d in runs.iterdir() if d.is_dir() and any((d / n).exists() for n in signs)
    ) if runs.is_dir() else []
    ids = [*refused, *planned, *(i for i in found if i not in planned and i not in refused)]
    ids = [only] if only is not None else ids
    return [refused.get(i) or _job(runs / i, planned.get(i, {}), root / "claims" / f"{i}.lock")
            for i in ids]  # fmt: skip


_PLANNED_KINDS = {"language": optional(TEXT), "config_id": optional(TEXT),
                  "seed": optional(INTEGER)}  # fmt: skip
"""The fields of a ``matrix.json`` job the report shows, beside its ``job_id``."""


def _planned(index: Path) -> tuple[dict[str, dict[str, Any]], dict[str, JobReport]]:
    """The jobs the matrix root's ``index`` (``matrix.json``) plans, by job id, and an
    unreadable row for each entry that is no such job, by its job id (``jobs[N]`` when that is
    no plain name). Nothing of such an entry's run is read: its job id names the directory, and
    one that is no plain name (``../..``) would lead out of the root."""
    if not index.is_file():
        return {}, {}
    try:
        value = read_json(index, CONFIG_BYTES, error=ValueError)
    except (OSError, ValueError) as e:
        log.warning("report: %s; shown without it", e)
        return {}, {}
    jobs = value.get("jobs") if isinstance(value, dict) else None
    if not isinstance(jobs, list):
        log.warning("report: %s: holds no list of jobs; shown without it", index)
        return {}, {}
    planned: dict[str, dict[str, Any]] = {}
    refused: dict[str, JobReport] = {}
    for n, job in enumerate(jobs):
        where = f"jobs[{n}]"
        problems = record_problems(job, _PLANNED_KINDS, where, required=("job_id",))
        job_id = job.get("job_id", "") if isinstance(job, dict) else ""
        if isinstance(job, dict) and "job_id" in job and not plain_name(job_id):
            problems.append(f"{where}.job_id: {job_id!r:.60} is not the plain name of a run "
                            "directory")  # fmt: skip
        if not problems:
            planned[job_id] = job
            continue
        row = job_id if plain_name(job_id) else where
        refused[row] = _unreadable(row, f"{index}: {'; '.join(problems)}", {})
    return planned, refused


def _job(run_dir: Path, planned: dict[str, Any], lock: Path) -> JobReport:
    """The row of the job whose run directory is ``run_dir`` (``planned``: its ``matrix.json``
    entry, checked); an unreadable one when a file of the run holds a value of the wrong kind."""
    try:
        return _read_job(run_dir, planned, lock)
    except UnreadableRun as e:
        return _unreadable(run_dir.name, str(e), planned)


def _unreadable(job_id: str, reason: str, planned: dict[str, Any]) -> JobReport:
    log.warning("report: %s; the job is shown as unreadable", reason)
    return JobReport(job_id, planned.get("language"), planned.get("config_id"),
                     planned.get("seed"), status="unreadable", note=reason)  # fmt: skip


def _read_job(run_dir: Path, planned: dict[str, Any], lock: Path) -> JobReport:
    r = JobReport(run_dir.name, planned.get("language"), planned.get("config_id"),
                  planned.get("seed"))
    cfg = _run_config(RunLayout(run_dir).config)
    if cfg:
        data = cfg.get("data") or {}
        langs = data.get("languages") or [data.get("language")]
        r.language = r.language or (cfg.get("selection") or {}).get("language") or langs[0]
        r.config_id = r.config_id or cfg.get("config_id")
        r.seed = r.seed if r.seed is not None else cfg.get("seed")
    if run_dir.is_dir():
        r.disk_bytes = tree_bytes(run_dir)
    run = read_run(run_dir)
    r.evals, r.train_loss, r.saves = run["evals"], run["train"], run["saves"]
    logged = {s for s, _ in r.saves}
    # a process killed right after a save may not have logged it: the directory tells
    for step, d in RunLayout(run_dir).checkpoints.steps():
        if step not in logged and (d / "manifest.json").is_file():
            r.saves.append((step, "step"))
    begin, end = run["begin"], run["end"]
    steps = [e["step"] for e in r.evals] + [t[0] for t in r.train_loss]
    r.last_step = end["step"] if end else (max(steps) if steps else None)
    if end is not None:
        r.best_step = end.get("best_step")
    else:
        saved = [e["step"] for e in r.evals if e.get("save")]
        r.best_step = saved[-1] if saved else None
    start = [e for e in r.evals if e["step"] == 0]
    if start:
        r.start = {k: float(v) for k, v in start[-1].items()
                   if k in ("wer", "cer") and isinstance(v, int | float)}
    chosen = [e for e in r.evals if e["step"] == r.best_step]
    if chosen:
        e = chosen[-1]
        r.best = {k: e.get(k) for k in (*METRICS, "rep_trap_rate")}
        if e.get("longform_wer") is not None:
            r.best["longform_wer"] = e["longform_wer"]
        if isinstance(e.get("guard_wer"), int | float) and isinstance(e.get("guard_start"), int | float):
            # the forgetting guard: how much worse than the starting model (WER or drift)
            r.best["guard_change"] = e["guard_wer"] - e["guard_start"]
        r.chosen_by = e.get("reason")
    m = POLICY_RE.search((begin or {}).get("selection") or "")
    r.policy = m.group(1) if m else _policy_from_checkpoint(run_dir)

    try:
        marker = read_marker(run_dir)
    except UserError as e:  # a marker of the wrong kinds, as a record of them
        raise UnreadableRun(str(e)) from None
    if marker is not None:
        r.status, info = marker
        r.attempts, r.duration_s = info.get("attempts"), info.get("duration_s")
        if r.status == "failed":
            r.note = f"{info.get('reason', '')}\n{info.get('log_tail', '')}".strip()
    elif lock_is_held(lock):
        r.status = "running"
    elif (end is not None and end.get("status") in ("completed", "stopped")
          and not end.get("out_of_time")):
        r.status = "done"
    elif run["started"]:
        r.status = "interrupted"
    if end is not None and r.status != "failed":
        r.note = f"{end.get('status')}: {end.get('reason')}"
    return r


def _policy_from_checkpoint(run_dir: Path) -> str | None:
    try:
        return recorded_selection(RunLayout(run_dir).checkpoints.best).get("policy")
    except (OSError, ValueError):
        return None


# ---------------------------------------------------------------------------------------------
# Seed spread and before/after, per language × config


@dataclass
class GroupSummary:
    """One language × config: its jobs' best metrics over seeds."""

    language: str
    config_id: str
    jobs: list[JobReport]

    def values(self, metric: str) -> list[float]:
        """``metric`` of every job's selected checkpoint that has one (``delta``: its error rate
        minus the step-0 one, for jobs evaluated at step 0)."""
        out = []
        for r in self.jobs:
            v = r.delta() if metric == "delta" else r.best.get(metric)
            if isinstance(v, int | float) and v == v:
                out.append(float(v))
        return out

    def spread(self, metric: str) -> tuple[float, float | None, int] | None:
        """(mean, sample standard deviation or None for one seed, n)."""
        xs = self.values(metric)
        if not xs:
            return None
        return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else None), len(xs)

    def count(self, status: str) -> int:
        return sum(r.status == status for r in self.jobs)


def summarize(rows: list[JobReport]) -> list[GroupSummary]:
    """The jobs grouped by language × config (in the order they first appear)."""
    groups: dict[tuple[str, str], GroupSummary] = {}
    for r in rows:
        key = (r.language or "–", r.config_id or "–")
        groups.setdefault(key, GroupSummary(*key, jobs=[])).jobs.append(r)
    return list(groups.values())


# ---------------------------------------------------------------------------------------------
# HTML

PALETTE = ("#1f6fb2", "#e0532d", "#2a9d4b", "#8e44ad", "#c9a100", "#16a2b8", "#d63384",
           "#6c757d", "#7a4b1f", "#004c3f")

CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.4em}h2{font-size:1.15em;margin-top:1.6em}h3{font-size:1em;margin:.2em 0}
table{border-collapse:collapse;margin:.5em 0}
th,td{padding:3px 8px;border-bottom:1px solid #ddd;text-align:left;white-space:nowrap}
td.n{text-align:right;font-variant-numeric:tabular-nums}
table.sortable th{cursor:pointer;user-select:none;background:#f4f4f4;position:sticky;top:0}
table.sortable th[aria-sort=ascending]::after{content:" ▲"}
table.sortable th[aria-sort=descending]::after{content:" ▼"}
td.reason{white-space:normal;max-width:28em;font-size:.9em;color:#444}
td.better{color:#17743a}td.worse{color:#b3261e}
.st{padding:1px 6px;border-radius:8px;font-size:.85em}
.st-done{background:#d9f2dd}.st-failed{background:#f8d4d4}.st-running{background:#d8e6fb}
.st-interrupted{background:#fbecc8}.st-queued{background:#eee}.st-unreadable{background:#e9d6f2}
.counts span{margin-right:1.2em}
#filters{position:sticky;top:0;background:#fff;padding:.5em 0;border-bottom:1px solid #ccc;
  z-index:2;display:flex;gap:.8em;align-items:center;flex-wrap:wrap}
#filters input{width:18em}
.scroll{max-height:32em;overflow:auto;border:1px solid #eee}
details.lang{border-top:1px solid #ccc;padding:.4em 0}
details.lang summary{cursor:pointer;font-weight:600}
.plots{display:flex;flex-wrap:wrap;gap:10px;margin:.4em 0}
.legend span{margin-right:1em;font-size:.9em}
.legend i{display:inline-block;width:1.4em;height:3px;vertical-align:middle;margin-right:.3em}
svg.plot{background:#fcfcfc;border:1px solid #e4e4e4}
svg text{font-size:10px;fill:#555}
polyline.curve{fill:none;stroke-width:1.4;stroke-opacity:.85}
polyline.curve[data-series=train]{stroke-width:1;stroke-dasharray:3 2}
circle.best{stroke:#fff;stroke-width:1}
pre{background:#f6f6f6;padding:.5em;max-height:16em;overflow:auto;font-size:12px}
"""

JS = """
(function(){
  function key(td,num){var v=td.getAttribute('data-v');if(v===null||v==='')return null;
    return num?parseFloat(v):v.toLowerCase();}
  function sortBy(table,th){
    var col=Array.prototype.indexOf.call(th.parentNode.children,th);
    var num=th.getAttribute('data-type')==='num';
    var dir=th.getAttribute('aria-sort')==='ascending'?-1:1;
    Array.prototype.forEach.call(th.parentNode.children,function(h){
      h.removeAttribute('aria-sort');});
    th.setAttribute('aria-sort',dir===1?'ascending':'descending');
    var body=table.tBodies[0],rows=Array.prototype.slice.call(body.rows);
    rows.sort(function(a,b){
      var x=key(a.cells[col],num),y=key(b.cells[col],num);
      if(x===null&&y===null)return 0;if(x===null)return 1;if(y===null)return -1;
      return x<y?-dir:x>y?dir:0;});
    rows.forEach(function(r){body.appendChild(r);});
    table.setAttribute('data-sorted-by',th.getAttribute('data-key')+(dir===1?':asc':':desc'));
  }
  Array.prototype.forEach.call(document.querySelectorAll('table.sortable'),function(table){
    Array.prototype.forEach.call(table.tHead.rows[0].cells,function(th){
      th.addEventListener('click',function(){sortBy(table,th);});});});
  // Filters: free text over a row's words, and language / config / status selects. They hide
  // rows of both tables and whole language sections of the curves.
  var form=document.getElementById('filters');
  function field(name){return form.elements[name];}
  function apply(){
    var q=field('q').value.trim().toLowerCase().split(/\\s+/).filter(Boolean);
    var want={language:field('language').value,config:field('config').value,
              status:field('status').value};
    function keep(el,checkStatus){
      if(want.language&&el.getAttribute('data-language')!==want.language)return false;
      if(want.config&&el.getAttribute('data-config')!==want.config)return false;
      if(checkStatus&&want.status&&el.getAttribute('data-status')!==want.status)return false;
      var text=(el.getAttribute('data-search')||'');
      return q.every(function(w){return text.indexOf(w)>=0;});}
    var shown=0,total=0;
    Array.prototype.forEach.call(document.querySelectorAll('tr.job-row'),function(tr){
      var ok=keep(tr,true);tr.hidden=!ok;total++;if(ok)shown++;});
    var groups=0;
    Array.prototype.forEach.call(document.querySelectorAll('tr.group-row'),function(tr){
      var ok=keep(tr,false);tr.hidden=!ok;if(ok)groups++;});
    var langs={};
    Array.prototype.forEach.call(document.querySelectorAll('tr.job-row'),function(tr){
      if(!tr.hidden)langs[tr.getAttribute('data-language')]=1;});
    var sections=0;
    Array.prototype.forEach.call(document.querySelectorAll('details.lang'),function(d){
      var ok=langs.hasOwnProperty(d.getAttribute('data-language'));d.hidden=!ok;
      if(ok)sections++;});
    document.getElementById('shown').textContent=shown+' of '+total+' jobs shown';
    var root=document.documentElement;
    root.setAttribute('data-jobs-shown',String(shown));
    root.setAttribute('data-groups-shown',String(groups));
    root.setAttribute('data-sections-shown',String(sections));
  }
  form.addEventListener('input',apply);form.addEventListener('change',apply);
  form.addEventListener('submit',function(e){e.preventDefault();});
  // Test hooks and shareable views: ?q=&language=&config=&status= set the filters;
  // ?sort=wer,wer clicks those headers of the jobs table in turn; ?selftest records what
  // was drawn.
  var p=new URLSearchParams(location.search);
  ['q','language','config','status'].forEach(function(k){if(p.has(k))field(k).value=p.get(k);});
  apply();
  var jobs=document.getElementById('jobs');
  (p.get('sort')||'').split(',').filter(Boolean).forEach(function(k){
    var th=jobs.querySelector('th[data-key="'+k+'"]');if(th)th.click();});
  if(p.has('selftest')){
    var lines=document.querySelectorAll('svg polyline');
    var drawn=Array.prototype.filter.call(lines,function(l){return l.getTotalLength()>0;});
    document.documentElement.setAttribute('data-polylines-drawn',String(drawn.length));
  }
})();
"""

COLUMNS = [  # key, header, type
    ("job", "job", "text"), ("language", "language", "text"), ("config", "config", "text"),
    ("seed", "seed", "num"), ("status", "status", "text"), ("best_step", "best step", "num"),
    ("wer", "WER", "num"), ("delta", "Δ vs step 0", "num"), ("cer", "CER", "num"),
    ("longform_wer", "long-form WER", "num"), ("guard_change", "guard Δ", "num"),
    ("loss", "loss", "num"), ("rep_trap", "rep-trap", "num"), ("policy", "policy", "text"),
    ("chosen_by", "chosen by", "text"), ("steps", "steps", "num"),
    ("attempts", "attempts", "num"), ("time", "time", "num"), ("disk", "disk", "num"),
]

GROUP_COLUMNS = [
    ("language", "language", "text"), ("config", "config", "text"), ("seeds", "seeds", "num"),
    ("wer", "WER mean ± sd", "num"), ("start", "step-0 WER/CER", "num"),
    ("delta", "Δ mean ± sd", "num"), ("cer", "CER mean ± sd", "num"),
    ("longform_wer", "long-form WER mean ± sd", "num"),
    ("guard_change", "guard Δ mean ± sd", "num"), ("failed", "failed", "num"),
]


def _e(x: Any) -> str:
    return html.escape("" if x is None else str(x), quote=True)


def _num(v: Any, fmt: str) -> tuple[str, str]:
    """(sort value, shown text) of a number or None."""
    if not isinstance(v, int | float) or v != v:
        return "", "–"
    return repr(float(v)), format(v, fmt)


def _spread(s: tuple[float, float | None, int] | None, signed: bool = False) -> tuple[str, str]:
    """(sort value, shown text) of a (mean, sd, n) spread: ``0.1234 ± 0.0100``."""
    if s is None:
        return "", "–"
    mean, sd, _ = s
    shown = format(mean, "+.4f" if signed else ".4f")
    return repr(mean), shown + (f" ± {sd:.4f}" if sd is not None else "")


def _clock(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _filter_attrs(language: str | None, config: str | None, words: list[Any],
                  status: str | None = None) -> str:
    """The data-* attributes the page's filters read."""
    text = " ".join(str(w) for w in (language, config, status, *words) if w is not None).lower()
    attrs = f' data-language="{_e(language or "–")}" data-config="{_e(config or "–")}"'
    if status is not None:
        attrs += f' data-status="{_e(status)}"'
    return attrs + f' data-search="{_e(text)}"'


def _cells(cells: list[tuple[Any, str, str]]) -> str:
    # quoted: "n better" unquoted is class "n" and a stray attribute "better"
    return "".join(f'<td data-v="{_e(v)}"' + (f' class="{c}"' if c else "") + f">{shown}</td>"
                   for v, shown, c in cells)


def _delta_class(delta: float | None) -> str:
    """Colour a change of WER: lower is better."""
    if delta is None or delta != delta:
        return "n"
    return "n better" if delta < 0 else "n worse" if delta > 0 else "n"


def _row(r: JobReport) -> str:
    delta = r.delta()
    cells = [
        (r.job_id, f'<a href="#lang-{_e(r.language or "–")}">{_e(r.job_id)}</a>', ""),
        (r.language, _e(r.language or "–"), ""), (r.config_id, _e(r.config_id or "–"), ""),
        (*_num(r.seed, "d"), "n"),
        (f"{STATUS_ORDER.index(r.status)}{r.status}",  # sorts the failed first, done last
         f'<span class="st st-{_e(r.status)}">{_e(r.status)}</span>', ""),
        (*_num(r.best_step, "d"), "n"),
        (*_num(r.best.get("wer"), ".4f"), "n"), (*_num(delta, "+.4f"), _delta_class(delta)),
        (*_num(r.best.get("cer"), ".4f"), "n"),
        (*_num(r.best.get("longform_wer"), ".4f"), "n"),
        (*_num(r.best.get("guard_change"), "+.4f"), _delta_class(r.best.get("guard_change"))),
        (*_num(r.best.get("loss"), ".4f"), "n"), (*_num(r.best.get("rep_trap_rate"), ".1%"), "n"),
        (r.policy, _e(r.policy or "–"), ""), (r.chosen_by, _e(r.chosen_by or "–"), "reason"),
        (*_num(r.last_step, "d"), "n"), (*_num(r.attempts, "d"), "n"),
        (repr(float(r.duration_s)) if r.duration_s is not None else "", _clock(r.duration_s), "n"),
        (r.disk_bytes if r.disk_bytes is not None else "",
         format_gb(r.disk_bytes) if r.disk_bytes is not None else "–", "n"),
    ]
    attrs = _filter_attrs(r.language, r.config_id, [r.job_id, r.policy, r.chosen_by], r.status)
    return f'<tr class="job-row" data-job="{_e(r.job_id)}"{attrs}>{_cells(cells)}</tr>'


def _group_row(g: GroupSummary) -> str:
    delta = g.spread("delta")
    start = [r.start[r.metric] for r in g.jobs if r.metric in r.start]
    cells = [
        (g.language, _e(g.language), ""), (g.config_id, _e(g.config_id), ""),
        (len(g.jobs), f"{g.count('done')}/{len(g.jobs)} done", "n"),
        (*_spread(g.spread("wer")), "n"),
        (*_num(statistics.fmean(start) if start else None, ".4f"), "n"),
        (*_spread(delta, signed=True), _delta_class(delta[0] if delta else None)),
        (*_spread(g.spread("cer")), "n"), (*_spread(g.spread("longform_wer")), "n"),
        (*_spread(g.spread("guard_change"), signed=True), "n"),
        (g.count("failed"), str(g.count("failed")), "n"),
    ]
    attrs = _filter_attrs(g.language, g.config_id, [r.job_id for r in g.jobs])
    return f'<tr class="group-row"{attrs}>{_cells(cells)}</tr>'


def _plot(title: str, lines: list[tuple[str, str, list[tuple[int, float]], int | None]],
          max_step: int) -> str:
    """An SVG line plot of several runs: ``lines`` of (label, colour, [(step, value)], best
    step); the best step of each line gets a dot."""
    w, h, ml, mr, mt, mb = 330, 160, 44, 10, 18, 22
    pts = [(s, v) for _, _, xs, _ in lines for s, v in xs if isinstance(v, int | float) and v == v]
    head = f'<svg class="plot" data-metric="{_e(title)}" width="{w}" height="{h}" ' \
           f'viewBox="0 0 {w} {h}" xmlns="http://www.w3.org/2000/svg">' \
           f'<text x="{ml}" y="12">{_e(title)}</text>'
    if not pts:
        return head + f'<text x="{ml}" y="{h // 2}">no data</text></svg>'
    lo, hi = min(v for _, v in pts), max(v for _, v in pts)
    if hi - lo < 1e-12:
        lo, hi = lo - 0.5 * (abs(lo) or 1), hi + 0.5 * (abs(hi) or 1)
    xmax = max(max_step, max(s for s, _ in pts), 1)
    digits = 3 if f"{lo:.3g}" != f"{hi:.3g}" else 6  # enough digits to tell the two apart

    def xy(s: float, v: float) -> tuple[float, float]:
        return (ml + (w - ml - mr) * s / xmax, mt + (h - mt - mb) * (hi - v) / (hi - lo))

    parts = [head,
             f'<line x1="{ml}" y1="{h - mb}" x2="{w - mr}" y2="{h - mb}" stroke="#999"/>',
             f'<line x1="{ml}" y1="{mt}" x2="{ml}" y2="{h - mb}" stroke="#999"/>',
             f'<text x="{ml - 4}" y="{mt + 4}" text-anchor="end">{hi:.{digits}g}</text>',
             f'<text x="{ml - 4}" y="{h - mb}" text-anchor="end">{lo:.{digits}g}</text>',
             f'<text x="{ml}" y="{h - 6}">0</text>',
             f'<text x="{w - mr}" y="{h - 6}" text-anchor="end">step {xmax}</text>']
    for label, colour, xs, best in lines:
        good = sorted((s, v) for s, v in xs if isinstance(v, int | float) and v == v)
        if not good:
            continue
        coords = " ".join(f"{x:.1f},{y:.1f}" for x, y in (xy(s, v) for s, v in good))
        parts.append(f'<polyline class="curve" stroke="{colour}" points="{coords}">'
                     f"<title>{_e(label)}</title></polyline>")
        at = dict(good)
        # the selected checkpoint; a run of a single evaluation still shows as a dot
        for s in {best} & set(at) or ({good[0][0]} if len(good) == 1 else set()):
            x, y = xy(s, at[s])
            parts.append(f'<circle class="best" fill="{colour}" data-step="{s}" cx="{x:.1f}" '
                         f'cy="{y:.1f}" r="3"><title>{_e(label)}: step {s}</title></circle>')
    return "".join(parts) + "</svg>"


def _language_section(language: str, jobs: list[JobReport], colours: dict[str, str]) -> str:
    """Every job of one language overlaid: a curve per job, coloured by config."""
    max_step = max((r.last_step or 0 for r in jobs), default=0)

    def lines(metric: str) -> list[tuple[str, str, list[tuple[int, float]], int | None]]:
        out = []
        for r in jobs:
            xs = r.train_loss if metric == "train loss" else [(e["step"], e.get(metric))
                                                               for e in r.evals]
            best = None if metric == "train loss" else r.best_step
            out.append((f"{r.job_id} ({r.status})", colours.get(r.config_id or "–", "#555"),
                        xs, best))
        return out

    plots = "".join(_plot(m, lines(m), max_step) for m in (*METRICS, "train loss"))
    configs = sorted({r.config_id or "–" for r in jobs})
    legend = "".join(f'<span><i style="background:{colours.get(c, "#555")}"></i>{_e(c)}</span>'
                     for c in configs)
    notes = "".join(f"<div><b>{_e(r.job_id)}</b>: <pre>{_e(r.note)}</pre></div>"
                    for r in jobs if r.status in ("failed", "unreadable") and r.note)
    done = sum(r.status == "done" for r in jobs)
    return (f'<details class="lang" open id="lang-{_e(language)}" data-language="{_e(language)}">'
            f"<summary>{_e(language)} · {len(jobs)} jobs, {done} done</summary>"
            f'<div class="legend">{legend} (a line per job; dot: its selected checkpoint)</div>'
            f'<div class="plots">{plots}</div>{notes}</details>')


def _select(name: str, label: str, values: list[str]) -> str:
    options = "".join(f'<option value="{_e(v)}">{_e(v)}</option>' for v in values)
    return (f'<label>{_e(label)} <select name="{name}"><option value="">all</option>'
            f"{options}</select></label>")


def _table(table_id: str, columns: list[tuple[str, str, str]], rows: str) -> str:
    ths = "".join(f'<th data-key="{k}" data-type="{t}">{_e(label)}</th>'
                  for k, label, t in columns)
    return (f'<div class="scroll"><table id="{table_id}" class="sortable"><thead><tr>{ths}</tr>'
            f"</thead><tbody>{rows}</tbody></table></div>")


def render(rows: list[JobReport], title: str) -> str:
    """The whole page as one string."""
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.status] = counts.get(r.status, 0) + 1
    counts_html = "".join(f'<span class="st st-{s}">{s}: {counts[s]}</span>'
                          for s in reversed(STATUS_ORDER) if s in counts)
    languages = sorted({r.language or "–" for r in rows})
    configs = sorted({r.config_id or "–" for r in rows})
    colours = {c: PALETTE[i % len(PALETTE)] for i, c in enumerate(configs)}
    by_language: dict[str, list[JobReport]] = {}
    for r in rows:
        by_language.setdefault(r.language or "–", []).append(r)
    filters = (
        '<form id="filters"><label>search <input name="q" type="search" '
        'placeholder="job, language, config, reason…"></label>'
        f'{_select("language", "language", languages)}{_select("config", "config", configs)}'
        f'{_select("status", "status", [s for s in STATUS_ORDER if s in counts])}'
        '<span id="shown"></span></form>'
    )
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title>'
        f'<meta name="viewport" content="width=device-width"><style>{CSS}</style></head><body>'
        f"<h1>{_e(title)}</h1><p>{len(rows)} jobs · {len(languages)} languages · "
        f"{len(configs)} configs · "
        f"{_e(format_gb(sum(r.disk_bytes or 0 for r in rows)))} on disk · generated "
        f"{_e(time.strftime('%Y-%m-%d %H:%M:%S'))}</p><p class=counts>{counts_html}</p>"
        f"{filters}"
        "<h2>Language × config, over seeds</h2><p>Metrics of each job's selected (best) "
        "checkpoint: mean ± sample standard deviation over seeds. Δ is the selected "
        "checkpoint's error rate (WER; CER for languages written without spaces, as selection "
        "judges them) minus the same run's evaluation at step 0 (the starting model, "
        "<code>eval.at_start</code>), negative when fine-tuning helped; guard Δ is how much "
        "worse the forgetting guard's WER (or drift) is than the starting model's "
        "(<code>eval.guard</code>). Click a header to sort.</p>"
        f"{_table('groups', GROUP_COLUMNS, ''.join(_group_row(g) for g in summarize(rows)))}"
        "<h2>Jobs</h2><p>“chosen by” is the condition that selected the checkpoint.</p>"
        f"{_table('jobs', COLUMNS, ''.join(_row(r) for r in rows))}"
        "<h2>Curves by language</h2><p>Evaluation WER, CER and loss, and training loss, of "
        "every job of a language on one plot per metric, coloured by config.</p>"
        + "".join(_language_section(lang, by_language[lang], colours) for lang in languages)
        + f"<script>{JS}</script></body></html>"
    )


def write_report(runs_dir: Path, out: Path, *, title: str | None = None) -> list[JobReport]:
    """Collect ``runs_dir`` and write the page to ``out`` (atomically); returns the rows."""

    if not Path(runs_dir).is_dir():
        what = "not a directory" if Path(runs_dir).exists() else "no such directory"
        raise UserError(f"{runs_dir}: {what} (a matrix root, a directory of run dirs or a run)")
    rows = collect(Path(runs_dir))
    if not rows:
        raise UserError(f"{runs_dir}: no run there (a matrix root, a directory of run dirs or a run)")
    page = render(rows, title or f"asrforge report: {Path(runs_dir).resolve().name}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, page)
    return rows
