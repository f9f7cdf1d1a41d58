"""Command lines from config dataclasses, and one-line errors instead of tracebacks.

Each lab keeps its whole configuration in one dataclass with a comment on every field;
``parse_config`` turns the fields into ``--flags`` (the comment becomes the help text)
and ``run`` gives any ``UserError`` back as a single line and a non-zero exit.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import sys
from collections.abc import Callable
from typing import TypeVar

from distlab.errors import UserError

C = TypeVar("C")


def require_positive(config, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if value <= 0:
            raise UserError(f"--{name.replace('_', '-')} must be positive, got {value}")


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's default prints the whole usage first
        sys.exit(f"{self.prog}: error: {message} (see --help)")


def _field_comments(cls) -> dict[str, str]:
    """Each field's help text: its trailing comment, else the comment lines
    just above."""
    comments, above = {}, []
    for line in inspect.getsource(cls).splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            above.append(stripped.lstrip("#").strip())
            continue
        match = re.match(r"\s*(\w+)\s*:[^#]*(?:#\s*(.*))?$", line)
        if match and (match.group(2) or above):
            comments[match.group(1)] = match.group(2) or " ".join(above)
        above = []
    return comments


def parse_config(
    cls: type[C], argv: list[str] | None = None, description: str = ""
) -> C:
    """Build ``cls`` from the command line; each field is a ``--flag`` with
    its default."""
    parser = _OneLineParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    comments = _field_comments(cls)
    for field in dataclasses.fields(cls):
        flag = "--" + field.name.replace("_", "-")
        help_text = f"{comments.get(field.name, '')} (default: {field.default!r})"
        if field.type in (bool, "bool"):
            parser.add_argument(
                flag,
                dest=field.name,
                default=field.default,
                help=help_text,
                action=argparse.BooleanOptionalAction,
            )
        else:
            kind = {"int": int, "float": float, "str": str}.get(field.type, field.type)
            parser.add_argument(
                flag,
                dest=field.name,
                default=field.default,
                type=kind,
                help=help_text,
                metavar=field.name.upper(),
            )
    # the dataclass validates in __post_init__
    return cls(**vars(parser.parse_args(argv)))


def run(main: Callable[[], object], prog: str) -> None:
    """Call ``main``; a ``UserError`` ends the process with one line and exit
    status 1."""
    try:
        main()
    except UserError as err:
        sys.exit(f"{prog}: error: {err}")
    except KeyboardInterrupt:
        sys.exit(f"{prog}: interrupted")
