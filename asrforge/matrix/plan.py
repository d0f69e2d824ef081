"""The MATRIX.yaml schema and its expansion into jobs (language × config × seed).

How it works: docs/matrix.md, "The MATRIX.yaml file and its jobs (`matrix/plan.py`)".
"""

from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError

from asrforge.config import (
    ALLOW_EXTERNAL_ENV,
    ALLOW_EXTERNAL_HINT,
    ConfigError,
    Section,
    format_errors,
    huge_integers,
    load_config,
    read_yaml_mapping,
)
from asrforge.errors import UserError
from asrforge.io.atomic import directory_problem
from asrforge.matrix.problems import JobProblems, origin
from asrforge.text.languages import config_language_problems

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$"
Overrides = list[str] | dict[str, Any]
FILE_PERMISSION = "allow_external_callbacks"
MAX_GPUS_PER_JOB = 64
"""A job runs on one machine (one SLURM node): no machine holds more devices."""
SLURM_DIR = "slurm"
"""Under the matrix root: the SLURM executor's directory, one directory in it per launch."""
"""A key older matrix files held: refused by name, since a file may not permit imports."""


class ConfigEntry(Section):
    """One training config of the matrix."""

    config_id: str = Field(pattern=NAME_PATTERN)
    """The config's name in job ids and reports (letters, digits, ``_.+-``)."""
    path: Path
    """The training YAML (relative to the working directory, like every path in a config)."""
    overrides: Overrides = Field(default_factory=list)
    """``dotted.key=value`` strings, or a mapping ``{dotted.key: value}``, for this config."""


class SearchParameter(Section):
    """One config value a search draws: a range (``low`` to ``high``; integers when both are
    integers) or a list of ``choices``."""

    low: int | float | None = None
    """The range's lowest value."""
    high: int | float | None = None
    """The range's highest value."""
    log: bool = False
    """Draw on a log scale (a learning rate), ``low`` > 0."""
    step: int | float | None = None
    """Draw only ``low``, ``low + step``, ... (not with ``log``)."""
    choices: list[Any] | None = None
    """The values to draw from, instead of a range."""


class PrunerConfig(Section):
    """When a trial is stopped early, on its own evaluations against the other trials'."""

    kind: Literal["median", "hyperband", "none"] = "median"
    """``median``: stop a trial whose evaluation is worse than the median of earlier trials at the
    same step (Optuna's MedianPruner); ``hyperband``: Optuna's HyperbandPruner over the training
    steps; ``none``: every trial runs to its end."""
    startup_trials: int = Field(default=3, ge=0)
    """``median``: trials that end before any is stopped early."""
    warmup_steps: int = Field(default=0, ge=0)
    """``median``: training steps before a trial may be stopped early."""


class SearchConfig(Section):
    """Configs drawn, not listed: for each language, ``trials`` runs of the matrix's one config,
    each with values drawn from ``space`` by Optuna's TPE sampler."""

    trials: int = Field(gt=0)
    """Trials per language (every trial is an ordinary run: it resumes, retries and is
    reported like any matrix job)."""
    space: dict[str, SearchParameter] = Field(min_length=1)
    """``dotted.key: {low, high[, log | step]}`` or ``dotted.key: {choices: [...]}``."""
    metric: str = "wer"
    """The evaluation metric a trial is judged by: its best checkpoint's value, and each
    evaluation's for stopping early."""
    direction: Literal["minimize", "maximize"] = "minimize"
    """Whether a lower or a higher ``metric`` is better."""
    pruner: PrunerConfig = Field(default_factory=PrunerConfig)
    """Stopping trials early (the default: the median rule after three trials)."""
    sampler_seed: int = 0
    """The sampler's seed: the same file draws the same first trials."""
    parallel: int = Field(default=4, gt=0)
    """SLURM: trials per language queued at once. Each trial is drawn knowing the trials that
    ended before it, so many at once make the draws closer to random ones."""


