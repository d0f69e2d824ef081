"""``asrforge matrix``: run every job of a MATRIX.yaml."""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
import textwrap

from asrforge.cli.problems import attempt, positive, raise_problems
from asrforge.config import ConfigError, external_code_allowed
from asrforge.config.reference import fields_epilog
from asrforge.matrix.plan import MAX_GPUS_PER_JOB, SLURM_DIR, MatrixConfig, load_matrix

# The executors and the launcher load Ray and the training set-up: imported inside the handler,
# so building the parser (`asrforge --help`) does not wait for them.

TIME_LIMIT = "4:00:00"
"""A SLURM job's time limit when ``--time-limit`` is not given."""
EXECUTOR_OPTIONS = {
    "--devices": "local",
    "--ray-address": "ray",
    "--threads": "ray",
    "--partition": "slurm",
    "--time-limit": "slurm",
    "--slurm-arg": "slurm",
}
"""Each executor's own options: flag -> the executor that reads it."""


def add_parser(sub) -> None:
    """Register ``matrix``."""
    p = sub.add_parser(
        "matrix",
        help="run a matrix of training jobs (languages × configs × seeds)",
        # The description is filled here because the raw formatter keeps the field list's lines.
        description=textwrap.fill(
            "Run every job of MATRIX.yaml, one per device, each as `asrforge train` with its "
            "language, seed and output_dir. Launch again (or on another machine sharing the "
            "matrix root) at any time: finished jobs are skipped, interrupted ones resume. "
            "dotted.key=value overrides apply to every job.", 80
        ),
        epilog=fields_epilog(MatrixConfig, "MATRIX.yaml fields (YAML path: type = default):"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("matrix", help="the MATRIX.yaml file")
    p.add_argument("--executor", choices=("local", "ray", "slurm"), default="local",
                   help="local processes (default), Ray tasks, or SLURM jobs (submitit)")
    p.add_argument("--devices", default=None,
                   help="local: GPU indices (0,1,3), cpu:N (N CPU slots), or auto (default: every "
                        "visible GPU, else one CPU slot)")
    p.add_argument("--gpus-per-job", type=int, default=None, metavar="N",
                   help="devices each job trains on, under torchrun (GPUs, or CPU slots of "
                        "--devices cpu:K); default: the file's gpus_per_job, else 1")
    p.add_argument("--out", default=None, help="the matrix root (default: the file's `out`)")
    p.add_argument("--ray-address", default=None,
                   help="ray: a running cluster's address (default: RAY_ADDRESS, else a local Ray)")
    p.add_argument("--threads", type=int, default=None,
                   help="ray without GPUs: CPU threads per job (default 1)")
    p.add_argument("--partition", default=None, help="slurm: the partition (default: the "
                   "cluster's)")
    p.add_argument("--time-limit", default=None,
                   help=f"slurm: each job's time limit (HH:MM:SS, default {TIME_LIMIT}); the run "
                        "saves before it and the job is requeued with --resume")
    p.add_argument("--slurm-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="slurm: one more sbatch option (account=abc, cpus-per-task=16, mem=200G); "
                        "repeat for more")
    p.add_argument("--retry-failed", action="store_true",
                   help="run again the jobs that failed in an earlier launch")
    p.add_argument("--progress-every", type=float, default=5.0, metavar="SECONDS",
                   help="seconds between progress lines (default 5)")
    p.add_argument("--allow-external-callbacks", action="store_true",
                   help="allow the jobs' callbacks named by `_target_` and augmentation transforms "
                        "named 'module:function' (imports and runs that code; or set "
                        "ASRFORGE_ALLOW_EXTERNAL_CALLBACKS=1); the matrix file can never allow it")
    p.add_argument("--dry-run", action="store_true",
                   help="validate the matrix, print each job's command, start nothing")
    p.set_defaults(func=run, accepts_overrides=True)


def other_executors_options(args) -> list[str]:
    """A problem for each option given that the chosen executor does not read: the launch it
    was meant for (a partition, a cluster) would not be the one that runs."""
    return [
        f"{flag}: an option of --executor {executor}; this launch is --executor "
        f"{args.executor}, which would ignore it"
        for flag, executor in EXECUTOR_OPTIONS.items()
        # argparse's attribute for a flag: its name without the dashes, "-" as "_"
        if getattr(args, flag[2:].replace("-", "_")) not in (None, [])
        and executor != args.executor
    ]


def run(args) -> int:
    from asrforge.matrix.executors import (
        LocalExecutor,
        RayExecutor,
        group_devices,
        parse_devices,
        unseen_gpus,
    )
    from asrforge.matrix.run import Launcher
    from asrforge.matrix.slurm import (
        SlurmExecutor,
        describe_sbatch,
        parse_slurm_args,
        sbatch_parameters,
        time_limit_minutes,
    )

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s",
                        datefmt="%H:%M:%S")
    # The command line's problems and the matrix's are told together, before anything starts.
    problems = [positive("--gpus-per-job", args.gpus_per_job), *other_executors_options(args)]
    time_limit = TIME_LIMIT if args.time_limit is None else args.time_limit
    if args.gpus_per_job is not None and args.gpus_per_job > MAX_GPUS_PER_JOB:
        problems.append(f"--gpus-per-job: must be at most {MAX_GPUS_PER_JOB} (a job runs on one "
                        f"machine), got {args.gpus_per_job}")
    allowed = external_code_allowed(args.allow_external_callbacks)
    try:
        plan = load_matrix(args.matrix, out=args.out, extra_overrides=args.overrides,
                           allow_external_callbacks=allowed, gpus_per_job=args.gpus_per_job)
    except ConfigError as e:
        plan, matrix_problems = None, e
    sbatch = None
    if args.executor == "slurm":  # its options are checked before a dry run too, and shown by it
        for item in args.slurm_arg:
            attempt(lambda item=item: parse_slurm_args([item]), problems)
        if attempt(lambda: time_limit_minutes(time_limit), problems) and not any(problems):
            sbatch = sbatch_parameters(
                partition=args.partition, gpus_per_job=plan.gpus_per_job if plan else 1,
                time_limit=time_limit, slurm_args=parse_slurm_args(args.slurm_arg))
    devices = None
    # devices named are checked before a dry run too, as a launch checks them
    if args.executor == "local" and (args.devices is not None or not args.dry_run):
        parsed = attempt(lambda: parse_devices(args.devices), problems)
        if parsed is not None:
            problems.append(unseen_gpus(parsed))
        if parsed is not None and plan is not None and not any(problems):
            devices = attempt(lambda: group_devices(parsed, plan.gpus_per_job), problems)
    if plan is None:
        raise ConfigError([*matrix_problems.problems, *filter(None, problems)],
                          matrix_problems.source)
    raise_problems(problems)
    if args.dry_run:
        launch = ["asrforge"] if plan.gpus_per_job == 1 else [
            "torchrun", "--standalone", "--nproc_per_node", str(plan.gpus_per_job), "-m",
            "asrforge"]
        # a search's first trial of each language, as it will run but for the values it draws
        drawn = {key: "<drawn>" for key in plan.search.space} if plan.search else {}
        for job in plan.jobs or [plan.trial(base, 0, drawn) for base in plan.base]:
            cmd = [*launch, "train", str(job.config_path), *job.overrides]
            print(f"{job.job_id}: {shlex.join(cmd)}")
        if sbatch is not None:
            print(f"slurm: {plan.slots} job(s) queued at once, each with sbatch "
                  f"{describe_sbatch(sbatch)}; submitit's files in {plan.root / SLURM_DIR}/launch-*/")
        if plan.search:
            space = ", ".join(plan.search.space)
            last = plan.search.trials - 1
            print(f"a search: {plan.search.trials} trials per language (t000 to t{last:03d}), each "
                  f"the command above with its own number and drawn {space}; root {plan.root}")
        else:
            print(f"{len(plan.jobs)} jobs; root {plan.root}")
        return 0
    if args.executor == "ray":
        executor = RayExecutor(address=args.ray_address, threads=args.threads,
                               gpus_per_job=plan.gpus_per_job)
    elif args.executor == "slurm":
        executor = SlurmExecutor.on_cluster(plan.root, plan.slots, sbatch)
    else:
        executor = LocalExecutor(devices)
    outcome = Launcher(plan, executor, retry_failed=args.retry_failed,
                       progress_every=args.progress_every).run()
    if outcome.failed:
        print(f"asrforge: {len(outcome.failed)} job(s) failed: {', '.join(outcome.failed)} "
              "(FAILED in each run dir holds the log's tail; --retry-failed runs them again)",
              file=sys.stderr)
    return outcome.exit_code
