"""`proxy-vm`: a guest whose kernel has IPVS, for kernel tests this host's kernel cannot run.

proxy-vm up [--name N]          boot a guest and keep it up
proxy-vm exec [--name N] -- CMD ARGS...
                                run CMD in the guest (booting a throwaway one when N is not
                                up); prints its output, exits with its exit code
proxy-vm status [--name N]      say whether the guest runs and answers
proxy-vm down [--name N]        stop it
proxy-vm build                  build (or find cached) the guest image, print where
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from . import image as vm_image
from .machine import Guest, VMError, host_env


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="proxy-vm",
        description="A qemu guest with Debian's kernel (IPVS as a module) that sees the "
        "project, the Kubernetes binaries and the local control plane at the host's paths.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (
        ("up", "boot the guest and keep it up"),
        ("down", "stop the guest"),
        ("status", "say whether the guest runs and answers"),
        ("exec", "run a command in the guest (after --)"),
        ("build", "build the guest image unless cached; print its directory"),
    ):
        cmd = sub.add_parser(name, help=text)
        if name != "build":
            cmd.add_argument("--name", default="default", help="guest name (default: default)")
        if name == "exec":
            cmd.add_argument("argv", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    return parser


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if os.geteuid() != 0:
        _log("proxy-vm: needs root (9p passthrough shares keep the host's file owners)")
        return 1
    try:
        if args.command == "build":
            print(vm_image.build().directory)
            return 0
        guest = Guest(args.name)
        if args.command == "up":
            guest.up(_log)
            print(f"guest {guest.name!r} is up (console: {guest.console_log})")
            return 0
        if args.command == "down":
            print("stopped" if guest.down() else "nothing was running")
            return 0
        if args.command == "status":
            if guest.pid() is None:
                print(f"guest {guest.name!r}: not running")
                return 3
            healthy = guest.ping()
            print(f"guest {guest.name!r}: {'running' if healthy else 'NOT ANSWERING'}")
            return 0 if healthy else 1
        command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        if not command:
            _log("proxy-vm exec: give a command after --")
            return 2
        return run(guest, command)
    except (VMError, RuntimeError) as exc:
        _log(f"proxy-vm: {exc}")
        return 1


def run(guest: Guest, command: list[str]) -> int:
    """Run in `guest` if it is up, else in a throwaway guest booted for this command."""
    if guest.pid() is not None:
        return guest.exec(command, host_env(), Path.cwd())
    throwaway = Guest(f"exec-{os.getpid()}")
    try:
        throwaway.up(_log)
        return throwaway.exec(command, host_env(), Path.cwd())
    finally:
        throwaway.down()


if __name__ == "__main__":
    sys.exit(main())
