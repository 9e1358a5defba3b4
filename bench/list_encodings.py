"""What the encoding of the agent's initial lists costs: JSON, which the agent asks for, against
protobuf, which upstream kube-proxy asks for, at the apiserver and in the agent.

On a control plane holding N Services x 10 endpoints (bench/workload.py), for the Service and
the EndpointSlice lists the agent makes at its start (resourceVersion=0, from the watch
cache), in each encoding, gzip accepted as both clients do:

- the bytes the apiserver sends, and what they decompress to;
- the apiserver's CPU per list (utime + stime of its process around one request, median of
  `--repeat`) and the time to the last byte (curl's total, its connection and TLS handshake
  included);
- the agent's CPU to turn the body into the store's compact objects (in this process, median of
  `--repeat`): for JSON the agent's own path (kpx_kube.list_body fed 64 KiB chunks as they
  decompress, each item shrunk by the store); for protobuf, decompressing, unwrapping the
  `k8s\\0` envelope, parsing the list with the protobuf runtime the agent already ships (upb,
  for its state API) and reading each item's fields into the form the store shrinks. The
  protobuf reader here reads only the fields the workload's objects carry, so it is a lower
  bound of what a complete one costs; each item it makes is checked equal to the JSON path's.

The protobuf classes are generated at run time (grpc_tools' protoc) from the `k8s.io/api` and
`k8s.io/apimachinery` Go modules of the Kubernetes version the harness runs (the Go module
cache; `go mod download` fetches them when missing).

Writes bench/results/list-encodings-N.md (not with --no-write).

Usage: python3 bench/list_encodings.py [--services 10000] [--repeat 5] [--control-plane NAME]
(`--control-plane`: measure a running harness control plane that already holds the workload,
e.g. one a scratch benchmark keeps, instead of making one.)
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from benchlib import (
    RESULTS_DIR,
    ApiClient,
    bench_cluster,
    component_pid,
    exit_on_sigterm,
    log,
    machine_info,
    machine_line,
    markdown_table,
    proc_cpu_seconds,
    wait_until_quiet,
)
from compare import WORKERS
from kpx_agent.store.cluster_state import SERVICES, SLICES, ClusterState
from kpx_cluster.binaries import KUBERNETES_VERSION
from kpx_cluster.controlplane import Cluster
from kpx_kube.list_body import ListBody
from workload import Workload, create_node, grow

JSON = "application/json"
PROTOBUF = "application/vnd.kubernetes.protobuf"
MAGIC = b"k8s\x00"
CHUNK = 64 * 1024
PROTOS = (
    "k8s.io/api/core/v1/generated.proto",
    "k8s.io/api/discovery/v1/generated.proto",
    "k8s.io/apimachinery/pkg/api/resource/generated.proto",
    "k8s.io/apimachinery/pkg/apis/meta/v1/generated.proto",
    "k8s.io/apimachinery/pkg/runtime/generated.proto",
    "k8s.io/apimachinery/pkg/runtime/schema/generated.proto",
    "k8s.io/apimachinery/pkg/util/intstr/generated.proto",
)
LISTS = (
    (SERVICES, "/api/v1/services", "k8s.io.api.core.v1", "ServiceList"),
    (
        SLICES,
        "/apis/discovery.k8s.io/v1/endpointslices",
        "k8s.io.api.discovery.v1",
        "EndpointSliceList",
    ),
)


# ---- the protobuf classes ------------------------------------------------------------------


def module_dir(module: str, version: str) -> Path:
    out = subprocess.run(
        ["go", "mod", "download", "-json", f"{module}@{version}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return Path(json.loads(out)["Dir"])


@contextmanager
def protobuf_classes() -> Iterator[Callable[[str], ModuleType]]:
    """The generated modules, imported by proto package (e.g. "k8s.io.api.core.v1")."""
    version = "v0" + KUBERNETES_VERSION[2:]  # v1.36.2 -> v0.36.2
    with tempfile.TemporaryDirectory(prefix="kpx-protos-") as tmp:
        src, out = Path(tmp, "src"), Path(tmp, "out")
        for module in ("k8s.io/api", "k8s.io/apimachinery"):
            target = src / module
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(module_dir(module, version))
        out.mkdir()
        subprocess.run(
            [sys.executable, "-m", "grpc_tools.protoc", f"-I{src}", f"--python_out={out}", *PROTOS],
            check=True,
            capture_output=True,
        )
        sys.path.insert(0, str(out))
        try:
            yield lambda package: importlib.import_module(f"{package}.generated_pb2")
        finally:
            sys.path.remove(str(out))


# ---- protobuf items read into the form the store shrinks -------------------------------------


def _time(t: Any) -> str:
    stamp = datetime.datetime.fromtimestamp(t.seconds, datetime.UTC)
    return stamp.strftime("%Y-%m-%dT%H:%M:%SZ")


def _meta(m: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"name": m.name, "namespace": m.namespace}
    if m.HasField("creationTimestamp"):
        out["creationTimestamp"] = _time(m.creationTimestamp)
    if m.labels:
        out["labels"] = dict(m.labels)
    if m.annotations:
        out["annotations"] = dict(m.annotations)
    return out


def service_dict(s: Any) -> dict[str, Any]:
    spec = s.spec
    ports = []
    for p in spec.ports:
        port: dict[str, Any] = {"protocol": p.protocol, "port": p.port}
        if p.name:
            port = {"name": p.name, **port}
        t = p.targetPort
        port["targetPort"] = t.strVal if t.type == 1 else t.intVal
        if p.nodePort:
            port["nodePort"] = p.nodePort
        ports.append(port)
    out: dict[str, Any] = {"ports": ports}
    for key in (
        "clusterIP",
        "type",
        "sessionAffinity",
        "ipFamilyPolicy",
        "internalTrafficPolicy",
        "externalTrafficPolicy",
    ):
        if value := getattr(spec, key):  # the JSON leaves an empty string out
            out[key] = value
    for key in ("clusterIPs", "ipFamilies", "externalIPs", "loadBalancerSourceRanges"):
        if values := getattr(spec, key):
            out[key] = list(values)
    if spec.selector:
        out["selector"] = dict(spec.selector)
    status: dict[str, Any] = {"loadBalancer": {}}
    ingress = [{"ip": i.ip} for i in s.status.loadBalancer.ingress]
    if ingress:
        status["loadBalancer"]["ingress"] = ingress
    return {"metadata": _meta(s.metadata), "spec": out, "status": status}


def slice_dict(s: Any) -> dict[str, Any]:
    endpoints = []
    for ep in s.endpoints:
        c = ep.conditions
        conditions = {}
        for key in ("ready", "serving", "terminating"):
            if c.HasField(key):
                conditions[key] = getattr(c, key)
        e: dict[str, Any] = {"addresses": list(ep.addresses), "conditions": conditions}
        if ep.HasField("nodeName"):
            e["nodeName"] = ep.nodeName
        if ep.HasField("zone"):
            e["zone"] = ep.zone
        endpoints.append(e)
    ports = []
    for p in s.ports:
        port: dict[str, Any] = {}
        if p.HasField("name"):
            port["name"] = p.name
        if p.HasField("protocol"):
            port["protocol"] = p.protocol
        if p.HasField("port"):
            port["port"] = p.port
        ports.append(port)
    return {
        "metadata": _meta(s.metadata),
        "addressType": s.addressType,
        "endpoints": endpoints,
        "ports": ports,
    }


# ---- the apiserver ----------------------------------------------------------------------------


@dataclass
class Fetched:
    body: bytes  # as sent (gzip)
    seconds: float  # request to last byte
    apiserver_cpu: float


class Apiserver:
    """The lists fetched with curl: the body exactly as sent (gzip, either encoding), which the
    agent's client (kpx_kube, the one apiserver client of the product) never asks for."""

    def __init__(self, cluster: Cluster) -> None:
        self.url = f"https://127.0.0.1:{cluster.apiserver_port}"
        self.pid = component_pid(cluster, "kube-apiserver")
        pki = cluster.pki_dir
        self.tls = ["--cacert", str(cluster.ca_file), "--cert", str(pki / "admin.crt")]
        self.tls += ["--key", str(pki / "admin.key")]

    def cpu(self) -> float:
        return sum(proc_cpu_seconds(self.pid)) if self.pid else 0.0

    def fetch(self, path: str, accept: str) -> Fetched:
        wait_until_quiet()
        with tempfile.TemporaryDirectory(prefix="kpx-list-") as tmp:
            body_file, head_file = Path(tmp, "body"), Path(tmp, "head")
            # (not curl's own User-Agent: the apiserver indents JSON for curl)
            argv = ["curl", "-sS", "-A", "kpx-bench", *self.tls, "-H", f"Accept: {accept}"]
            argv += ["-H", "Accept-Encoding: gzip", "-o", str(body_file), "-D", str(head_file)]
            argv += ["-w", "%{http_code} %{time_total}", f"{self.url}{path}?resourceVersion=0"]
            cpu0 = self.cpu()
            out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
            time.sleep(0.2)  # the apiserver's last writes are accounted
            cpu = self.cpu() - cpu0
            status, seconds = out.split()
            body = body_file.read_bytes()
            head = head_file.read_text().lower()
        if status != "200":
            raise RuntimeError(f"GET {path} ({accept}): HTTP {status}: {body[:200]!r}")
        if "content-encoding: gzip" not in head:
            raise RuntimeError(f"GET {path} ({accept}): not gzipped")
        return Fetched(body, float(seconds), cpu)


