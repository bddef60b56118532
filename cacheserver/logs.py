"""Structured logs: one JSON object per line on stderr (journald/kubectl friendly)."""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {"ts": round(record.created, 3), "level": record.levelname.lower(),
               "logger": record.name, "msg": record.getMessage()}
        for key, value in getattr(record, "fields", {}).items():
            doc[key] = value
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


class TextFormatter(logging.Formatter):
    """Plain lines for a terminal. An event's fields follow its message as key=value: without
    them a text log lost what only they carry (the port `--metrics-port 0` picked, final counters)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        fields = getattr(record, "fields", None)
        if fields:
            line += " " + " ".join(f"{key}={_text_value(value)}" for key, value in fields.items())
        return line


def _text_value(value: object) -> str:
    """A bare word where that reads back unambiguously; JSON otherwise (spaces, quotes, dicts)."""
    if isinstance(value, str) and value and not any(c.isspace() or c in '"=' for c in value):
        return value
    return json.dumps(value, default=str)


def add_flags(p: argparse.ArgumentParser) -> None:
    """--log-level and --log-format, the daemons' alike (setup's arguments)."""
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="least severe log lines written to stderr (default: %(default)s)")
    p.add_argument("--log-format", default="json", choices=["json", "text"],
                   help="json: one JSON object per line (for log collectors); text: plain lines for a terminal "
                        "(default: %(default)s)")


def setup(level: str = "info", fmt: str = "json") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logging.Formatter.converter = time.gmtime
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def event(logger: logging.Logger, msg: str, **fields: object) -> None:
    """Log an info event with machine-readable fields."""
    logger.info(msg, extra={"fields": fields})
