"""A matrix whose configs are drawn: one Optuna study per language, each trial an ordinary
matrix job (claimed, resumed, retried, continued and reported like any other).

The launcher asks this module for new jobs when a device is free (:meth:`Search.draw`), shows it
each running trial's new evaluations (:meth:`Search.should_stop_early`: Optuna's pruner decides
on the trial's own evaluation metric, and the launcher stops the run, which saves a checkpoint
as on any signal), and tells it how each trial ended. The studies live in journal files under
``<root>/search/`` (Optuna's file journal, locked for several launchers), so a launch again
carries on the same studies: a trial left running by a launcher that died is run again from
its checkpoint, with the values it was drawn with. The journal is a file like any other: a trial
it holds is run again only when its values are names and values of ``search.space``; any other is
refused by name (told the study as failed) and never run.

How it works: docs/matrix.md, "Search".
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asrforge.errors import UserError
from asrforge.io.atomic import atomic_write_text
from asrforge.io.locks import exclusive
from asrforge.io.small_files import RECORDS_BYTES, open_regular
from asrforge.matrix.claims import read_marker
from asrforge.matrix.plan import Job, Plan, SearchConfig
from asrforge.run_layout import RunLayout, step_record

log = logging.getLogger("asrforge.matrix")

SUMMARY_FILE = "search.json"
"""Every study's trials and best, under the matrix root (:meth:`Search.write_summary`)."""
SUMMARY_LOCK = "search.json.lock"
"""Under ``<root>/search/``: held while ``search.json`` is read from the journals and written."""


@dataclass
class Trial:
    """A drawn trial and the job that runs it."""

    language: str
    number: int
    trial: Any
    """Optuna's ``Trial`` (ask-and-tell)."""
    job: Job
    metrics_read: int = 0
    """Bytes of the run's ``metrics.jsonl`` already shown to the pruner."""
    metrics_file: tuple[int, int] | None = None
    """The (device, inode) of the ``metrics.jsonl`` those bytes are of: a resume replaces the
    file, cut back to its checkpoint's step."""
    reported_step: int = 0
    """The last step whose evaluation the pruner was shown."""


