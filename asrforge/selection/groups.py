"""The language-group table: which group (policy, step cap) a language belongs to, and which
language is the run's."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from pathlib import Path

import yaml
from pydantic import TypeAdapter, ValidationError

from asrforge.config import ConfigError, PolicyGroup, SelectionConfig, TrainConfig
from asrforge.errors import UserError
from asrforge.text.languages import (
    find_language_code,
    primary_metric,
    resolve_language,
    unknown_language,
)

GROUPS_FILE = Path(__file__).resolve().parent.parent / "selection_groups.yaml"


def error_metric(language: str, cfg: SelectionConfig) -> str:
    """The error rate a policy's ``wer`` stands for in a run of ``language``: ``"cer"`` for a
    language written without spaces, where a word error is a whole sentence's (unless
    ``selection.unspaced_error_rate`` is ``wer``), else ``"wer"``."""
    if cfg.unspaced_error_rate == "wer":
        return "wer"
    return primary_metric(language)


def run_language(cfg: TrainConfig, counts: Mapping[str, int]) -> tuple[str, str]:
    """The language whose group picks the policy, and the rule that chose it:
    ``selection.language``, else the first of ``data.languages``, else the training split's most
    frequent language (of a tie, the one met first).

    Args:
        cfg: the run's config.
        counts: utterances per language of the training split.

    Raises:
        UserError: no language at all.
    """
    if cfg.selection.language is not None:
        return cfg.selection.language, "set in selection.language"
    if cfg.data.languages:
        return cfg.data.languages[0], "the first of data.languages"
    if not counts:
        raise UserError("selection: no language to pick the policy by; set selection.language")
    language, n = Counter(counts).most_common(1)[0]
    total = sum(counts.values())
    return language, f"the most frequent language of the training split ({n} of {total})"


def mixed_groups(cfg: TrainConfig, counts: Mapping[str, int], language: str, rule: str) -> str:
    """A warning when the run's languages (``data.languages``, else the training split's) fall
    in more than one group of the table, naming the groups and the rule that picked the policy;
    "" when they share one or ``selection.language`` chose. A language no group can place is
    left to :func:`build_selector` to name."""
    if cfg.selection.language is not None:
        return ""
    source, groups = group_table(cfg.selection)
    where = source if cfg.selection.groups is not None else None
    members: dict[str, list[str]] = {}
    for entry in cfg.data.languages or list(counts):
        try:
            members.setdefault(resolve_group(entry, groups, where=where), []).append(entry)
        except UserError:
            continue
    if len(members) < 2:
        return ""
    spread = "; ".join(
        f"group {name} ({groups[name].policy}): {', '.join(langs)}"
        for name, langs in members.items()
    )
    return (
        f"selection: the run's languages fall in different groups of {source} ({spread}); the "
        f"policy and step cap follow {language!r}, {rule}: set selection.language to the "
        "language whose group should decide, or selection.policy and selection.max_steps"
    )


def group_table(cfg: SelectionConfig) -> tuple[str, dict[str, PolicyGroup]]:
    """The run's language-group table and where it comes from: ``selection.groups``, else the
    shipped file."""
    if cfg.groups is not None:
        return "selection.groups", cfg.groups
    return GROUPS_FILE.name, default_groups()


def default_groups() -> dict[str, PolicyGroup]:
    """The shipped language-group table (``asrforge/selection_groups.yaml``)."""
    data = yaml.safe_load(GROUPS_FILE.read_text())
    try:
        return TypeAdapter(dict[str, PolicyGroup]).validate_python(data)
    except ValidationError as e:
        raise ConfigError([str(e)], str(GROUPS_FILE)) from None


def resolve_group(
    language: str,
    groups: Mapping[str, PolicyGroup],
    *,
    where: str | None = "selection.groups",
    field: str = "selection",
) -> str:
    """The name of the group that holds ``language`` (by code or name; else the catch-all group,
    the one with an empty ``languages`` list).

    Args:
        language: a code or English name.
        groups: the table, group name -> group.
        where: the YAML path of the table, prefixed to each problem (None for the shipped file).
        field: the YAML path named when ``language`` itself is the problem.

    Raises:
        ConfigError: the table names an unknown language, a language twice, or two catch-alls.
        UserError: ``language`` is unknown, or in no group while there is no catch-all.
    """
    prefix = f"{where}." if where else ""
    owner: dict[str, str] = {}
    catch_all: list[str] = []
    problems = []
    for name, group in groups.items():
        if not group.languages:
            catch_all.append(name)
        for i, entry in enumerate(group.languages):
            code = find_language_code(entry)
            if code is None:
                problems.append(unknown_language(entry, f"{prefix}{name}.languages.{i}"))
            elif code in owner and owner[code] != name:
                problems.append(
                    f"{prefix}{name}.languages.{i}: {entry!r} is also in group {owner[code]}"
                )
            else:
                owner[code] = name
    if len(catch_all) > 1:
        problems.append(
            f"{where or 'groups'}: groups {', '.join(catch_all)} all have an empty languages "
            f"list; at most one group may take the rest"
        )
    if problems:
        raise ConfigError(problems, None if where else str(GROUPS_FILE))

    code = resolve_language(language, field)
    if code in owner:
        return owner[code]
    if catch_all:
        return catch_all[0]
    raise UserError(
        f"{field}: language {language!r} is in no group of {where or GROUPS_FILE.name}, and no "
        f"group has an empty languages list to take the rest"
    )
