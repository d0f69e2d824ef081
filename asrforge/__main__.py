"""``python -m asrforge`` (and ``accelerate launch -m asrforge train ...``)."""

import sys

try:
    from asrforge.cli import main
except KeyboardInterrupt:  # Ctrl-C while the command's modules load: one line, as main says it
    print("asrforge: interrupted", file=sys.stderr)
    sys.exit(130)

sys.exit(main())
