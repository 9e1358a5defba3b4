"""`proxy-agent` and `python -m kpx_agent`: the agent's command line (cli.py), imported with the
cyclic garbage collector off and without the system's CA bundle.

Importing the agent makes about 80,000 objects the collector tracks (functions, classes,
pydantic and dataclass machinery) and no garbage worth collecting; with the collector on, its
generation scans during the imports cost about 45 ms of every start (measured on the 2-core
lab machine: 0.44 s instead of 0.49 s to import `kpx_agent.cli`, median of 15). Those objects
live as long as the process: they are frozen (`gc.freeze`) before the collector is back on,
or its first pass, at the first allocation after, would scan all of them (27-31 ms on the lab
machine). It is back on before anything runs, with the agent's own thresholds (cli.main).

aiohttp makes two default SSL contexts when it is imported, and each parses the system's CA
bundle: about 65 ms of the import (measured on the lab machine: `import aiohttp` 302 ms
against 237 ms, median of 11). The agent never uses them: every request it makes carries its
own context (`kpx_kube.tls`, from the kubeconfig or the service account's CA). While the agent
is imported, `SSL_CERT_FILE` names a file that does not exist, so OpenSSL has no bundle to parse
(a missing default file is not an error to it) and those two contexts trust nothing (a request
that used one would fail, not pass unverified). The variable is put back as it was before
anything runs, so a context made later from the system's CAs (a kubeconfig without a CA)
reads the bundle as always."""

from __future__ import annotations

import contextlib
import gc
import os
import sys
from collections.abc import Iterator

#: What `SSL_CERT_FILE` names while the agent is imported: no file.
NO_CA_FILE = "/nonexistent/kpx-agent-import"


@contextlib.contextmanager
def _no_system_ca_file() -> Iterator[None]:
    saved = os.environ.get("SSL_CERT_FILE")
    os.environ["SSL_CERT_FILE"] = NO_CA_FILE
    try:
        yield
    finally:
        if saved is None:
            del os.environ["SSL_CERT_FILE"]
        else:
            os.environ["SSL_CERT_FILE"] = saved


def main() -> int:
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with _no_system_ca_file():
            from .cli import main as run
    finally:
        if was_enabled:
            gc.freeze()
            gc.enable()
    return run()


if __name__ == "__main__":
    sys.exit(main())
