"""The guest side of `proxy-vm`: PID 1 of the VM, and the command server it starts.

This file is copied into the guest image (its content is part of the image recipe's hash). It
runs with the guest's Debian python3 and the standard library only.

The image's init stub (image.INIT_STUB) mounts the project's share and runs this file from it.
As PID 1 it mounts the pseudo file systems and the host's 9p shares named on the kernel command
line (`kpx.share.N=TAG:PATH`), brings up the user-mode network (10.0.2.15, gateway 10.0.2.2,
which is the host's loopback), then forks the command server and reaps every orphan.

The command server listens on TCP 7000 (qemu forwards a host loopback port to it). A request is
one JSON line: {"token", "argv", "env", "cwd", "forward"}; the answer is frames of
1 byte channel (1 stdout, 2 stderr, 3 exit code) + 4 bytes big-endian length + data.
`forward` lists host loopback TCP ports that must answer on the guest's 127.0.0.1 as well: the
server relays each to 10.0.2.2 (qemu user-mode networking's alias of the host's loopback).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

PORT = 7000
TOKEN_FILE_ARG = "kpx.token_file"  # noqa: S105 (a kernel argument name)
HOST_ALIAS = "10.0.2.2"
STDOUT, STDERR, EXIT = 1, 2, 3


def _cmdline() -> dict[str, str]:
    out: dict[str, str] = {}
    for word in Path("/proc/cmdline").read_text().split():
        key, _, value = word.partition("=")
        out[key] = value
    return out


def _run(*argv: str) -> None:
    subprocess.run(argv, check=False, stderr=subprocess.DEVNULL)


def _boot(cmdline: dict[str, str]) -> None:
    # The init stub mounted the project's share (kpx.share.0) before this file ran, at the host's
    # path: a tmpfs on a folder holding it (/tmp for a checkout in /tmp) would hide it.
    project = cmdline.get("kpx.share.0", ":").partition(":")[2].rstrip("/") + "/"
    for fstype, target in (
        ("proc", "/proc"),
        ("sysfs", "/sys"),
        ("devtmpfs", "/dev"),
        ("tmpfs", "/run"),
        ("tmpfs", "/tmp"),
    ):
        if fstype == "tmpfs" and project.startswith(target + "/"):
            continue
        os.makedirs(target, exist_ok=True)
        _run("mount", "-t", fstype, fstype, target)
    for target, fstype in (("/dev/pts", "devpts"), ("/dev/shm", "tmpfs")):
        os.makedirs(target, exist_ok=True)
        _run("mount", "-t", fstype, fstype, target)
    _run("mount", "-o", "remount,rw", "/")
    _run("mount", "-t", "cgroup2", "none", "/sys/fs/cgroup")
    _run("modprobe", "-a", "virtio_net", "9pnet_virtio", "9p", "ip_vs", "veth")
    shares = sorted(
        (
            value.split(":", 1)
            for key, value in cmdline.items()
            if key.startswith("kpx.share.") and key != "kpx.share.0"  # mounted by the init stub
        ),
        key=lambda tag_path: len(tag_path[1]),
    )
    for tag, path in shares:
        os.makedirs(path, exist_ok=True)
        _run(
            "mount",
            "-t",
            "9p",
            "-o",
            "trans=virtio,version=9p2000.L,msize=262144,cache=none",
            tag,
            path,
        )
    scratch = cmdline.get("kpx.scratch")
    if scratch:  # a disk of its own for what does not fit the root image (machine.Guest.up)
        os.makedirs(scratch, exist_ok=True)
        _run("mount", "LABEL=kpxscratch", scratch)
    _run("ip", "link", "set", "lo", "up")
    _run("ip", "link", "set", "eth0", "up")
    _run("ip", "addr", "add", "10.0.2.15/24", "dev", "eth0")
    _run("ip", "route", "add", "default", "via", HOST_ALIAS)
    Path("/etc/resolv.conf").write_text("nameserver 10.0.2.3\n")
    os.makedirs("/run/netns", exist_ok=True)
    os.environ["PATH"] = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    os.environ["HOME"] = "/root"


# ---- loopback relays ----------------------------------------------------------------------------

_relays: set[int] = set()
_relays_lock = threading.Lock()


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


def _relay(listener: socket.socket, port: int) -> None:
    while True:
        client, _ = listener.accept()
        try:
            upstream = socket.create_connection((HOST_ALIAS, port), timeout=10)
            upstream.settimeout(None)
        except OSError:
            client.close()
            continue
        threading.Thread(target=_pipe, args=(client, upstream), daemon=True).start()
        threading.Thread(target=_pipe, args=(upstream, client), daemon=True).start()


def ensure_relays(ports: list[int]) -> None:
    with _relays_lock:
        for port in ports:
            if port in _relays or not 0 < port < 65536 or port == PORT:
                continue
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                listener.bind(("127.0.0.1", port))
            except OSError:
                listener.close()
                continue
            listener.listen(128)
            _relays.add(port)
            threading.Thread(target=_relay, args=(listener, port), daemon=True).start()


# ---- command server -----------------------------------------------------------------------------


def _frame(conn: socket.socket, lock: threading.Lock, channel: int, data: bytes) -> None:
    with lock:
        conn.sendall(struct.pack(">BI", channel, len(data)) + data)


def _stream(conn: socket.socket, lock: threading.Lock, channel: int, pipe) -> None:
    while data := pipe.read1(65536):
        try:
            _frame(conn, lock, channel, data)
        except OSError:
            return


def _serve_one(conn: socket.socket, token: str) -> None:
    with conn, conn.makefile("rb") as reader:
        request = json.loads(reader.readline())
        if request.get("token") != token:
            return
        lock = threading.Lock()
        if request.get("op") == "ping":
            _frame(conn, lock, EXIT, b"0")
            return
        if request.get("op") == "poweroff":
            _frame(conn, lock, EXIT, b"0")
            os.sync()
            os.kill(1, 15)
            return
        ensure_relays([int(p) for p in request.get("forward", [])])
        env = dict(os.environ)
        env.update(request.get("env", {}))
        try:
            proc = subprocess.Popen(
                request["argv"],
                cwd=request.get("cwd") or "/",
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        except OSError as exc:
            _frame(conn, lock, STDERR, f"proxy-vm guest: {exc}\n".encode())
            _frame(conn, lock, EXIT, b"127")
            return
        threads = [
            threading.Thread(target=_stream, args=(conn, lock, ch, pipe))
            for ch, pipe in ((STDOUT, proc.stdout), (STDERR, proc.stderr))
        ]
        for t in threads:
            t.start()
        code = proc.wait()
        for t in threads:
            t.join()
        _frame(conn, lock, EXIT, str(code if code >= 0 else 128 - code).encode())


def serve(token_file: str) -> None:
    token = ""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("0.0.0.0", PORT))  # noqa: S104 (only qemu's forwarded port reaches it)
    listener.listen(64)
    while True:
        conn, _ = listener.accept()
        if not token:
            token = Path(token_file).read_text().strip()
        threading.Thread(target=_serve_logged, args=(conn, token), daemon=True).start()


def _serve_logged(conn: socket.socket, token: str) -> None:
    try:
        _serve_one(conn, token)
    except Exception as exc:
        print(f"kpx-vm: request failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)


def _pid1() -> None:
    cmdline = _cmdline()
    _boot(cmdline)
    subprocess.run(["ip", "-br", "addr"], check=False)
    subprocess.run(["sh", "-c", "grep 9p /proc/mounts"], check=False)
    print("kpx-vm: guest ready", flush=True)
    child = os.fork()
    if child == 0:
        serve(cmdline[TOKEN_FILE_ARG])
        os._exit(0)
    import signal

    signal.signal(signal.SIGTERM, lambda *_: _poweroff())
    while True:
        try:
            pid, _ = os.wait()
        except ChildProcessError:
            time.sleep(1)
            continue
        if pid == child:
            _poweroff()


def _poweroff() -> None:
    os.sync()
    # reboot(2) with LINUX_REBOOT_CMD_POWER_OFF through the kernel's sysrq: o = power off
    Path("/proc/sysrq-trigger").write_text("o")
    time.sleep(10)


if __name__ == "__main__":
    if os.getpid() == 1:
        _pid1()
    else:
        serve(sys.argv[1])
