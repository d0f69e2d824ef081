"""``python -m asrforge`` (and ``accelerate launch -m asrforge train ...``)."""

import sys

from asrforge.cli import main

sys.exit(main())
