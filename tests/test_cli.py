"""The command line answers `--help` and bad input without importing torch, and lists every
command with the help its own module gives it."""

from __future__ import annotations

import argparse
import subprocess
import sys

from asrforge.cli import HEAVY_COMMANDS, build_parser

PROBE = """
import sys
from asrforge.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
print("TORCH" if "torch" in sys.modules else "NO-TORCH", code)
"""


def _probe(*argv: str) -> str:
    out = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1]


def test_help_and_a_bad_config_do_not_import_torch(tmp_path):
    assert _probe("--help") == "NO-TORCH 0"
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim:\n  lr: -1\n")
    assert _probe("train", str(bad)) == "NO-TORCH 2"


def _commands(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]  # noqa: SLF001
    return sub


def test_heavy_commands_are_listed_with_their_modules_help():
    def helps(parser: argparse.ArgumentParser) -> dict[str, str]:
        return {c.dest: c.help for c in _commands(parser)._choices_actions}  # noqa: SLF001

    light, full = helps(build_parser("")), helps(build_parser(None))
    assert light == full and set(HEAVY_COMMANDS) <= set(full)
    for name in HEAVY_COMMANDS:
        assert not _commands(build_parser("")).choices[name]._actions  # noqa: SLF001 - a listing
        # named on the line, the command's real parser (its options, its help) is built
        real = _commands(build_parser(name)).choices[name]
        assert len(real._actions) > 1 and real.format_help()  # noqa: SLF001
