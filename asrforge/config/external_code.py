"""Who may allow importing code a config names (a callback's ``_target_``, a ``module:function``
augmentation transform): the person running the command, never a file."""

from __future__ import annotations

import os

ALLOW_EXTERNAL_ENV = "ASRFORGE_ALLOW_EXTERNAL_CALLBACKS"
"""Set to ``1`` in the environment, it allows what ``--allow-external-callbacks`` allows."""
ALLOW_EXTERNAL_HINT = f"pass --allow-external-callbacks (or set {ALLOW_EXTERNAL_ENV}=1) to allow it"
"""How the person running a command permits a config's ``_target_`` and ``module:function``."""


def external_code_allowed(flag: bool) -> bool:
    """Whether code named in a config (a callback's ``_target_``, a ``module:function``
    augmentation transform) may be imported: only the person running the command decides, by
    ``--allow-external-callbacks`` (``flag``) or :data:`ALLOW_EXTERNAL_ENV`, never a file."""
    return flag or os.environ.get(ALLOW_EXTERNAL_ENV, "").strip().lower() in ("1", "true", "yes")
