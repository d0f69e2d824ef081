"""The base of every callback's options schema."""

from pydantic import BaseModel, ConfigDict


class Options(BaseModel):
    """A callback's options from YAML: unknown options are errors, each field documents itself."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