# ---- the agent's decoding ---------------------------------------------------------------------


def json_items(body: bytes, kind: str, state: ClusterState) -> list[Any]:
    """The agent's path: decompressed chunk by chunk into ListBody, each item shrunk."""
    decoder = ListBody(lambda obj: state.shrink(kind, obj))
    inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
    for i in range(0, len(body), CHUNK):
        decoder.feed(inflate.decompress(body[i : i + CHUNK]))
    decoder.feed(inflate.flush())
    items: list[Any] = decoder.finish()["items"]
    return items


def protobuf_items(
    body: bytes, kind: str, state: ClusterState, classes: tuple[Any, Any]
) -> list[Any]:
    unknown_class, list_class = classes
    data = zlib.decompress(body, 16 + zlib.MAX_WBITS)
    if not data.startswith(MAGIC):
        raise ValueError("not a Kubernetes protobuf body")
    unknown = unknown_class()
    unknown.ParseFromString(memoryview(data)[len(MAGIC) :])
    listed = list_class()
    listed.ParseFromString(unknown.raw)
    to_dict = service_dict if kind == SERVICES else slice_dict
    return [state.shrink(kind, to_dict(item)) for item in listed.items]


def timed(fn: Callable[[], list[Any]], repeat: int) -> tuple[float, list[Any]]:
    times, result = [], []
    for _ in range(repeat):
        t0 = time.process_time()
        result = fn()
        times.append(time.process_time() - t0)
    return statistics.median(times), result


