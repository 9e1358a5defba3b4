"""What the encoding of the agent's watch events costs: JSON, which the agent asks for, against
protobuf, which upstream kube-proxy asks for, at the apiserver and in the agent.

On a control plane holding N Services x 10 endpoints (bench/workload.py), W watchers of every
EndpointSlice (curl, each on its own connection, as W nodes' agents are) in one encoding at a
time, then none, receive K EndpointSlice changes (one endpoint replaced in each, as
bench/compare.py's changes are). Measured:

- the bytes of one event on the wire (a watch stream is not compressed);
- the apiserver's CPU for the K changes (utime + stime of its process, from before the first
  change to 2 s after the last) with the W watchers of each encoding and with none, median of
  `--rounds` rounds of the three in turn: the difference, divided by W x K, is what one
  watcher costs it per event;
- the agent's CPU to turn one event into the store's compact object (in this process, median
  of `--repeat` passes over every event one watcher received): for JSON the agent's own path
  (`kpx_kube.watch_events.decode_line` and `decode_event`, the store's shrink); for protobuf,
  the frame's length, the `k8s\\0` envelope, the WatchEvent, the object's own envelope, the
  EndpointSlice parsed by upb and read into the form the store shrinks (list_encodings.py's
  reader: the fields the workload's objects carry, so a lower bound of a complete reader).
  Each event the protobuf path makes is checked equal to the JSON path's.

Writes bench/results/watch-encodings.md (not with --no-write).

Usage: python3 bench/watch_encodings.py [--services 1000] [--watchers 50] [--changes 500]
       [--rounds 3] [--repeat 5]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchlib import (
    RESULTS_DIR,
    ApiClient,
    bench_cluster,
    exit_on_sigterm,
    log,
    machine_info,
    machine_line,
    markdown_table,
    wait_until_quiet,
)
from compare import WORKERS
from kpx_agent.store.cluster_state import SLICES, ClusterState
from kpx_kube.watch_events import decode_event, decode_line
from list_encodings import (
    JSON,
    MAGIC,
    PROTOBUF,
    Apiserver,
    protobuf_classes,
    slice_dict,
    timed,
)
from workload import Workload, create_node, grow

SLICES_PATH = "/apis/discovery.k8s.io/v1/endpointslices"
#: After the last change: the events reach every watcher, the apiserver's writes are accounted.
SETTLE_SECONDS = 2.0


@dataclass
class Phase:
    """K changes with some watchers."""

    apiserver_cpu: float
    streams: dict[str, list[bytes]]  # what each watcher received, by encoding


# ---- the apiserver, with W watchers -----------------------------------------------------------


def resource_version(client: ApiClient) -> str:
    listed = client.request("GET", f"{SLICES_PATH}?limit=1")
    return str(listed["metadata"]["resourceVersion"])


def watch_argv(api: Apiserver, encoding: str, rv: str, out: Path) -> list[str]:
    accept = {"JSON": JSON, "protobuf": PROTOBUF}[encoding]
    # (not curl's own User-Agent: the apiserver indents JSON for curl)
    argv = ["curl", "-sS", "-N", "-A", "kpx-bench", *api.tls, "-H", f"Accept: {accept}"]
    return [*argv, "-o", str(out), f"{api.url}{SLICES_PATH}?watch=1&resourceVersion={rv}"]


def run_phase(
    api: Apiserver, client: ApiClient, work: Workload, watchers: list[str], changes: int
) -> Phase:
    """`changes` changes with one watcher of each encoding in `watchers` (none: [])."""
    with tempfile.TemporaryDirectory(prefix="kpx-watch-") as tmp:
        outs = [(encoding, Path(tmp, f"w{i}")) for i, encoding in enumerate(watchers)]
        rv = resource_version(client)
        procs = [
            subprocess.Popen(watch_argv(api, encoding, rv, out), stderr=subprocess.PIPE)
            for encoding, out in outs
        ]
        try:
            time.sleep(1.0)  # every watch established
            wait_until_quiet()
            for proc in procs:
                if proc.poll() is not None:
                    _, err = proc.communicate()
                    raise RuntimeError(f"a watch ended: {err!r}")
            patches = [work.replace_last(i % work.size)[2] for i in range(changes)]
            cpu0 = api.cpu()
            client.many("PATCH", patches)
            time.sleep(SETTLE_SECONDS)
            cpu = api.cpu() - cpu0
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(timeout=10)
        streams: dict[str, list[bytes]] = {}
        for encoding, out in outs:
            streams.setdefault(encoding, []).append(out.read_bytes())
        return Phase(cpu, streams)


# ---- the agent's decoding ---------------------------------------------------------------------


def json_events(stream: bytes, state: ClusterState) -> list[tuple[str, Any]]:
    """The agent's path: each line decoded and checked, its object shrunk."""
    out = []
    for line in stream.splitlines():
        event = decode_event(decode_line(line))
        out.append((event.type, state.shrink(SLICES, event.object)))
    return out


def frames(stream: bytes) -> list[memoryview]:
    """A protobuf watch stream's frames: each a 4-byte big-endian length, then that many bytes
    (a stream cut off inside its last frame leaves that frame out)."""
    out, view, at = [], memoryview(stream), 0
    while at + 4 <= len(stream):
        (size,) = struct.unpack_from(">I", stream, at)
        if at + 4 + size > len(stream):
            break
        out.append(view[at + 4 : at + 4 + size])
        at += 4 + size
    return out


def unwrapped(data: bytes | memoryview, unknown_class: Any) -> bytes:
    """The message inside the `k8s\\0` envelope (runtime.Unknown), or `data` without one."""
    if bytes(data[: len(MAGIC)]) != MAGIC:
        return bytes(data)
    unknown = unknown_class()
    unknown.ParseFromString(data[len(MAGIC) :])
    return bytes(unknown.raw)