class MatrixConfig(Section):
    """A matrix of training jobs: every language × config × seed."""

    out: Path | None = None
    """The matrix root: ``runs/<job_id>/``, ``logs/matrix/<job_id>.log``, ``claims/``,
    ``events.jsonl``. ``--out`` wins; default ``runs/<matrix file stem>``."""
    languages: list[str] = Field(min_length=1)
    """ISO codes; each job trains and selects on one of them (``data.languages``,
    ``selection.language``)."""
    configs: list[ConfigEntry] = Field(min_length=1)
    """The training configs; every language runs each of them."""
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1)
    """Each language × config runs once per seed (the job's ``seed``)."""
    overrides: Overrides = Field(default_factory=list)
    """Overrides for every job (applied before the config entry's own)."""
    language_overrides: dict[str, Overrides] = Field(default_factory=dict)
    """Per-language overrides, e.g. ``{th: {selection.policy: by_loss}}``."""
    retries: int = Field(default=2, ge=0)
    """Re-runs of a failed job, each resuming from its latest checkpoint, before it is failed."""
    gpus_per_job: int = Field(default=1, ge=1, le=MAX_GPUS_PER_JOB)
    """Devices each job trains on, one process per device under ``torchrun``: GPUs, or CPU slots
    of ``--devices cpu:K`` (gloo), at most one machine's (64). ``--gpus-per-job`` wins."""
    search: SearchConfig | None = None
    """Draw the config's values instead of listing configs: one config, one seed, and
    ``search.trials`` jobs per language, drawn as the launch goes (needs ``optuna``)."""


@dataclass(frozen=True)
class Job:
    """One training run of the matrix. Picklable (Ray ships it to a worker)."""

    job_id: str
    language: str
    config_id: str
    seed: int
    config_path: Path
    overrides: tuple[str, ...]
    """Every ``key=value`` of the job, ``output_dir`` last."""


@dataclass(frozen=True)
class Plan:
    """A validated matrix: its jobs and where they write."""

    root: Path
    jobs: list[Job]
    retries: int
    allow_external_callbacks: bool
    source: str
    data_to_generate: tuple[tuple[Path, str], ...] = ()
    """(``data.path``, ``data.generate``) pairs missing on disk: built once before jobs start."""
    gpus_per_job: int = 1
    """Devices (processes) per job."""
    search: SearchConfig | None = None
    """The matrix's search: its jobs are drawn while it runs (:mod:`asrforge.matrix.search`)."""
    base: tuple[Job, ...] = ()
    """With a search, one job per language with the overrides every trial starts from (not run
    itself: a trial adds its drawn values)."""

    @property
    def slots(self) -> int:
        """Jobs to queue at once on a scheduler: every job, or a search's parallel trials."""
        return len(self.base) * self.search.parallel if self.search else len(self.jobs)

    def run_dir(self, job: Job) -> Path:
        return self.root / "runs" / job.job_id

    def log_path(self, job: Job) -> Path:
        return self.root / "logs" / "matrix" / f"{job.job_id}.log"

    def trial(self, base: Job, number: int, params: dict[str, Any]) -> Job:
        """Trial ``number`` of the search for ``base``'s language: ``base`` with the values
        ``params`` drawn, a config of its own in reports (``<config_id>-t<NNN>``) with its own
        run directory."""
        config_id = f"{base.config_id}-t{number:03d}"
        jid = f"{base.language}-{config_id}"
        *settings, _ = (o for o in base.overrides if not o.startswith("config_id="))
        overrides = (*settings, *normalize_overrides(params),
                     f"config_id={yaml_string(config_id)}", f"output_dir={self.root / 'runs' / jid}")
        return Job(jid, base.language, config_id, base.seed, base.config_path, overrides)

    def index(self, drawn: list[Job] | tuple[Job, ...] = ()) -> dict[str, Any]:
        """What ``matrix.json`` holds: the jobs (and a search's ``drawn`` trials so far), so a
        report can show the ones not started."""
        jobs = [
            {"job_id": j.job_id, "language": j.language, "config_id": j.config_id, "seed": j.seed,
             "config": str(j.config_path), "overrides": list(j.overrides)}
            for j in (*self.jobs, *drawn)
        ]
        return {"source": self.source, "retries": self.retries, "jobs": jobs}


