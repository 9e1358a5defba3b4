"""Log output as Kubernetes components give it (klog): `--logging-format text|json` and `-v N`.

text: `<time> <LEVEL> <logger>: <message>`, one line per record.
json: one JSON object per line, klog's keys: `ts` (seconds since the epoch), `caller`
(file:line), `msg`, `v` (the record's verbosity: 0 for info, 4 for debug; absent on warnings
and errors, as in klog), `err` on errors (the exception, or the message); kpx adds `logger`
and `level`, and the record's structured fields (`extra={"fields": {...}}`) as keys.

Verbosity: `-v` alone is 4 (debug: each sync, each watch event's summary); `-v N` with N >= 4
is debug too, below that info; the default 0 is info.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import IO, Any

TEXT, JSON = "text", "json"
FORMATS = (TEXT, JSON)
DEBUG_VERBOSITY = 4
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--logging-format",
        choices=FORMATS,
        default=TEXT,
        help="log format: text (default) or json (one object per line, klog's keys)",
    )
    parser.add_argument(
        "-v",
        "--v",
        "--verbose",
        dest="verbosity",
        type=int,
        nargs="?",
        const=DEBUG_VERBOSITY,
        default=0,
        metavar="N",
        help=f"log verbosity, as klog's -v: {DEBUG_VERBOSITY} or more logs debug detail (each "
        f"sync); -v alone is {DEBUG_VERBOSITY}",
    )


def level_of(verbosity: int) -> int:
    return logging.DEBUG if verbosity >= DEBUG_VERBOSITY else logging.INFO


class JSONFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 6),
            "caller": f"{record.filename}:{record.lineno}",
            "msg": record.getMessage(),
        }
        if record.levelno < logging.WARNING:
            out["v"] = 0 if record.levelno >= logging.INFO else DEBUG_VERBOSITY
        else:
            out["level"] = "error" if record.levelno >= logging.ERROR else "warning"
        out["logger"] = record.name
        if record.exc_info:
            out["err"] = self.formatException(record.exc_info)
        elif record.levelno >= logging.ERROR:
            out["err"] = out["msg"]
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            for key, value in fields.items():
                out.setdefault(str(key), value)
        return json.dumps(out, default=str, ensure_ascii=False)


def configure(fmt: str, verbosity: int, stream: IO[str] | None = None) -> None:
    """Log `fmt` at `verbosity`: the handler a previous call installed is replaced; as
    logging.basicConfig, none is added where another one is in place (a test's capture)
    unless `stream` is given."""
    root = logging.getLogger()
    ours = [h for h in root.handlers if getattr(h, "kpx_logformat", False)]
    for old in ours:
        root.removeHandler(old)
    if stream is not None or not root.handlers:
        handler = logging.StreamHandler(stream or sys.stderr)
        handler.setFormatter(JSONFormatter() if fmt == JSON else logging.Formatter(TEXT_FORMAT))
        handler.kpx_logformat = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    root.setLevel(level_of(verbosity))


def early_format(argv: list[str]) -> str:
    """The --logging-format of argv, before it is parsed (so that the parsing's own errors
    and subcommands log as asked): text unless json is given."""
    for i, arg in enumerate(argv):
        if arg == "--logging-format" and argv[i + 1 : i + 2] == [JSON]:
            return JSON
        if arg == f"--logging-format={JSON}":
            return JSON
    return TEXT
