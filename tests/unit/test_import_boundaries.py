"""The layers, as the imports show them (issue #14's "Done when"):

- backends do not import the model's internals or each other: every module under
  kpx_agent/backends/ imports of the agent only the node-local model's data types
  (`localnet`), the backend contract (`backends.base`) and its own backend;
- the operator and the agent never import each other; the shared API models do no I/O;
- the product packages (kpx_api, kpx_kube, kpx_agent, kpx_localstate_client, kpx_operator) do
  not import the harness (statically, and not even dynamically: they all import with kpx_cluster
  unimportable), the benchmarks or the tests;
- the Kubernetes client layer (kpx_kube) sits below the agent, the operator, the harness and the
  benchmarks (all may import it) and imports none of them, nor kopf; and it is the only code
  that talks HTTP to the apiserver: nothing else imports an HTTP client (aiohttp's client,
  urllib.request, http.client, requests, ...), except kopf inside, the agent's and operator's
  own HTTP servers (aiohttp.web), and the few excused non-apiserver clients (NOT_APISERVER)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from kpx_agent.backends import REGISTRY

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = ROOT / "agents" / "kpx_agent" / "backends"


def imported_modules(path: Path, package: str) -> set[str]:
    """Absolute names of everything `path` imports (relative imports resolved)."""
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base]) if base else ".".join(parts)
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names)
    return out


@pytest.mark.parametrize("mode", sorted(REGISTRY))
def test_mode_packages_do_not_import_each_other(mode: str) -> None:
    others = {f"kpx_agent.backends.{m}" for m in REGISTRY if m != mode}
    for path in (BACKENDS / mode).rglob("*.py"):
        package = f"kpx_agent.backends.{mode}"
        for name in imported_modules(path, package):
            assert not any(name == o or name.startswith(o + ".") for o in others), (
                f"{path.relative_to(ROOT)} imports {name}"
            )


@pytest.mark.parametrize(
    ("folder", "forbidden"),
    [
        ("agents/kpx_agent", ("kpx_operator", "kpx_cluster", "kopf")),
        ("agents/kpx_kube", ("kpx_agent", "kpx_operator", "kpx_cluster", "kopf", "kubernetes")),
        ("operator/kpx_operator", ("kpx_agent", "kpx_cluster")),
        ("agents/kpx_localstate_client", ("kpx_agent", "kpx_kube", "kpx_operator", "kpx_cluster",
                                          "kopf")),
        ("api/kpx_api", ("kpx_agent", "kpx_operator", "kpx_cluster", "aiohttp", "subprocess",
                         "kopf", "socket")),
    ],
)  # fmt: skip
def test_layers(folder: str, forbidden: tuple[str, ...]) -> None:
    for path in (ROOT / folder).rglob("*.py"):
        package = ".".join(path.relative_to(ROOT / folder.split("/")[0]).parent.parts)
        for name in imported_modules(path, package):
            assert not name.startswith(forbidden), f"{path.relative_to(ROOT)} imports {name}"


def test_agent_backends_are_the_modes_the_api_says_have_one() -> None:
    """One gate: the operator deploys only modes in kpx_api.MODES_WITH_BACKEND (it may not
    import the agent), so the agent's registry must list exactly those."""
    from kpx_api import MODES_WITH_BACKEND

    assert set(REGISTRY) == {str(m) for m in MODES_WITH_BACKEND}


#: The product's packages (what the agent and operator distributions ship) and their folders.
PRODUCT = ("kpx_api", "kpx_kube", "kpx_agent", "kpx_localstate_client", "kpx_operator")
PRODUCT_FOLDERS = ("api/kpx_api", "agents/kpx_kube", "agents/kpx_agent",
                   "agents/kpx_localstate_client", "operator/kpx_operator")  # fmt: skip


def test_the_product_imports_nothing_of_the_benchmarks_or_the_tests() -> None:
    """bench/ and tests/ modules are imported by their file names (sys.path): no product
    module imports one (statically; the harness is checked above and below)."""
    dev_modules = {p.stem for folder in ("bench", "tests") for p in (ROOT / folder).rglob("*.py")}
    dev_modules -= {"__init__", "conftest"}
    assert {"benchlib", "workload", "agent_harness", "semantics"} <= dev_modules
    offenders = {}
    for folder in PRODUCT_FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            package = ".".join(path.relative_to(ROOT / folder.split("/")[0]).parent.parts)
            tops = {name.split(".")[0] for name in imported_modules(path, package)}
            if tops & dev_modules:
                offenders[str(path.relative_to(ROOT))] = sorted(tops & dev_modules)
    assert not offenders, f"product modules importing bench/ or tests/ modules: {offenders}"