def normalize_overrides(value: Overrides) -> list[str]:
    """``{a.b: 1, c: [x], d: "no"}`` -> ``["a.b=1", 'c=["x"]', 'd="no"']``: a mapping's values
    keep their YAML types (non-strings as JSON, which is YAML); a list passes through."""
    if isinstance(value, dict):
        return [f"{k}={yaml_string(v) if isinstance(v, str) else json.dumps(v)}"
                for k, v in value.items()]
    return list(value)


def language_overrides(language: str) -> list[str]:
    """The overrides that make a config train and select on one language."""
    code = yaml_string(language)
    return [f"data.languages=[{code}]", f"selection.language={code}"]


def yaml_string(text: str) -> str:
    """``text`` as it must appear in an override to stay a string: bare when YAML reads it back
    unchanged, else quoted (``no``, Norwegian, would be YAML's false; ``1e3`` a number)."""
    try:
        same = yaml.safe_load(text) == text
    except yaml.YAMLError:
        same = False
    return text if same else json.dumps(text)


def job_id(language: str, config_id: str, seed: int) -> str:
    return f"{language}-{config_id}-s{seed}"


def load_matrix(
    path: str | Path,
    *,
    out: str | Path | None = None,
    extra_overrides: list[str] | None = None,
    allow_external_callbacks: bool = False,
    gpus_per_job: int | None = None,
) -> Plan:
    """Read and validate a MATRIX.yaml and expand it into jobs.

    Args:
        path: the matrix file.
        out: the matrix root; overrides the file's ``out``.
        extra_overrides: ``key=value`` applied to every job after the file's own (from the CLI).
        allow_external_callbacks: import the jobs' ``_target_`` callbacks and
            ``module:function`` transforms, here and in every job: the person's permission
            (:func:`asrforge.config.external_code_allowed`), which the file cannot give.
        gpus_per_job: devices per job; overrides the file's ``gpus_per_job``.

    Raises:
        ConfigError: every problem at once, by YAML path (``configs.1.config_id: ...``); a
            problem of the jobs' training configs once, named by the file, or the matrix's
            override, that wrote it and by the jobs it holds for
            (:mod:`asrforge.matrix.problems`).
    """
    p = Path(path)
    source = str(path)
    data = read_yaml_mapping(p)
    problems: list[str] = []
    if FILE_PERMISSION in data:
        del data[FILE_PERMISSION]
        problems.append(
            f"{FILE_PERMISSION}: a matrix file cannot allow importing code, remove it; the person "
            f"running the matrix passes --allow-external-callbacks (or sets {ALLOW_EXTERNAL_ENV}=1)"
        )
    huge = huge_integers(data)
    problems += huge
    m, config_index = _validate(data, problems)
    if m is None or huge:
        # no job can be checked without the fields every job is made of, or with numbers too big
        raise ConfigError(problems, source)
    problems += _cross_field_problems(m, config_index)
    root = Path(out or m.out or Path("runs") / p.stem).absolute()
    if problem := directory_problem(root):  # a file in the way would fail every job's claim
        problems.append(f"{'--out' if out else 'out'}: {problem}")

    jobs: list[Job] = []
    found = JobProblems()
    to_generate: dict[Path, str] = {}
    common = [(o, "overrides") for o in normalize_overrides(m.overrides)]
    # a search checks its space's ends and choices, each a config of its own (once it is sound)
    space_ok = m.search is not None and not _space_key_problems(m.search)
    variants = search_variants(m.search) if space_ok else [[]]
    # a language, seed or config_id listed twice is told once above, not as a job id made twice
    entries: dict[str, tuple[int, ConfigEntry]] = {}
    for i, entry in zip(config_index, m.configs, strict=True):
        entries.setdefault(entry.config_id, (i, entry))
    for i, entry in entries.values():
        per_config = [(o, f"configs.{i}.overrides") for o in normalize_overrides(entry.overrides)]
        for language in dict.fromkeys(m.languages):
            per_language = [(o, f"language_overrides.{language}")
                            for o in normalize_overrides(m.language_overrides.get(language, []))]
            for seed in dict.fromkeys(m.seeds):
                jid = job_id(language, entry.config_id, seed)
                found.cells[jid] = (language, entry.config_id, seed)
                if not Path(entry.path).is_file():
                    continue  # configs.N.path: told once above
                tagged = [
                    *common, *per_config, *((o, "languages") for o in language_overrides(language)),
                    *per_language, *((o, "the command line") for o in extra_overrides or []),
                    (f"config_id={yaml_string(entry.config_id)}", f"configs.{i}.config_id"),
                    (f"seed={seed}", "seeds"), (f"output_dir={root / 'runs' / jid}", "out"),
                ]  # fmt: skip
                overrides = tuple(o for o, _ in tagged)
                base: set[str] = set()
                cfg = None
                for n, drawn in enumerate(variants):
                    draw_tags = [(o, "search.space") for o in drawn]
                    checked = [*tagged[:-1], *draw_tags, tagged[-1]]
                    lines, loaded = _job_problems(entry.path, checked, allow_external_callbacks,
                                                  m.search)  # fmt: skip
                    if n == 0:  # the job as it is, a search's space at its low ends
                        cfg, base = loaded, {line for _, line in lines}
                    for where, line in lines:
                        if n == 0:
                            draw = ", ".join(drawn) if where == "search.space" else None
                            found.add(where, line, jid, draw=draw)
                        elif line not in base:  # past the low ends: what the values break
                            found.add("search.space", line, jid, draw=", ".join(drawn))
                if cfg is not None:
                    data_path = Path(cfg.data.path).absolute()
                    if cfg.data.generate and not data_path.exists():
                        to_generate[data_path] = cfg.data.generate
                jobs.append(Job(jid, language, entry.config_id, seed,
                                Path(entry.path).absolute(), overrides))
    problems += found.lines()
    seen: dict[str, int] = {}
    for j in jobs:
        seen[j.job_id] = seen.get(j.job_id, 0) + 1
    problems += [f"job id {k!r} is produced {n} times: rename a language or config_id"
                 for k, n in seen.items() if n > 1]
    if problems:
        raise ConfigError(problems, source)
    return Plan(root=root, jobs=[] if m.search else jobs, retries=m.retries,
                allow_external_callbacks=allow_external_callbacks, source=source,
                data_to_generate=tuple(to_generate.items()),
                gpus_per_job=gpus_per_job or m.gpus_per_job, search=m.search,
                base=tuple(jobs) if m.search else ())


