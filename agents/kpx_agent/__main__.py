"""`proxy-agent` and `python -m kpx_agent`: the agent's command line (cli.py), imported with
the cyclic garbage collector off.

Importing the agent makes about 80,000 objects the collector tracks (functions, classes,
pydantic and dataclass machinery) and no garbage worth collecting; with the collector on, its
generation scans during the imports cost about 45 ms of every start (measured on the 2-core
lab machine: 0.44 s instead of 0.49 s to import `kpx_agent.cli`, median of 15). It is back on
before anything runs, with the agent's own thresholds (cli.main)."""

from __future__ import annotations

import gc
import sys


def main() -> int:
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        from .cli import main as run
    finally:
        if was_enabled:
            gc.enable()
    return run()


if __name__ == "__main__":
    sys.exit(main())
