"""What every `cachectl` command shares: its name, its one-line error, its help layout."""
from __future__ import annotations

import argparse

PROG = "cachectl"


class CtlError(Exception):
    """A failure reported as one line `cachectl: ...` with exit code 1."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except the empty ones (None, False) whose help already says what happens."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False:
            return action.help or ""
        return super()._get_help_string(action)