JOB_FIELDS = ("languages", "configs", "overrides", "language_overrides")
"""What every job's config is made of: when one is written wrong, no job can be checked."""


def _validate(data: dict[str, Any], problems: list[str]) -> tuple[MatrixConfig | None, list[int]]:
    """The matrix file's schema, its problems appended to ``problems``. What its jobs can still be
    checked with: the file without the fields it got wrong (they have defaults) and without the
    config entries it got wrong, with the index in ``configs`` of each entry kept; None when a
    field every job is made of is wrong."""
    try:
        return MatrixConfig.model_validate(data), list(range(len(data.get("configs") or ())))
    except ValidationError as e:
        problems += format_errors(e, MatrixConfig)
        locs = [err["loc"] for err in e.errors()]
    entries = {loc[1] for loc in locs if loc[:1] == ("configs",) and len(loc) > 1}
    if any(not loc or loc[:1] != ("configs",) and loc[0] in JOB_FIELDS or loc == ("configs",)
           for loc in locs):  # fmt: skip
        return None, []
    kept = {k: v for k, v in data.items() if k not in {loc[0] for loc in locs}}
    # a default stands in for a field while its problem is told
    config_index = [i for i in range(len(data["configs"])) if i not in entries]
    kept["configs"] = [data["configs"][i] for i in config_index]
    try:
        return MatrixConfig.model_validate(kept), config_index
    except ValidationError:
        return None, []