def test_the_product_imports_without_the_harness() -> None:
    """Every module of the product packages imports in a fresh interpreter where kpx_cluster
    (the harness) cannot be imported: no static or dynamic import reaches it."""
    script = """
import importlib, importlib.abc, pkgutil, sys
class NoHarness(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "kpx_cluster":
            raise ImportError(f"the product imports the harness: {name}")
sys.meta_path.insert(0, NoHarness())
count = 0
for top in PRODUCT:
    package = importlib.import_module(top)
    for info in pkgutil.walk_packages(package.__path__, top + "."):
        if not info.name.endswith(".__main__"):  # that one runs the program
            importlib.import_module(info.name)
        count += 1
print(count)
"""
    done = subprocess.run(
        [sys.executable, "-c", f"PRODUCT = {PRODUCT!r}\n{script}"],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) > 50  # it walked the packages


# What a backend may import of the agent: the node-local model's data types, the backend
# contract, the kernel's ruleset generation id (nf_generation: the kernel's, not a mode's; the
# nftables and iptables drift checks ask it), the route_localnet sysctl (the kernel's, which
# localhost NodePorts need in both modes), and its own package. Never the model's internals
# (node_local, detect_local, cluster_state, proxier, ...): everything it needs of the node is
# decided there and handed over in localnet's types (NodeLocalState, NodeFacts). What several
# modes render alike from those types (the source ranges Services share) is one pure module
# next to the contract.
BACKEND_MAY_IMPORT = (
    "kpx_agent.localnet",
    "kpx_agent.backends.base",
    "kpx_agent.backends.nf_generation",
    "kpx_agent.backends.route_localnet",
    "kpx_agent.backends.source_ranges",
)


def backend_imports_outside(path: Path, root: Path = BACKENDS) -> set[str]:
    """What the module `path` under the backends folder `root` imports of the agent beyond
    BACKEND_MAY_IMPORT and its own backend (a mode's package, or a one-file backend such as
    state_only.py)."""
    rel = path.relative_to(root)
    package = "kpx_agent.backends" + "".join(f".{p}" for p in rel.parent.parts)
    own = f"kpx_agent.backends.{rel.parts[0].removesuffix('.py')}"
    allowed = (own, *BACKEND_MAY_IMPORT)
    return {
        name
        for name in imported_modules(path, package)
        if name.startswith("kpx_agent") and not any(_is(name, a) for a in allowed)
    }


def test_backends_import_only_the_models_data_types() -> None:
    """Every module under backends/ (each mode's package, the one-file backends, the contract
    in base.py) but the registry (backends/__init__.py, which loads the modes by name)."""
    paths = [p for p in BACKENDS.rglob("*.py") if p != BACKENDS / "__init__.py"]
    offenders = {
        str(p.relative_to(ROOT)): sorted(names)
        for p in paths
        if (names := backend_imports_outside(p))
    }
    assert not offenders, f"backends importing the model's internals or each other: {offenders}"
    checked = {p.relative_to(BACKENDS).parts[0] for p in paths}
    assert {"nftables", "iptables", "ipvs", "state_only.py", "base.py"} <= checked


def test_the_backend_rule_sees_what_it_must(tmp_path: Path) -> None:
    """The rule itself: the model's internals and another backend are refused, the data types,
    the contract and the own backend pass."""
    (tmp_path / "nftables").mkdir()
    mode = tmp_path / "nftables" / "x.py"
    mode.write_text(
        "from ..iptables import names\nfrom ...node_local import local_state\n"
        "from ...localnet import IP\nfrom ..base import BackendError\nfrom .names import T\n"
        "from kpx_agent.backends.nftables import schema\nimport kpx_agent.proxier\n"
    )
    one_file = tmp_path / "one_file.py"
    one_file.write_text("from ..localnet import IP\nfrom .state_only import StateOnly\n")
    assert backend_imports_outside(mode, tmp_path) == {
        "kpx_agent.backends.iptables",
        "kpx_agent.backends.iptables.names",
        "kpx_agent.node_local",
        "kpx_agent.node_local.local_state",
        "kpx_agent.proxier",
    }
    assert backend_imports_outside(one_file, tmp_path) == {
        "kpx_agent.backends.state_only",
        "kpx_agent.backends.state_only.StateOnly",
    }


