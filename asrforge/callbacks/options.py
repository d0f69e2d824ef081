"""The base of every callback's options schema, and the type of an option that names a metric."""

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationInfo

from asrforge.config import metric_problem


class Options(BaseModel):
    """A callback's options from YAML: unknown options are errors, each field documents itself."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


def _produced_by_evaluation(value: str, info: ValidationInfo) -> str:
    # build_callbacks passes the evaluation's metric names as the validation context; a schema
    # validated without them (a test, a user's own code) accepts any name.
    produced = (info.context or {}).get("eval_metrics")
    if produced is not None and value not in produced:
        raise ValueError(metric_problem(value, produced))
    return value


EvalMetric = Annotated[str, AfterValidator(_produced_by_evaluation)]
"""An option naming an evaluation metric (``wer``, ``cer``, ``loss``, ...): a name no evaluation
produces is a config error before training starts, not a callback failing at every evaluation."""
