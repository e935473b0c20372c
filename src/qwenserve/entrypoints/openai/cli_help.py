"""vLLM's filtered help for ``serve``: ``--help=listgroup``, ``--help=<group>``, ``--help=<flag>``,
``--help=all`` and ``--help=page`` (the full help through a pager).

argparse keeps an argument group's flags in private fields, so the parser records them itself
(``FlagRegistry``) as they are added through argparse's public ``add_argument``; the help is
formatted with the parser's public ``formatter_class``. One group per title: asking for a title
again returns the same group, so a section never appears twice.
"""

from __future__ import annotations

import argparse
import pydoc
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol


class AddsArguments(Protocol):
    """What flag-adding code needs from a parser or one of its groups."""

    def add_argument(self, *name_or_flags: str, **kwargs: object) -> argparse.Action: ...


class FlagGroup:
    """An argparse argument group that remembers the flags added to it."""

    def __init__(self, title: str, description: str | None, group: AddsArguments,
                 registry: FlagRegistry) -> None:
        self.title, self.description = title, description
        self.actions: list[argparse.Action] = []
        self._group = group
        self._registry = registry

    def add_argument(self, *name_or_flags: str, **kwargs: object) -> argparse.Action:
        action = self._group.add_argument(*name_or_flags, **kwargs)  # type: ignore[arg-type]
        self.actions.append(action)
        self._registry.actions.append(action)
        return action


@dataclass
class FlagRegistry:
    """Every flag of a parser, and its titled groups in the order they were made."""

    actions: list[argparse.Action] = field(default_factory=list)
    groups: dict[str, FlagGroup] = field(default_factory=dict)

    def option_strings(self) -> set[str]:
        return {s for a in self.actions for s in a.option_strings}

    def matching(self, key: str) -> list[argparse.Action]:
        """Shown flags whose name contains ``key`` (``_`` or ``-``, any case)."""
        key = key.lower().lstrip("-").replace("_", "-")
        return [a for a in self.actions if a.help != argparse.SUPPRESS
                and any(key in s.lower().lstrip("-") for s in a.option_strings)]


def answer_help_query(parser: argparse.ArgumentParser, registry: FlagRegistry, query: str,
                      refused: Iterable[str]) -> None:
    """Print the help ``--help=<query>`` asks for and exit (0; 1 when nothing matches, as vLLM).

    ``refused``: flags qwenserve knows but refuses, named when a query matches only them."""
    if query == "all":
        parser.print_help()
        parser.exit(0)
    if query == "page":
        pydoc.pager(parser.format_help())
        parser.exit(0)
    if query == "listgroup":
        titles = [g.title for g in registry.groups.values() if g.actions]
        print("\n".join(["Available groups:", *(f"  - {t}" for t in titles)]))
        parser.exit(0)
    formatter = parser.formatter_class(prog=parser.prog)
    group = next((g for t, g in registry.groups.items() if t.lower() == query.lower()), None)
    if group is not None:
        formatter.start_section(group.title)
        formatter.add_text(group.description)
        formatter.add_arguments(group.actions)
        formatter.end_section()
        print(formatter.format_help())
        parser.exit(0)
    actions = registry.matching(query)
    if not actions:
        key = query.lower().lstrip("-").replace("_", "-")
        names = sorted(f for f in refused if key in f.lstrip("-"))
        note = f" ({', '.join(names)}: not implemented yet in qwenserve)" if names else ""
        print(f"No group or parameter matching {query!r}{note}. Use '--help=listgroup' to see "
              "the groups or '--help=all' to see every parameter.")
        parser.exit(1)
    formatter.start_section(f"flags matching {query!r}")
    formatter.add_arguments(actions)
    formatter.end_section()
    print(formatter.format_help())
    parser.exit(0)
