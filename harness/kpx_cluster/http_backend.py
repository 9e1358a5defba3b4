"""A tiny HTTP backend for the demo: answers every GET with its pod name and the client's IP."""

from __future__ import annotations

import argparse
import contextlib
import socket
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--name", required=True)
    parser.add_argument("--port", type=int, default=8080)
    args = parser.parse_args(argv)
    name = args.name

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = f"hello from {name} (you are {self.client_address[0]})\n".encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            return

    class DualStackServer(ThreadingHTTPServer):
        address_family = socket.AF_INET6

        def server_bind(self) -> None:
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            super().server_bind()

    server = DualStackServer(("::", args.port), Handler)
    print("ready", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
