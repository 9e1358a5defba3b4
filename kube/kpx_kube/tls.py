"""An ssl.SSLContext for the apiserver, built from PEM bytes without leaving key files behind.

Python's ssl module loads a client certificate and key only from a path
(`SSLContext.load_cert_chain`). The PEM bytes are written to an anonymous memory file
(`os.memfd_create`), loaded through `/proc/self/fd/N`, and the descriptor is closed at once:
the key never reaches a filesystem, so nothing can be left behind, even when the process is
killed halfway (a temporary file deleted after loading would leave the key on disk in that
case, and is readable by the file's owner for a moment). Where memfd or /proc is missing
(not Linux), an unlinked temporary file in a private folder is the fallback.
The CA bundle is loaded from memory directly (`cadata`).
"""

from __future__ import annotations

import contextlib
import os
import ssl
import tempfile
from collections.abc import Iterator


@contextlib.contextmanager
def _memory_file(data: bytes) -> Iterator[str]:
    """A path whose content is `data`, valid inside the `with` block only."""
    if hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd"):
        fd = os.memfd_create("kpx-kube", os.MFD_CLOEXEC)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            yield f"/proc/self/fd/{fd}"
        finally:
            os.close(fd)
        return
    with tempfile.TemporaryDirectory(prefix="kpx-kube-") as folder:  # pragma: no cover
        path = os.path.join(folder, "pem")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        try:
            yield path
        finally:
            os.unlink(path)


def ssl_context(
    *,
    ca: bytes | None = None,
    cert: bytes | None = None,
    key: bytes | None = None,
    insecure: bool = False,
) -> ssl.SSLContext:
    """A client context: trust `ca` (else the system's CAs), present cert+key if given."""
    ctx = ssl.create_default_context(cadata=ca.decode("ascii") if ca else None)
    if insecure:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    if cert is not None and key is not None:
        with _memory_file(cert) as cert_path, _memory_file(key) as key_path:
            ctx.load_cert_chain(cert_path, key_path)
    return ctx
