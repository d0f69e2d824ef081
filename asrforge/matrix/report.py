"""``asrforge report``: one self-contained HTML page of a matrix's runs.

Everything is inline (CSS, a little JS, SVG): the page opens from disk or an e-mail attachment.
It holds a sortable table of every job (language, config, seed, status, best step, WER, CER,
long-form WER, loss, rep-trap rate, selection policy and the condition that chose the best checkpoint), a
language × config grid of the best WER (mean over seeds), and per job the WER / CER / loss
curves against step with saved checkpoints marked.

Sources per run dir: ``metrics.jsonl`` (``train_begin`` / ``train`` / ``eval`` / ``save`` /
``train_end``; a resumed run's records after its resume step replace the crashed attempt's),
``eval/step-NNNNNN.jsonl`` summaries when metrics.jsonl has no evaluations, ``config.yaml``,
the launcher's ``DONE`` / ``FAILED`` markers, and the matrix root's ``matrix.json`` (jobs not
started yet) and ``claims/`` (jobs running now).
"""

from __future__ import annotations

import html
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from asrforge.checkpoint.disk import format_gb, tree_bytes
from asrforge.matrix.claims import lock_is_held, read_marker

METRICS = ("wer", "cer", "loss")
STATUS_ORDER = ("failed", "running", "interrupted", "queued", "done")
POLICY_RE = re.compile(r"→ (by_wer|by_loss|combined_gate)")


@dataclass
class JobReport:
    """What the page shows of one job."""

    job_id: str
    language: str | None = None
    config_id: str | None = None
    seed: int | None = None
    status: str = "queued"
    """``done``, ``failed``, ``running``, ``interrupted`` (started, nobody runs it now) or
    ``queued``."""
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
    """Why it failed / how it ended, and for a failed job the tail of its log."""


def read_run(run_dir: Path) -> dict[str, Any]:
    """Parse ``metrics.jsonl``: evals, train losses, saves, the last train_begin / train_end.

    A ``train_begin`` at step s (a resume) drops the records of earlier attempts after s: those
    steps were trained again, and the curve shows the run that produced the checkpoints.
    """
    evals: list[dict[str, Any]] = []
    train: list[tuple[int, float]] = []
    saves: list[tuple[int, str]] = []
    begin = end = None
    path = run_dir / "metrics.jsonl"
    lines = []
    if path.is_file():
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line cut by a crash
        event, step = rec.get("event"), rec.get("step")
        if event == "train_begin":
            s = step or 0
            evals = [e for e in evals if e["step"] <= s]
            train = [t for t in train if t[0] <= s]
            saves = [v for v in saves if v[0] <= s]
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
        for f in sorted((run_dir / "eval").glob("step-*.jsonl")):
            last = f.read_text(encoding="utf-8", errors="replace").strip().rsplit("\n", 1)[-1]
            try:
                rec = json.loads(last)
            except ValueError:
                continue
            if rec.get("summary"):
                evals.append(rec)
    return {"evals": evals, "train": train, "saves": saves, "begin": begin, "end": end,
            "started": bool(lines)}


def collect(runs_dir: Path) -> list[JobReport]:
    """Every job under ``runs_dir`` (a matrix root, or a directory of run dirs)."""
    runs_dir = Path(runs_dir)
    if (runs_dir / "runs").is_dir():
        root, runs = runs_dir, runs_dir / "runs"
    else:
        root, runs = runs_dir.parent, runs_dir
    planned: dict[str, dict[str, Any]] = {}
    index = root / "matrix.json"
    if index.is_file():
        try:
            planned = {j["job_id"]: j for j in json.loads(index.read_text())["jobs"]}
        except (ValueError, KeyError, TypeError):
            planned = {}
    signs = ("config.yaml", "metrics.jsonl", "DONE", "FAILED")
    found = sorted(
        d.name for d in runs.iterdir() if d.is_dir() and any((d / n).exists() for n in signs)
    ) if runs.is_dir() else []
    ids = list(planned) + [i for i in found if i not in planned]
    return [_job(runs / i, planned.get(i, {}), root / "claims" / f"{i}.lock") for i in ids]


