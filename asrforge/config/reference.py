"""The config reference, generated from the schema: ``asrforge config fields``, ``asrforge
config show``, the field list of ``asrforge train --help`` and ``docs/configuration.md``
(``asrforge config reference``).

Nothing here lists fields by hand: every row comes from the pydantic models in
:mod:`asrforge.config`, whose field docstrings are the documentation, so the reference cannot
drift from what :func:`asrforge.config.load_config` accepts.
"""

from __future__ import annotations

import textwrap
import types
import typing
from dataclasses import dataclass
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from asrforge.config.hf_names import PEER_NAMES, PEERS
from asrforge.config.schema import TrainConfig

# Where a section's fields sit below the field that holds it, by how it holds it.
_ITEM_PATH = {"": ".", "list": "[].", "dict": ".<name>."}


@dataclass(frozen=True)
class FieldDoc:
    """One config field as a user writes it."""

    path: str
    """Its YAML path, e.g. ``optim.lr``; list items as ``callbacks[].name``."""
    type: str
    """The type as a user reads it (``int | null``); ``section`` for a mapping of fields."""
    default: str
    """The default as YAML would write it; ``(required)`` when there is none."""
    description: str


def field_docs(model: type[BaseModel] = TrainConfig, prefix: str = "") -> list[FieldDoc]:
    """Every field of ``model`` and of the sections below it, in schema order, each section's
    own row before its fields.

    A section held in a list is documented under ``path[].``, one in a mapping under
    ``path.<name>.``; a field with an alias (``_target_``) is listed by the name YAML uses.
    """
    rows = []
    for name, info in model.model_fields.items():
        path = f"{prefix}{info.alias or name}"
        section, container = _section_of(info.annotation)
        # a section that is always there has no type or default worth a line of its own
        always_there = section is not None and not container and info.default is not None
        rows.append(
            FieldDoc(
                path,
                "section" if always_there else _type_name(info.annotation),
                _default(info),
                _one_paragraph(info.description),
            )
        )
        if section is not None:
            rows.extend(field_docs(section, path + _ITEM_PATH[container]))
    return rows


def undocumented(model: type[BaseModel] = TrainConfig) -> list[str]:
    """YAML paths of fields without a description (the schema's docstring)."""
    return [row.path for row in field_docs(model) if not row.description]


def render_fields(rows: list[FieldDoc], width: int = 100) -> str:
    """Rows as plain text: path, type and default on one line (a section: its path and
    ``section``), the description indented below, wrapped at ``width`` columns."""
    out = []
    for row in rows:
        if row.type == "section":
            required = " (required)" if row.default == "(required)" else ""
            out.append(f"{row.path}: section{required}")
        else:
            out.append(f"{row.path}: {row.type} = {row.default}")
        if row.description:
            out.append(
                textwrap.fill(
                    row.description,
                    width,
                    initial_indent="    ",
                    subsequent_indent="    ",
                    break_on_hyphens=False,
                )
            )
    return "\n".join(out)


TRAIN_FIELDS_INTRO = (
    "Config fields (YAML path: type = default), set in the file or as dotted.key=value "
    "overrides; `asrforge config fields SECTION` lists one section:"
)


def fields_epilog(model: type[BaseModel] = TrainConfig, intro: str = TRAIN_FIELDS_INTRO) -> str:
    """The field reference a command's ``--help`` ends with (``asrforge train --help``)."""
    return textwrap.fill(intro, 100) + "\n\n" + render_fields(field_docs(model))


REFERENCE_INTRO = """\
# Configuration reference

Generated from the schema (`asrforge/config/`) by `asrforge config reference >
docs/configuration.md`; a test fails when this file and the schema disagree. Each field: its
YAML path, type and default, then its description. Set a field in the YAML file or as a
`dotted.key=value` override after it on the command line; `asrforge config show CONFIG`
prints a config resolved with every default. A relative path in a config (`output_dir`,
`data.path`, `model.pretrained`, ...) is read from the directory the command runs in, not the
config file's, as an override's is; a manifest's relative audio paths are the exception (see
`data.audio_dir`).
"""


def render_markdown(model: type[BaseModel] = TrainConfig) -> str:
    """The whole reference as Markdown: the top-level fields, then one section per top-level
    section of the schema, then the table of Hugging Face, ms-swift and ESPnet names."""
    rows = field_docs(model)
    with_fields = {row.path.split(".")[0].split("[")[0] for row in rows if "." in row.path}
    sections: dict[str, list[FieldDoc]] = {"Top level": []}
    for row in rows:
        top = row.path.split(".")[0].split("[")[0]
        sections.setdefault(f"`{top}`" if top in with_fields else "Top level", []).append(row)
    out = [REFERENCE_INTRO]
    for heading, fields in sections.items():
        out.append(f"## {heading}\n")
        for row in (row for row in fields if row.type != "section"):
            out.append(f"- **`{row.path}`** `{row.type}` = `{row.default}`")
            out.extend([f"  {row.description}"] if row.description else [])
        out.append("")
    out.append("## Coming from Seq2SeqTrainer / ms-swift / ESPnet: what asrforge calls it\n")
    out.append("| name | whose | asrforge |\n|---|---|---|")
    for name, where in PEER_NAMES.items():
        whose = " and ".join(peer for peer, names in PEERS.items() if name in names)
        out.append(f"| `{name}` | {whose} | {where} |")
    return "\n".join(out) + "\n"


def render_resolved(cfg: TrainConfig) -> str:
    """The resolved config, every default filled in, as the YAML a run would record: under
    ``model.pretrained`` the shape fields left unset are the pretrained model's, not shown."""
    return yaml.safe_dump(cfg.to_plain(), sort_keys=False, allow_unicode=True)


def _section_of(annotation: Any) -> tuple[type[BaseModel] | None, str]:
    """The pydantic model a field holds and how: directly or optionally (``""``), as list items
    (``"list"``) or as mapping values (``"dict"``); (None, "") for a plain field."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, ""
    origin = typing.get_origin(annotation)
    for arg in typing.get_args(annotation):
        section, container = _section_of(arg)
        if section is not None:
            if origin is list:
                return section, "list"
            if origin is dict:
                return section, "dict"
            return section, container
    return None, ""


def _type_name(annotation: Any) -> str:
    """A type as a user reads it: ``int | null``, ``'sdpa' | 'eager'``, ``list[str]``."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is type(None):
        return "null"
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if origin is typing.Union or isinstance(annotation, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is not None:
        return (
            f"{getattr(origin, '__name__', str(origin))}[{', '.join(_type_name(a) for a in args)}]"
        )
    return getattr(annotation, "__name__", str(annotation))


def _default(info) -> str:
    if info.default is PydanticUndefined and info.default_factory is None:
        return "(required)"
    value = info.default_factory() if info.default_factory is not None else info.default
    if isinstance(value, BaseModel):
        return "(section)"
    dumped = yaml.safe_dump(_plain(value), default_flow_style=True).strip()
    return dumped.removesuffix("\n...").removesuffix("...").strip()


def _plain(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def _one_paragraph(text: str | None) -> str:
    """A docstring as one line of terminal text (reST's ````code```` shown as ```code```)."""
    return " ".join((text or "").split()).replace("``", "`")