# ---- the run ----------------------------------------------------------------------------------


def measure(
    cluster: Cluster, repeat: int
) -> tuple[list[list[object]], dict[str, dict[str, float]]]:
    """The table's rows, and per encoding the sums of both lists (bytes sent, apiserver CPU,
    agent CPU)."""
    api = Apiserver(cluster)
    rows: list[list[object]] = []
    totals = {
        e: {"sent": 0.0, "apiserver_cpu": 0.0, "agent_cpu": 0.0} for e in ("JSON", "protobuf")
    }
    with protobuf_classes() as package:
        unknown_class = package("k8s.io.apimachinery.pkg.runtime").Unknown
        for kind, path, proto_package, list_name in LISTS:
            classes = (unknown_class, getattr(package(proto_package), list_name))
            fetched = {
                accept: [api.fetch(path, accept) for _ in range(repeat)]
                for accept in (JSON, PROTOBUF)
            }
            state = ClusterState()
            json_cpu, from_json = timed(
                functools.partial(json_items, fetched[JSON][0].body, kind, state), repeat
            )
            pb_cpu, from_pb = timed(
                functools.partial(protobuf_items, fetched[PROTOBUF][0].body, kind, state, classes),
                repeat,
            )
            if len(from_pb) != len(from_json):
                raise RuntimeError(f"{kind}: {len(from_pb)} protobuf items, {len(from_json)} JSON")
            for a, b in zip(from_json, from_pb, strict=True):
                if a != b:
                    raise RuntimeError(f"{kind}: the protobuf reader differs:\n{a}\n{b}")
            for accept, agent_cpu in ((JSON, json_cpu), (PROTOBUF, pb_cpu)):
                runs = fetched[accept]
                body = runs[0].body
                encoding = "JSON" if accept == JSON else "protobuf"
                apiserver_cpu = statistics.median(r.apiserver_cpu for r in runs)
                total = totals[encoding]
                total["sent"] += len(body)
                total["apiserver_cpu"] += apiserver_cpu
                total["agent_cpu"] += agent_cpu
                rows.append(
                    [
                        kind,
                        encoding,
                        f"{len(body) / 1e6:.2f} MB",
                        f"{len(zlib.decompress(body, 16 + zlib.MAX_WBITS)) / 1e6:.1f} MB",
                        f"{apiserver_cpu:.3f} s",
                        f"{statistics.median(r.seconds for r in runs):.3f} s",
                        f"{agent_cpu:.3f} s",
                    ]
                )
            log(f"{kind}: {len(from_json):,} items measured")
    return rows, totals


