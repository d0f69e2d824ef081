"""Many jobs: a matrix of languages × configs × seeds, run once per device with claims, retries
and resume (``asrforge matrix``), and one HTML page of the outcome (``asrforge report``).

- :mod:`~asrforge.matrix.plan`: the MATRIX.yaml schema and job expansion
- :mod:`~asrforge.matrix.claims`: per-job locks, claim records, DONE / FAILED markers
- :mod:`~asrforge.matrix.executors`: the job function and the local and Ray executors
- :mod:`~asrforge.matrix.slurm`: the SLURM executor (submitit), requeued before the time limit
- :mod:`~asrforge.matrix.run`: the launcher loop, retries, progress and ETA
- :mod:`~asrforge.matrix.report`: the HTML report
"""

from asrforge.matrix.plan import Job, MatrixConfig, Plan, load_matrix

__all__ = ["Job", "MatrixConfig", "Plan", "load_matrix"]
