"""``asrforge report``: one self-contained HTML page of a matrix's runs."""

from __future__ import annotations

from pathlib import Path

from asrforge.errors import UserError
from asrforge.io.atomic import file_target_problem
from asrforge.matrix.report import write_report


def add_parser(sub) -> None:
    """Register ``report``."""
    r = sub.add_parser(
        "report",
        help="one self-contained HTML page of a matrix's runs",
        description="Write one HTML page (no external resources): a sortable table of every job "
                    "and each job's WER / CER / loss curves with its checkpoints marked.",
    )
    r.add_argument(
        "runs_dir", help="a matrix root, a directory of run directories, or one run directory"
    )
    r.add_argument("--out", default="report.html", help="the HTML file (default report.html)")
    r.add_argument("--title", default=None, help="the page title")
    r.set_defaults(func=run)


def run(args) -> int:
    # before the runs are read: a page that cannot be written is said at once
    if problem := file_target_problem(Path(args.out)):
        raise UserError(f"--out {problem}")
    rows = write_report(Path(args.runs_dir), Path(args.out), title=args.title)
    print(f"asrforge: report of {len(rows)} job(s) written to {args.out}")
    return 0