def _job_problems(
    config: Path, overrides: list[tuple[str, str]], allow_external: bool, search: SearchConfig | None
) -> tuple[list[tuple[str, str]], Any]:
    """Every problem ``asrforge train`` would find in a job's config before it starts (the
    config, its language values, its callbacks and transforms, LoRA's target modules, what a
    search needs), each with
    where it was written (:func:`asrforge.matrix.problems.origin`); and the config, None when it
    does not load."""
    try:
        cfg = load_config(config, [o for o, _ in overrides])
    except ConfigError as e:
        lines, cfg = e.problems, None
    else:
        lines = [*config_language_problems(cfg), *_callback_problems(cfg, allow_external),
                 *_lora_problems(cfg)]
        if search:
            lines += _search_problems(cfg, search)
    return [(origin(line, overrides, str(config)), line) for line in lines], cfg


def _lora_problems(cfg) -> list[str]:
    """LoRA's target modules against the job's model, its skeleton built from its config alone."""
    if cfg.model.lora is None:
        return []
    # The model's skeleton needs transformers, which the matrix command's parser must not pay for.
    from asrforge.model.lora import target_problems

    return target_problems(cfg.model)


SPACE_SAMPLES = 32
"""Values of one range a search checks before it runs: every value of a smaller integer range."""


def space_values(p: SearchParameter) -> list[Any]:
    """The values of one parameter a search checks before it runs: each choice; every value of
    an integer range of at most :data:`SPACE_SAMPLES` values, else that many spread over it
    (its ends and their neighbours included, on its step); a float range's ends and points between them (on its log
    scale or step)."""
    if p.choices is not None:
        return list(p.choices)
    integers = isinstance(p.low, int) and isinstance(p.high, int) and not isinstance(p.step, float)
    if integers:
        step = int(p.step or 1)
        count = (p.high - p.low) // step + 1
        if count <= SPACE_SAMPLES:
            return [p.low + i * step for i in range(count)]
        # the neighbours of the ends too: evenly spread picks may all share a divisor
        picks = {round(i * (count - 1) / (SPACE_SAMPLES - 3)) for i in range(SPACE_SAMPLES - 2)}
        return [p.low + i * step for i in sorted({*picks, 1, count - 2})]
    low, high = float(p.low), float(p.high)
    points = [i / (SPACE_SAMPLES - 1) for i in range(SPACE_SAMPLES)]
    if p.log:
        values = [low * (high / low) ** t for t in points]
    else:
        values = [low + (high - low) * t for t in points]
    if p.step:
        values = [min(high, low + round((v - low) / p.step) * p.step) for v in values]
    return list(dict.fromkeys([p.low, *values[1:-1], p.high]))


def search_variants(search: SearchConfig) -> list[list[str]]:
    """The configs that check a search's space as a whole before it runs: every range at its
    low end and at its high end, and each value :func:`space_values` gives of each parameter
    with the others at their low ends and at their high ends (choices: the first)."""
    def first(p: SearchParameter) -> Any:
        return p.choices[0] if p.choices else p.low

    lows = {k: first(p) for k, p in search.space.items()}
    highs = {k: p.choices[0] if p.choices else p.high for k, p in search.space.items()}
    variants = [lows, highs]
    for key, p in search.space.items():
        for value in space_values(p):
            variants += [{**lows, key: value}, {**highs, key: value}]
    unique = {json.dumps(v, sort_keys=True): v for v in variants}
    return [normalize_overrides(v) for v in unique.values()]


def _search_problems(cfg, search: SearchConfig) -> list[str]:
    """A trial is judged by its evaluations: the run must evaluate."""
    if not cfg.eval.eval_steps and not cfg.eval.at_end:
        return ["search: a trial is judged by its evaluations, but the config evaluates "
                "neither during training (eval.eval_steps) nor at the end (eval.at_end)"]
    return []