def protobuf_events(
    stream: bytes, state: ClusterState, classes: tuple[Any, Any, Any]
) -> list[tuple[str, Any]]:
    unknown_class, event_class, slice_class = classes
    out = []
    for frame in frames(stream):
        event = event_class()
        event.ParseFromString(unwrapped(frame, unknown_class))
        obj = slice_class()
        obj.ParseFromString(unwrapped(event.object.raw, unknown_class))
        out.append((event.type, state.shrink(SLICES, slice_dict(obj))))
    return out


# ---- the run ----------------------------------------------------------------------------------


@dataclass
class Figures:
    bytes_per_event: dict[str, float]
    apiserver_cpu: dict[str, float]  # the K changes, per encoding and "none"
    per_watcher_event_us: dict[str, float]
    agent_us: dict[str, float]
    events: int


def measure(
    api: Apiserver,
    client: ApiClient,
    work: Workload,
    watchers: int,
    changes: int,
    rounds: int,
    repeat: int,
) -> Figures:
    with protobuf_classes() as package:
        classes = (
            package("k8s.io.apimachinery.pkg.runtime").Unknown,
            package("k8s.io.apimachinery.pkg.apis.meta.v1").WatchEvent,
            package("k8s.io.api.discovery.v1").EndpointSlice,
        )
        # The reader checked first: one watcher of each encoding, the same changes.
        both = run_phase(api, client, work, ["JSON", "protobuf"], changes)
        from_json = json_events(both.streams["JSON"][0], ClusterState())
        from_pb = protobuf_events(both.streams["protobuf"][0], ClusterState(), classes)
        if len(from_json) != changes or len(from_pb) != changes:
            raise RuntimeError(f"{len(from_json)} JSON, {len(from_pb)} protobuf events")
        for a, b in zip(from_json, from_pb, strict=True):
            if a != b:
                raise RuntimeError(f"the protobuf reader differs:\n{a}\n{b}")
        log(f"{changes} events read alike from both encodings")
        # Rounds of the three phases in turn: the apiserver's CPU of each is the median over
        # the rounds (its background work lands in one phase or another).
        runs: dict[str, list[Phase]] = {"none": [], "JSON": [], "protobuf": []}
        for _ in range(rounds):
            for encoding in runs:
                listeners = [encoding] * watchers if encoding != "none" else []
                runs[encoding].append(run_phase(api, client, work, listeners, changes))
        cpu = {e: statistics.median(p.apiserver_cpu for p in ps) for e, ps in runs.items()}
        phases = {e: runs[e][0] for e in ("JSON", "protobuf")}
        none = cpu["none"]
        json_cpu, _ = timed(
            functools.partial(json_events, phases["JSON"].streams["JSON"][0], ClusterState()),
            repeat,
        )
        pb_cpu, _ = timed(
            functools.partial(
                protobuf_events, phases["protobuf"].streams["protobuf"][0], ClusterState(), classes
            ),
            repeat,
        )
    for encoding, phase in phases.items():
        sizes = {len(stream) for stream in phase.streams[encoding]}
        if len(sizes) != 1:  # every watcher received every event, byte for byte alike
            raise RuntimeError(f"{encoding}: the watchers received {sorted(sizes)} bytes")
    return Figures(
        {e: len(phases[e].streams[e][0]) / changes for e in phases},
        cpu,
        {e: (cpu[e] - none) / (watchers * changes) * 1e6 for e in phases},
        {"JSON": json_cpu / changes * 1e6, "protobuf": pb_cpu / changes * 1e6},
        changes,
    )


def report(args: argparse.Namespace, f: Figures) -> str:
    headers = [
        "encoding",
        "bytes per event",
        f"apiserver CPU, {f.events} changes, {args.watchers} watchers (median of {args.rounds})",
        "per watcher per event (apiserver)",
        "agent CPU per event",
    ]
    rows: list[list[object]] = [
        [
            e,
            f"{f.bytes_per_event[e]:,.0f} B",
            f"{f.apiserver_cpu[e]:.3f} s",
            f"{f.per_watcher_event_us[e]:.0f} us",
            f"{f.agent_us[e]:.0f} us" + (" (at least)" if e == "protobuf" else ""),
        ]
        for e in ("JSON", "protobuf")
    ]
    rows.append(["(no watcher)", "", f"{f.apiserver_cpu['none']:.3f} s", "", ""])
    info = machine_info()
    return (
        f"## The agent's watch events in JSON and in protobuf, {args.services:,} Services x 10 "
        f"endpoints\n\n"
        f"Machine: {machine_line(info)}. Command: `python3 bench/watch_encodings.py "
        f"{' '.join(sys.argv[1:])}`. Each change replaces one endpoint of one EndpointSlice; "
        f"every watcher watches every EndpointSlice.\n\n"
        f"{markdown_table(headers, rows)}\n"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--services", type=int, default=1000)
    parser.add_argument("--watchers", type=int, default=50)
    parser.add_argument("--changes", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the three phases")
    parser.add_argument("--repeat", type=int, default=5, help="agent decoding passes")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    exit_on_sigterm()
    work = Workload()
    with bench_cluster() as cluster:
        client = ApiClient(cluster, WORKERS)
        try:
            create_node(client, work)
            grow(cluster, client, work, args.services)
            figures = measure(
                Apiserver(cluster),
                client,
                work,
                args.watchers,
                args.changes,
                args.rounds,
                args.repeat,
            )
        finally:
            client.close()
    text = report(args, figures)
    print(text)
    if not args.no_write:
        (RESULTS_DIR / "watch-encodings.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