class Search:
    """The studies of a plan with a search, one per language of the plan."""

    def __init__(self, plan: Plan):
        if plan.search is None:
            raise ValueError("the plan has no search")
        self.plan, self.spec = plan, plan.search
        # optuna is an optional extra, loaded only for a matrix with a search
        try:
            import optuna
        except ImportError:
            raise UserError("search: needs optuna: pip install 'asrforge[search]'") from None
        self.optuna = optuna
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.base = {job.language: job for job in plan.base}
        self.distributions = {key: _distribution(optuna, p) for key, p in self.spec.space.items()}
        directory = plan.root / "search"
        directory.mkdir(parents=True, exist_ok=True)
        self.studies = {language: self._study(directory, language) for language in self.base}
        self.trials: dict[str, Trial] = {}

    def _study(self, directory: Path, language: str):
        journal = self.optuna.storages.journal
        path = str(directory / f"{language}.journal")
        storage = journal.JournalStorage(
            journal.JournalFileBackend(path, lock_obj=journal.JournalFileOpenLock(path))
        )
        return self.optuna.create_study(
            study_name=language,
            storage=storage,
            direction=self.spec.direction,
            sampler=self.optuna.samplers.TPESampler(seed=self.spec.sampler_seed),
            pruner=_pruner(self.optuna, self.spec),
            load_if_exists=True,
        )

    # ------------------------------------------------------------------------------------------
    def left_running(self) -> list[Job]:
        """The trials an earlier launch left running: their jobs, to resume with the values they
        were drawn with. A trial whose run has its result marker is told that result now."""
        jobs = []
        for language, study in self.studies.items():
            for frozen in study.get_trials(deepcopy=False):
                if frozen.state != self.optuna.trial.TrialState.RUNNING:
                    continue
                problem = self.outside_space(frozen.params)
                if problem is not None:
                    log.warning("search %s: trial %d refused, not run: %s (the journal %s holds "
                                "values search.space does not draw)", language, frozen.number,
                                problem, self.plan.root / "search" / f"{language}.journal")
                    study.tell(frozen.number, state=self.optuna.trial.TrialState.FAIL)
                    continue
                trial = Trial(language, frozen.number, self.optuna.trial.Trial(study, frozen._trial_id),
                              self._job(language, frozen.number, frozen.params))  # fmt: skip
                self.trials[trial.job.job_id] = trial
                marker = read_marker(self.plan.run_dir(trial.job))
                if marker is None:
                    jobs.append(trial.job)
                elif marker[0] == "failed":
                    self.failed(trial.job)
                elif marker[1].get("status") == "pruned":
                    self.stopped_early(trial.job)
                else:
                    self.done(trial.job, {"best": marker[1].get("best")})
        return jobs

    def outside_space(self, params: dict[str, Any]) -> str | None:
        """Why ``params`` (a trial's values, as a journal holds them) are not a draw of
        ``search.space``: a name it lacks or does not have, a value of another type, outside its
        range or step, or not one of its choices; None when they are a draw."""
        names, space = set(params), self.spec.space
        if names != set(space):
            extra, missing = sorted(names - set(space)), sorted(set(space) - names)
            return "; ".join(
                [f"{', '.join(extra)}: not in search.space"] * bool(extra)
                + [f"{', '.join(missing)}: no value drawn"] * bool(missing)
            )
        for name, value in params.items():
            p = space[name]
            if p.choices is not None:
                if not any(type(c) is type(value) and c == value for c in p.choices):
                    return f"{name}: {value!r} is not one of search.space's choices {p.choices}"
                continue
            number = isinstance(value, int | float) and not isinstance(value, bool)
            if not number or not math.isfinite(value) or not p.low <= value <= p.high:
                return f"{name}: {value!r} is outside search.space ({p.low} to {p.high})"
            integers = isinstance(self.distributions[name],
                                  self.optuna.distributions.IntDistribution)
            if integers and not isinstance(value, int):
                return f"{name}: {value!r} is not an integer, as search.space draws"
            steps = (value - p.low) / p.step if p.step else 0
            if abs(steps - round(steps)) > 1e-8:
                return f"{name}: {value!r} is not on search.space's step {p.step} from {p.low}"
        return None

    def draw(self, n: int) -> list[Job]:
        """Up to ``n`` new trials, one language after another, while a study has fewer than
        ``search.trials`` (running ones counted, this launcher's and others')."""
        jobs: list[Job] = []
        while len(jobs) < n:
            open_studies = [
                (lang, s) for lang, s in self.studies.items() if len(s.trials) < self.spec.trials
            ]
            if not open_studies:
                break
            for language, study in open_studies[: n - len(jobs)]:
                try:
                    trial = study.ask(self.distributions)
                except ValueError as e:  # optuna: a trial of the journal has another kind
                    raise UserError(
                        f"{self.plan.root / 'search' / f'{language}.journal'}: {e} (the journal "
                        "holds trials of another search.space: move it aside to start afresh)"
                    ) from None
                job = self._job(language, trial.number, trial.params)
                self.trials[job.job_id] = Trial(language, trial.number, trial, job)
                jobs.append(job)
                log.info(
                    "search %s: trial %d draws %s", language, trial.number, _values(trial.params)
                )
        return jobs

    def exhausted(self) -> bool:
        """Whether every study has drawn all its trials."""
        return all(len(s.trials) >= self.spec.trials for s in self.studies.values())

    def drawn(self) -> list[Job]:
        """The job of every trial of the studies, this launch's and earlier ones'."""
        return [self._job(language, t.number, t.params)
                for language, study in self.studies.items()
                for t in study.get_trials(deepcopy=False)]  # fmt: skip

    def _job(self, language: str, number: int, params: dict[str, Any]) -> Job:
        return self.plan.trial(self.base[language], number, params)

    # ------------------------------------------------------------------------------------------
    def should_stop_early(self, job: Job) -> bool:
        """Show the pruner the trial's evaluations since the last call; whether it stops the
        trial now."""
        trial = self.trials.get(job.job_id)
        if trial is None or self.spec.pruner.kind == "none":
            return False
        path = RunLayout(self.plan.run_dir(job)).metrics
        try:
            with open(open_regular(path), "rb") as f:
                st = os.fstat(f.fileno())
                # a file replaced since the last read is read again from its start
                if (st.st_dev, st.st_ino) != trial.metrics_file or st.st_size < trial.metrics_read:
                    trial.metrics_file, trial.metrics_read = (st.st_dev, st.st_ino), 0
                f.seek(trial.metrics_read)
                # the pruner sees no more of a file than the report reads whole
                data = f.read(max(0, RECORDS_BYTES - trial.metrics_read))
        except (OSError, ValueError):
            return False
        # only whole lines: the run may be writing the last one
        whole = data[: data.rfind(b"\n") + 1]
        trial.metrics_read += len(whole)
        reported = False
        for line in whole.decode("utf-8", errors="replace").splitlines():
            try:
                record = step_record(line)
            except ValueError:
                continue
            if record is None:
                continue
            value, step = record.get(self.spec.metric), record["step"]
            # a step reported before (a resumed run's replayed ones too) is not again: Optuna
            # refuses a step twice
            if (
                record.get("event") == "eval"
                and step > trial.reported_step
                and isinstance(value, int | float)
            ):
                trial.trial.report(float(value), step)
                trial.reported_step, reported = step, True
        return reported and trial.trial.should_prune()

    def done(self, job: Job, end: dict[str, Any]) -> str:
        """Tell the study the trial's value (its best checkpoint's metric); the line to say."""
        trial = self.trials.pop(job.job_id)
        study = self.studies[trial.language]
        value = (end.get("best") or {}).get(self.spec.metric)
        if not isinstance(value, int | float):
            study.tell(trial.trial, state=self.optuna.trial.TrialState.FAIL)
            return (
                f"search {trial.language}: trial {trial.number} has no {self.spec.metric}: failed"
            )
        study.tell(trial.trial, float(value))
        best = study.best_trial
        return (f"search {trial.language}: trial {trial.number} {self.spec.metric} {value:.4g}; best "
                f"so far trial {best.number} {best.value:.4g} ({_values(best.params)})")  # fmt: skip

    def stopped_early(self, job: Job) -> None:
        trial = self.trials.pop(job.job_id)
        self.studies[trial.language].tell(trial.trial, state=self.optuna.trial.TrialState.PRUNED)

    def failed(self, job: Job) -> None:
        trial = self.trials.pop(job.job_id)
        self.studies[trial.language].tell(trial.trial, state=self.optuna.trial.TrialState.FAIL)

    def summary(self) -> dict[str, Any]:
        """Every study's trials (number, state, value, values drawn, run dir) and best trial."""
        out: dict[str, Any] = {}
        for language, study in self.studies.items():
            trials = [{"number": t.number, "state": t.state.name.lower(), "value": t.value,
                       "params": t.params,
                       "run_dir": str(self.plan.run_dir(self._job(language, t.number, t.params)))}
                      for t in study.get_trials(deepcopy=False)]  # fmt: skip
            complete = [t for t in trials if t["state"] == "complete"]
            best = study.best_trial if complete else None
            out[language] = {"metric": self.spec.metric, "direction": self.spec.direction,
                             "best": None if best is None else best.number, "trials": trials}  # fmt: skip
        return out


    def write_summary(self) -> dict[str, Any]:
        """Write ``<root>/search.json`` (:meth:`summary`) and return it. The studies are read
        and the file written under one lock: launchers sharing the root write in turn, each
        what the journals hold as it writes, so the last write is never an older reading."""
        root = self.plan.root
        with exclusive(root / "search" / SUMMARY_LOCK):
            summary = self.summary()
            atomic_write_text(root / SUMMARY_FILE, json.dumps(summary, indent=1) + "\n")
        return summary


def _distribution(optuna, p):
    if p.choices is not None:
        return optuna.distributions.CategoricalDistribution(p.choices)
    if isinstance(p.low, int) and isinstance(p.high, int) and not isinstance(p.step, float):
        return optuna.distributions.IntDistribution(p.low, p.high, log=p.log, step=p.step or 1)
    return optuna.distributions.FloatDistribution(p.low, p.high, log=p.log, step=p.step)


def _pruner(optuna, spec: SearchConfig):
    kind = spec.pruner.kind
    if kind == "median":
        return optuna.pruners.MedianPruner(
            n_startup_trials=spec.pruner.startup_trials, n_warmup_steps=spec.pruner.warmup_steps
        )
    if kind == "hyperband":
        return optuna.pruners.HyperbandPruner()
    return optuna.pruners.NopPruner()


def _values(params: dict[str, Any]) -> str:
    return ", ".join(
        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items()
    )
