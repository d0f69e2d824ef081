"""``asrforge config fields|show|hf|reference``."""

from __future__ import annotations

import argparse

from asrforge.config import load_config
from asrforge.config.hf_names import PEER_NAMES
from asrforge.config.reference import field_docs, render_fields, render_markdown, render_resolved
from asrforge.errors import UserError


def add_parser(sub) -> None:
    """Register ``config`` with its actions."""
    p = sub.add_parser(
        "config",
        help="print the config reference or a resolved config",
        description="Every config field with its type, default and description, generated from "
        "the schema; or a config file resolved with its overrides and every default.",
    )
    actions = p.add_subparsers(dest="config_action", required=True, metavar="ACTION")
    fields = actions.add_parser("fields", help="list every field: type, default, description")
    fields.add_argument(
        "section", nargs="?", help="only fields under this YAML path prefix, e.g. optim or eval"
    )
    fields.set_defaults(func=run_fields)
    show = actions.add_parser(
        "show", help="print CONFIG resolved (overrides applied, every default filled in)"
    )
    show.add_argument("config", help="the YAML config file; dotted.key=value overrides may follow")
    show.set_defaults(func=run_show, accepts_overrides=True)
    hf = actions.add_parser(
        "hf",
        help="Hugging Face TrainingArguments, ms-swift and ESPnet names and the asrforge field for each",
    )
    hf.set_defaults(func=run_hf)
    reference = actions.add_parser(
        "reference", help="the whole reference as Markdown (docs/configuration.md)"
    )
    reference.set_defaults(func=run_reference)


def run_fields(args: argparse.Namespace) -> int:
    rows = field_docs()
    if args.section:
        rows = [r for r in rows if r.path == args.section or r.path.startswith(args.section + ".")]
        if not rows:
            sections = sorted({r.path.split(".")[0].split("[")[0] for r in field_docs()})
            raise UserError(
                f"no config field under {args.section!r}; sections: {', '.join(sections)}"
            )
    print(render_fields(rows))
    return 0


def run_hf(args: argparse.Namespace) -> int:
    names = PEER_NAMES
    width = max(map(len, names))
    print("\n".join(f"{name:<{width}}  {where}" for name, where in names.items()))
    return 0


def run_reference(args: argparse.Namespace) -> int:
    print(render_markdown(), end="")
    return 0


def run_show(args: argparse.Namespace) -> int:
    print(render_resolved(load_config(args.config, args.overrides)), end="")
    return 0


# ---------------------------------------------------------------------------------------------
