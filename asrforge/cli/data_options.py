"""``--data``, ``--split`` and the ``data.*`` options of the commands that read data outside a
run (``evaluate``, ``lm build``, ``lm tune``, ``vocab``): their help and the data section they
make (:func:`asrforge.data.sources.source_config`).

Imported when the ``asrforge`` parser is built: :mod:`asrforge.data.sources` imports
``datasets`` only when a command reads data.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from asrforge.config import DataConfig
from asrforge.data.locate import is_url
from asrforge.data.sources import source_config
from asrforge.errors import UserError
from asrforge.hub import hub_ref

DATA_HELP = (
    "the data, in any form data.path takes: a Hugging Face Hub data set id (google/fleurs, with "
    "--subset), a save_to_disk DatasetDict or Dataset, a directory of parquet/arrow/jsonl/csv/tsv "
    "files named by their split, a NeMo JSONL manifest, a CSV/TSV"
)
SPLIT_HELP = "the split of data with splits (default {default}); a single file is read whole"
DATA_OPTIONS_HELP = """\
How to read --data: the data options of a run's config, written as its overrides are:
  data.columns.audio=COLUMN     the audio: an Audio feature, bytes or a path
  data.columns.text=COLUMN      the transcript (default text)
  data.columns.language=COLUMN  the language (default language or lang)
  data.columns.id=COLUMN        an utterance id for reports
  data.language=LANG            the language of every utterance, for data without a column
  data.audio_dir=DIR            where relative audio paths are read from
  data.cache_dir=DIR            where the Arrow copy of parquet/json/csv files is kept
  data.subset=NAME              the data set's configuration (--subset), e.g. es_419
  data.revision=REV             its Hub revision (--revision): a branch, tag or commit
e.g. --data cv/test.tsv data.columns.audio=path data.columns.text=sentence \
data.columns.language=locale"""
"""A command's epilog (with ``argparse.RawDescriptionHelpFormatter``)."""


def data_options(args: argparse.Namespace) -> DataConfig:
    """The data section ``--data`` (``args.data``) and the ``data.*`` options on the line
    (``args.overrides``) describe.

    Raises:
        UserError: ``--data`` does not exist, or an option is unknown or bad.
    """
    data = str(args.data)
    if not Path(data).exists() and hub_ref(data, "dataset") is None and not is_url(data):
        raise UserError(f"--data {data}: no such file or directory")
    named = [f"data.{key}={value}" for key in ("subset", "revision")
             if (value := getattr(args, key, None)) is not None]  # fmt: skip
    return source_config(data, [*args.overrides, *named])


def add_data_argument(
    parser: argparse.ArgumentParser, *, into=None, required: bool = True, help: str = DATA_HELP
) -> None:
    """``--data`` (added to ``into``, e.g. a mutually exclusive group, else to ``parser``) and
    the Hub options that go with it. A string, not a path: a path would fold the double slash
    of an ``hf://`` address."""
    (into or parser).add_argument("--data", type=str, required=required, default=None, help=help)
    add_hub_options(parser)


def add_hub_options(parser: argparse.ArgumentParser) -> None:
    """``--subset`` and ``--revision``: which configuration and revision of a Hub data set."""
    parser.add_argument("--subset", default=None,
                        help="the data set's configuration (its Hub subset, e.g. es_419)")  # fmt: skip
    parser.add_argument("--revision", default=None,
                        help="the data set's Hub revision: a branch, tag or commit")  # fmt: skip
