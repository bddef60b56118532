"""What every `cachectl` command shares: its name, its one-line error, its help layout."""
from __future__ import annotations

import argparse
import math

PROG = "cachectl"


class CtlError(Exception):
    """A failure reported as one line `cachectl: ...` with exit code 1."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except the empty ones (None, False, "": `ring --peers` showed "(default: )")
    whose help already says what happens, and those the help states itself."""

    def _get_help_string(self, action: argparse.Action) -> str:
        empty = action.default is None or action.default is False or action.default == ""  # not 0
        if empty or "(default" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)


def seconds(text: str) -> float:
    """argparse type of a --timeout: a finite number of seconds > 0. A negative, zero or NaN
    timeout failed every call with a misleading "no answer in time" (or never timed out)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text!r}")
    return value
