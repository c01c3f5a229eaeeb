"""Every --flag of a command also readable from an environment variable, for containers.

--max-num-seqs is PAGEDSERVE_MAX_NUM_SEQS (switches take true/false); a flag on the command
line wins.
"""

from __future__ import annotations

import argparse
import os

ENV_PREFIX = "PAGEDSERVE_"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _env_name(action: argparse.Action) -> str:
    return ENV_PREFIX + action.option_strings[0].lstrip("-").upper().replace("-", "_")


def apply_env(parser: argparse.ArgumentParser) -> None:
    """Makes PAGEDSERVE_<FLAG> the default of every --flag, and names the variable in --help.

    argparse has no public list of a parser's actions; `_actions` is the stable way to get it.
    """
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        name = _env_name(action)
        action.help = f"{action.help or ''} [env {name}]".strip()
        raw = os.environ.get(name)
        if raw is None:
            continue
        try:
            action.default = _parse_env(action, raw)
        except ValueError as error:
            parser.error(f"environment variable {name}={raw!r} is invalid: {error}")


def _parse_env(action: argparse.Action, raw: str) -> object:
    if action.nargs == 0:  # a switch
        if raw.lower() not in _TRUE + _FALSE:
            raise ValueError(f"use one of {', '.join(_TRUE + _FALSE)}")
        return raw.lower() in _TRUE
    convert = action.type or str
    values = ([convert(v) for v in raw.replace(",", " ").split()]
              if action.nargs in ("+", "*") else [convert(raw)])
    for value in values:
        if action.choices is not None and value not in action.choices:
            raise ValueError(f"{value!r} is not one of {', '.join(map(str, action.choices))}")
    return values if action.nargs in ("+", "*") else values[0]