def _callback_problems(cfg, allow_external: bool) -> list[str]:
    """What ``asrforge train`` would refuse in the job's callbacks: unknown names, bad options,
    metrics no evaluation produces (theirs and ``checkpoint.keep_best``'s), ``_target_``
    without the person's permission (then never imported), and likewise its
    ``data.augment.transforms`` named ``"module:function"``. The callbacks are built, not
    run: this imports the callback registry and evaluation's metric names (torch), not the loop.
    """
    from asrforge.callbacks import build_callbacks

    problems = []
    try:
        build_callbacks(cfg, allow_external=allow_external)
    except ConfigError as e:
        problems += e.problems
    # data.augment.transforms' "module:function" imports code under the same permission
    for i, name in enumerate(cfg.data.augment.transforms):
        if ":" in name and not allow_external:
            problems.append(
                f"data.augment.transforms[{i}]: '{name}' imports code named in the config; "
                f"{ALLOW_EXTERNAL_HINT}"
            )
        elif ":" in name:
            # The augmentation code loads datasets' and soundfile's machinery, which the matrix
            # command's parser must not pay for.
            from asrforge.data.augment import import_transforms

            try:
                import_transforms([name], allowed=True)
            except UserError as e:
                problems.append(str(e).replace("transforms[0]", f"transforms[{i}]", 1))
    return problems


def _cross_field_problems(m: MatrixConfig, config_index: list[int]) -> list[str]:
    """The rules between fields (``config_index``: each entry of ``m.configs``' index in the
    file's ``configs``, which may hold entries left out for their own problems)."""
    problems = []
    for i, lang in enumerate(m.languages):
        if not re.match(NAME_PATTERN, lang):
            problems.append(f"languages.{i}: {lang!r} is not a usable name (letters, digits, _.+-)")
    for field, values, index in (
        ("languages", m.languages, range(len(m.languages))),
        ("seeds", m.seeds, range(len(m.seeds))),
        ("configs", [c.config_id for c in m.configs], config_index),
    ):
        first: dict[Any, int] = {}
        for i, v in zip(index, values, strict=True):
            if v in first:
                where = f"{field}.{i}" + (".config_id" if field == "configs" else "")
                problems.append(f"{where}: {v!r} is listed twice (also {field}.{first[v]})")
            first.setdefault(v, i)
    for lang in m.language_overrides:
        if lang not in m.languages:
            problems.append(f"language_overrides.{lang}: not one of languages {m.languages}")
    for i, c in zip(config_index, m.configs, strict=True):
        if not Path(c.path).is_file():
            problems.append(f"configs.{i}.path: {c.path}: no such file")
    if m.search:
        problems += _space_problems(m)
    return problems


def _space_problems(m: MatrixConfig) -> list[str]:
    # The evaluation's metric names (the callbacks check theirs by the same list) load torch,
    # which the matrix command's parser must not pay for.
    from asrforge.callbacks import eval_metric_names

    problems = []
    if importlib.util.find_spec("optuna") is None:
        problems.append("search: needs optuna: pip install 'asrforge[search]'")
    if m.search.metric not in eval_metric_names():
        problems.append(f"search.metric: {m.search.metric!r} is not a metric evaluation produces "
                        f"({', '.join(eval_metric_names())})")
    if len(m.configs) != 1:
        problems.append(f"search: draws the values of one config; configs lists {len(m.configs)}")
    if len(m.seeds) != 1:
        problems.append(f"search: each trial is one run; seeds lists {len(m.seeds)} (give one)")
    return problems + _space_key_problems(m.search)


def _space_key_problems(search: SearchConfig) -> list[str]:
    """Each parameter's own rules: a range or choices, a range that can be drawn from."""
    problems = []
    for key, p in search.space.items():
        where = f"search.space.{key}"
        if p.choices is not None:
            if p.low is not None or p.high is not None or p.log or p.step is not None:
                problems.append(f"{where}: give choices, or low and high, not both")
            elif not p.choices:
                problems.append(f"{where}: choices is empty")
            continue
        if p.low is None or p.high is None:
            problems.append(f"{where}: give low and high (a range), or choices")
        elif not p.low < p.high:
            problems.append(f"{where}: low {p.low} must be below high {p.high}")
        elif p.log and p.low <= 0:
            problems.append(f"{where}: a log scale needs low > 0, got {p.low}")
        if p.log and p.step is not None:
            problems.append(f"{where}: log and step cannot be combined")
    return problems