# -- only kpx_kube talks HTTP to the apiserver ----------------------------------------------------

#: Folders scanned: everything of ours that runs (product, harness, benchmarks, tests).
SCANNED = ("agents", "operator", "api", "harness", "bench", "tests")
#: HTTP client modules (`aiohttp` is its client unless `aiohttp.web`, a server).
HTTP_CLIENTS = ("aiohttp", "urllib.request", "http.client", "requests", "httpx", "urllib3",
                "kubernetes", "kubernetes_asyncio", "kr8s", "lightkube", "pykube")  # fmt: skip
#: Our own HTTP servers (health, metrics, service health checks).
HTTP_SERVERS = ("aiohttp.web",)
SERVER_PACKAGES = ("agents/kpx_agent", "operator/kpx_operator")
#: HTTP clients that are not apiserver clients, each with why.
NOT_APISERVER = {
    # etcd's JSON gateway and the components' /healthz while the control plane starts
    "harness/kpx_cluster/controlplane.py": {"urllib.request"},
    # the operator's own /healthz
    "tests/e2e/test_operator.py": {"urllib.request"},
    # the operator's own /healthz, /readyz and /metrics
    "tests/e2e/test_operator_health.py": {"urllib.request"},
    "tests/e2e/operator_process.py": {"urllib.request"},
    # a fake apiserver (an aiohttp.web server) that answers kpx_kube's client with 429
    "tests/unit/test_reflector_retries.py": {"aiohttp"},
}


def imported_names(source: str) -> set[str]:
    """What `source` imports, as full names: `from a import b` is `a.b`, `import a.b` too."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.update(f"{node.module}.{alias.name}" for alias in node.names)
    return out


def _is(name: str, module: str) -> bool:
    return name == module or name.startswith(module + ".")


def http_client_imports(source: str, rel: str) -> set[str]:
    """The HTTP client modules the file `rel` (its text `source`) may not import."""
    server_ok = rel.startswith(SERVER_PACKAGES)
    found = set()
    for name in imported_names(source):
        if server_ok and any(_is(name, s) for s in HTTP_SERVERS):
            continue
        for client in HTTP_CLIENTS:
            if _is(name, client) and client not in NOT_APISERVER.get(rel, set()):
                found.add(name)
    return found


def test_only_kpx_kube_imports_an_http_client() -> None:
    offenders = {}
    for folder in SCANNED:
        for path in (ROOT / folder).rglob("*.py"):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith("agents/kpx_kube/") or ".venv" in path.parts:
                continue
            names = http_client_imports(path.read_text(), rel)
            if names:
                offenders[rel] = sorted(names)
    assert not offenders, f"HTTP clients outside kpx_kube: {offenders}"


def test_each_http_client_exception_is_still_needed() -> None:
    """An excused file exists and still imports what it is excused for (no stale licence)."""
    for rel, modules in NOT_APISERVER.items():
        names = imported_names((ROOT / rel).read_text())
        for module in modules:
            assert any(_is(name, module) for name in names), f"{rel} no longer imports {module}"


def test_the_http_client_rule_sees_what_it_must() -> None:
    """The scan itself: a client import is found in any form, a server import passes only in
    the server packages, an exception only for its file and module."""
    agent, bench = "agents/kpx_agent/x.py", "bench/x.py"
    assert http_client_imports("from aiohttp import web\nimport urllib.request\n", agent) == {
        "urllib.request"
    }
    assert http_client_imports("from aiohttp import ClientSession\n", agent) == {
        "aiohttp.ClientSession"
    }
    assert http_client_imports("import aiohttp.web\nimport http.client\n", bench) == {
        "aiohttp.web",
        "http.client",
    }
    assert http_client_imports("from urllib import request\n", bench) == {"urllib.request"}
    controlplane = "harness/kpx_cluster/controlplane.py"
    assert http_client_imports("import urllib.request\n", controlplane) == set()
    assert http_client_imports("import aiohttp\n", controlplane) == {"aiohttp"}