def _job(run_dir: Path, planned: dict[str, Any], lock: Path) -> JobReport:
    r = JobReport(run_dir.name, planned.get("language"), planned.get("config_id"),
                  planned.get("seed"))
    cfg_path = run_dir / "config.yaml"
    if cfg_path.is_file():
        try:
            cfg = yaml.safe_load(cfg_path.read_text()) or {}
        except yaml.YAMLError:
            cfg = {}
        langs = (cfg.get("data") or {}).get("languages") or [None]
        r.language = r.language or (cfg.get("selection") or {}).get("language") or langs[0]
        r.config_id = r.config_id or cfg.get("config_id")
        r.seed = r.seed if r.seed is not None else cfg.get("seed")
    if run_dir.is_dir():
        r.disk_bytes = tree_bytes(run_dir)
    run = read_run(run_dir)
    r.evals, r.train_loss, r.saves = run["evals"], run["train"], run["saves"]
    logged = {s for s, _ in r.saves}
    # a process killed right after a save may not have logged it: the directory tells
    for d in (run_dir / "checkpoints").glob("step-*"):
        step = int(d.name[5:]) if d.name[5:].isdigit() else None
        if step is not None and step not in logged and (d / "manifest.json").is_file():
            r.saves.append((step, "step"))
    begin, end = run["begin"], run["end"]
    steps = [e["step"] for e in r.evals] + [t[0] for t in r.train_loss]
    r.last_step = end["step"] if end else (max(steps) if steps else None)
    if end is not None:
        r.best_step = end.get("best_step")
    else:
        saved = [e["step"] for e in r.evals if e.get("save")]
        r.best_step = saved[-1] if saved else None
    chosen = [e for e in r.evals if e["step"] == r.best_step]
    if chosen:
        e = chosen[-1]
        r.best = {k: e.get(k) for k in (*METRICS, "rep_trap_rate")}
        if e.get("longform_wer") is not None:
            r.best["longform_wer"] = e["longform_wer"]
        r.chosen_by = e.get("reason")
    m = POLICY_RE.search((begin or {}).get("selection") or "")
    r.policy = m.group(1) if m else _policy_from_checkpoint(run_dir)

    marker = read_marker(run_dir)
    if marker is not None:
        r.status, info = marker
        r.attempts, r.duration_s = info.get("attempts"), info.get("duration_s")
        if r.status == "failed":
            r.note = f"{info.get('reason', '')}\n{info.get('log_tail', '')}".strip()
    elif lock_is_held(lock):
        r.status = "running"
    elif end is not None and end.get("status") in ("completed", "stopped"):
        r.status = "done"
    elif run["started"]:
        r.status = "interrupted"
    if end is not None and r.status != "failed":
        r.note = f"{end.get('status')}: {end.get('reason')}"
    return r


def _policy_from_checkpoint(run_dir: Path) -> str | None:
    try:
        state = json.loads((run_dir / "checkpoints" / "best" / "train_state.json").read_text())
        return (state.get("selection") or {}).get("policy")
    except (OSError, ValueError):
        return None


# ---------------------------------------------------------------------------------------------
# HTML

CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.4em}h2{font-size:1.15em;margin-top:1.6em}h3{font-size:1em;margin:.2em 0}
table{border-collapse:collapse;margin:.5em 0}
th,td{padding:3px 8px;border-bottom:1px solid #ddd;text-align:left;white-space:nowrap}
td.n{text-align:right;font-variant-numeric:tabular-nums}
#jobs th{cursor:pointer;user-select:none;background:#f4f4f4;position:sticky;top:0}
#jobs th[aria-sort=ascending]::after{content:" ▲"}
#jobs th[aria-sort=descending]::after{content:" ▼"}
td.reason{white-space:normal;max-width:28em;font-size:.9em;color:#444}
.st{padding:1px 6px;border-radius:8px;font-size:.85em}
.st-done{background:#d9f2dd}.st-failed{background:#f8d4d4}.st-running{background:#d8e6fb}
.st-interrupted{background:#fbecc8}.st-queued{background:#eee}
.counts span{margin-right:1.2em}
.job{border-top:1px solid #ccc;padding:.6em 0}
.plots{display:flex;flex-wrap:wrap;gap:10px}
svg.plot{background:#fcfcfc;border:1px solid #e4e4e4}
svg text{font-size:10px;fill:#555}
polyline.curve{fill:none;stroke:#1f6fb2;stroke-width:1.6}
polyline.curve[data-series=train]{stroke:#b9b9b9;stroke-width:1;stroke-dasharray:3 2}
circle.point{fill:#1f6fb2}circle.save{fill:#fff;stroke:#1f6fb2;stroke-width:1.4}
circle.best{fill:#e0532d;stroke:#e0532d}
pre{background:#f6f6f6;padding:.5em;max-height:16em;overflow:auto;font-size:12px}
.grid td{text-align:center}
"""

JS = """
(function(){
  var table=document.getElementById('jobs');
  function key(td,num){var v=td.getAttribute('data-v');if(v===null||v==='')return null;
    return num?parseFloat(v):v.toLowerCase();}
  function sortBy(th){
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
  Array.prototype.forEach.call(table.tHead.rows[0].cells,function(th){
    th.addEventListener('click',function(){sortBy(th);});});
  // Test hook: ?sort=wer,wer clicks those headers in turn; ?selftest records what was drawn.
  var q=new URLSearchParams(location.search);
  (q.get('sort')||'').split(',').filter(Boolean).forEach(function(k){
    var th=table.querySelector('th[data-key="'+k+'"]');if(th)th.click();});
  if(q.has('selftest')){
    var lines=document.querySelectorAll('svg polyline');
    var drawn=Array.prototype.filter.call(lines,function(p){return p.getTotalLength()>0;});
    document.documentElement.setAttribute('data-polylines-drawn',String(drawn.length));
  }
})();
"""

COLUMNS = [  # key, header, type
    ("job", "job", "text"), ("language", "language", "text"), ("config", "config", "text"),
    ("seed", "seed", "num"), ("status", "status", "text"), ("best_step", "best step", "num"),
    ("wer", "WER", "num"), ("cer", "CER", "num"), ("longform_wer", "long-form WER", "num"),
    ("loss", "loss", "num"), ("rep_trap", "rep-trap", "num"), ("policy", "policy", "text"),
    ("chosen_by", "chosen by", "text"), ("steps", "steps", "num"),
    ("attempts", "attempts", "num"), ("time", "time", "num"), ("disk", "disk", "num"),
]


def _e(x: Any) -> str:
    return html.escape("" if x is None else str(x), quote=True)


def _num(v: Any, fmt: str) -> tuple[str, str]:
    """(sort value, shown text) of a number or None."""
    if not isinstance(v, int | float) or v != v:
        return "", "–"
    return repr(float(v)), format(v, fmt)


def _clock(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _row(r: JobReport) -> str:
    cells = [
        (r.job_id, f'<a href="#job-{_e(r.job_id)}">{_e(r.job_id)}</a>', ""),
        (r.language, _e(r.language or "–"), ""), (r.config_id, _e(r.config_id or "–"), ""),
        (*_num(r.seed, "d"), "n"),
        (f"{STATUS_ORDER.index(r.status)}{r.status}",  # sorts the failed first, done last
         f'<span class="st st-{_e(r.status)}">{_e(r.status)}</span>', ""),
        (*_num(r.best_step, "d"), "n"),
        (*_num(r.best.get("wer"), ".4f"), "n"), (*_num(r.best.get("cer"), ".4f"), "n"),
        (*_num(r.best.get("longform_wer"), ".4f"), "n"),
        (*_num(r.best.get("loss"), ".4f"), "n"), (*_num(r.best.get("rep_trap_rate"), ".1%"), "n"),
        (r.policy, _e(r.policy or "–"), ""), (r.chosen_by, _e(r.chosen_by or "–"), "reason"),
        (*_num(r.last_step, "d"), "n"), (*_num(r.attempts, "d"), "n"),
        (repr(float(r.duration_s)) if r.duration_s is not None else "", _clock(r.duration_s), "n"),
        (r.disk_bytes if r.disk_bytes is not None else "",
         format_gb(r.disk_bytes) if r.disk_bytes is not None else "–", "n"),
    ]
    tds = "".join(f'<td data-v="{_e(v)}"{f" class={c}" if c else ""}>{shown}</td>'
                  for v, shown, c in cells)
    return f'<tr class="job-row" data-job="{_e(r.job_id)}">{tds}</tr>'


def _plot(title: str, series: list[tuple[str, list[tuple[int, float]]]], saves: list[int],
          best: int | None, max_step: int) -> str:
    """An SVG line plot: ``series`` of (name, [(step, value)]); circles at saved steps on the
    first series (the best one filled)."""
    w, h, ml, mr, mt, mb = 300, 150, 44, 10, 18, 22
    pts = [(s, v) for _, xs in series for s, v in xs if isinstance(v, int | float) and v == v]
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
    for name, xs in reversed(series):  # the first series on top
        good = [(s, v) for s, v in xs if isinstance(v, int | float) and v == v]
        if good:
            coords = " ".join(f"{x:.1f},{y:.1f}" for x, y in (xy(s, v) for s, v in good))
            parts.append(f'<polyline class="curve" data-series="{_e(name)}" points="{coords}"/>')
            if len(good) == 1:  # a line of one point is invisible
                x, y = xy(*good[0])
                parts.append(f'<circle class="point" cx="{x:.1f}" cy="{y:.1f}" r="2"/>')
    main = dict(series[0][1])
    for s in sorted(set(saves)):
        if s in main and main[s] == main[s]:
            x, y = xy(s, main[s])
        else:
            x, y = xy(s, lo)
        cls = "best" if s == best else "save"
        parts.append(f'<circle class="{cls}" data-step="{s}" cx="{x:.1f}" cy="{y:.1f}" '
                     f'r="{4 if cls == "best" else 3}"><title>checkpoint step {s}'
                     f'{" (best)" if cls == "best" else ""}</title></circle>')
    return "".join(parts) + "</svg>"


def _job_section(r: JobReport) -> str:
    max_step = r.last_step or 0
    saves = [s for s, _ in r.saves]
    plots = [
        _plot(m, [("eval", [(e["step"], e.get(m)) for e in r.evals])]
              + ([("train", r.train_loss)] if m == "loss" else []), saves, r.best_step, max_step)
        for m in METRICS
    ]
    facts = (f"{_e(r.language)} · {_e(r.config_id)} · seed {_e(r.seed)} · "
             f'<span class="st st-{_e(r.status)}">{_e(r.status)}</span> · policy {_e(r.policy)}'
             f" · best step {_e(r.best_step)} · checkpoints at "
             f"{_e(', '.join(map(str, sorted(set(saves)))) or '–')}")
    note = f"<pre>{_e(r.note)}</pre>" if r.note and r.status == "failed" else (
        f"<div>{_e(r.note)}</div>" if r.note else "")
    return (f'<section class="job" id="job-{_e(r.job_id)}"><h3>{_e(r.job_id)}</h3>'
            f"<div>{facts}</div>{note}<div class=plots>{''.join(plots)}</div></section>")


def _grid(rows: list[JobReport]) -> str:
    """Language × config: mean best WER over seeds (and how many seeds have one)."""
    langs = sorted({r.language for r in rows if r.language})
    cfgs = sorted({r.config_id for r in rows if r.config_id})
    if not langs or not cfgs:
        return ""
    head = "".join(f"<th>{_e(c)}</th>" for c in cfgs)
    body = []
    for lang in langs:
        cells = []
        for c in cfgs:
            wers = [r.best.get("wer") for r in rows if r.language == lang and r.config_id == c]
            got = [w for w in wers if isinstance(w, int | float)]
            text = f"{sum(got) / len(got):.4f} ({len(got)}/{len(wers)})" if got else "–"
            cells.append(f"<td>{text}</td>")
        body.append(f"<tr><th>{_e(lang)}</th>{''.join(cells)}</tr>")
    return (f'<h2>Best WER by language × config</h2><table class="grid"><tr><th></th>{head}</tr>'
            f"{''.join(body)}</table>")


def render(rows: list[JobReport], title: str) -> str:
    """The whole page as one string."""
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.status] = counts.get(r.status, 0) + 1
    counts_html = "".join(f'<span class="st st-{s}">{s}: {counts[s]}</span>'
                          for s in reversed(STATUS_ORDER) if s in counts)
    ths = "".join(f'<th data-key="{k}" data-type="{t}">{_e(label)}</th>'
                  for k, label, t in COLUMNS)
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title>'
        f'<meta name="viewport" content="width=device-width"><style>{CSS}</style></head><body>'
        f"<h1>{_e(title)}</h1><p>{len(rows)} jobs · "
        f"{_e(format_gb(sum(r.disk_bytes or 0 for r in rows)))} on disk · generated "
        f"{_e(time.strftime('%Y-%m-%d %H:%M:%S'))}</p><p class=counts>{counts_html}</p>"
        f'<h2>Jobs</h2><p>Click a header to sort. WER, CER, loss and rep-trap rate are those of '
        f"the selected (best) checkpoint's evaluation; “chosen by” is the condition that "
        f"selected it.</p>"
        f'<table id="jobs"><thead><tr>{ths}</tr></thead><tbody>'
        f"{''.join(_row(r) for r in rows)}</tbody></table>"
        f"{_grid(rows)}<h2>Curves</h2><p>Blue: evaluation; grey dashes: training loss; circles: "
        f"saved checkpoints, the filled one selected.</p>"
        f"{''.join(_job_section(r) for r in rows)}<script>{JS}</script></body></html>"
    )


def write_report(runs_dir: Path, out: Path, *, title: str | None = None) -> list[JobReport]:
    """Collect ``runs_dir`` and write the page to ``out``; returns the rows."""
    from asrforge.errors import UserError

    if not Path(runs_dir).is_dir():
        raise UserError(f"{runs_dir}: no such directory")
    rows = collect(Path(runs_dir))
    page = render(rows, title or f"asrforge report: {Path(runs_dir).resolve().name}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")
    return rows