def report(n: int, rows: list[list[object]], totals: dict[str, dict[str, float]]) -> str:
    headers = [
        "list",
        "encoding",
        "sent (gzip)",
        "decompressed",
        "apiserver CPU per list",
        "to the last byte",
        "agent CPU to the store's form",
    ]
    info = machine_info()
    json_, pb = totals["JSON"], totals["protobuf"]
    return (
        f"## The agent's initial lists in JSON and in protobuf, {n:,} Services x 10 endpoints\n\n"
        f"Machine: {machine_line(info)}. Command: `python3 bench/list_encodings.py "
        f"{' '.join(sys.argv[1:])}`.\n\n"
        f"{markdown_table(headers, rows)}\n\n"
        f"Both lists: the apiserver {json_['apiserver_cpu']:.3f} s of CPU in JSON, "
        f"{pb['apiserver_cpu']:.3f} s in protobuf; the agent {json_['agent_cpu']:.3f} s in "
        f"JSON, at least {pb['agent_cpu']:.3f} s in protobuf; "
        f"{json_['sent'] / 1e6:.2f} MB against {pb['sent'] / 1e6:.2f} MB sent.\n"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--services", type=int, default=10000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--control-plane", help="a running harness control plane's name")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    if args.control_plane:
        rows, totals = measure(Cluster(args.control_plane), args.repeat)
    else:
        exit_on_sigterm()
        work = Workload()
        with bench_cluster() as cluster:
            api = ApiClient(cluster, WORKERS)
            try:
                create_node(api, work)
                grow(cluster, api, work, args.services)
            finally:
                api.close()
            rows, totals = measure(cluster, args.repeat)
    text = report(args.services, rows, totals)
    print(text)
    if not args.no_write:
        (RESULTS_DIR / f"list-encodings-{args.services}.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
