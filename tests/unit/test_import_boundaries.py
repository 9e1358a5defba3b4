"""The layers, as the imports show them (issue #14's "Done when"):

- backends do not import the model's internals or each other: every module under
  kpx_agent/backends/ imports of the agent only the node-local model's data types
  (`model.types`), the backend contract (`backends.base`) and its own backend;
- the agent's folders are layers (issue #25): the model imports no other layer, the store only
  the model, and so on up to the sync loop (AGENT_LAYERS); the agent's top level holds only the
  assembly (agent.py, cli.py, settings.py);
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
        ("kube/kpx_kube", ("kpx_agent", "kpx_operator", "kpx_cluster", "kopf", "kubernetes")),
        ("operator/kpx_operator", ("kpx_agent", "kpx_cluster")),
        (
            "agents/kpx_localstate_client",
            ("kpx_agent", "kpx_kube", "kpx_operator", "kpx_cluster", "kopf"),
        ),
        (
            "api/kpx_api",
            ("kpx_agent", "kpx_operator", "kpx_cluster", "aiohttp", "subprocess", "kopf", "socket"),
        ),
    ],
)
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
PRODUCT_FOLDERS = (
    "api/kpx_api",
    "kube/kpx_kube",
    "agents/kpx_agent",
    "agents/kpx_localstate_client",
    "operator/kpx_operator",
)


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
# localhost NodePorts need in both modes), the mode-neutral kernel toolkit (backends.kernel:
# kernel object names, netlink framing, the nftables vocabulary), and its own package. Never
# the model's internals (model.service_ports, model.detect_local, store, sync, ...): everything
# it needs of the node is decided there and handed over in model.types (NodeLocalState,
# NodeFacts). What several
# modes render alike from those types (the source ranges Services share) is one pure module
# next to the contract.
BACKEND_MAY_IMPORT = (
    "kpx_agent.model.types",
    "kpx_agent.backends.base",
    "kpx_agent.backends.kernel",
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
        "from ..iptables import names\nfrom ...model.service_ports import local_state\n"
        "from ...model.types import IP\nfrom ..base import BackendError\nfrom .names import T\n"
        "from kpx_agent.backends.nftables import schema\nimport kpx_agent.sync.proxier\n"
    )
    one_file = tmp_path / "one_file.py"
    one_file.write_text("from ..model.types import IP\nfrom .state_only import StateOnly\n")
    assert backend_imports_outside(mode, tmp_path) == {
        "kpx_agent.backends.iptables",
        "kpx_agent.backends.iptables.names",
        "kpx_agent.model.service_ports",
        "kpx_agent.model.service_ports.local_state",
        "kpx_agent.sync.proxier",
    }
    assert backend_imports_outside(one_file, tmp_path) == {
        "kpx_agent.backends.state_only",
        "kpx_agent.backends.state_only.StateOnly",
    }


# -- the agent's folders are layers -------------------------------------------------------------

AGENT = ROOT / "agents" / "kpx_agent"
#: What each folder of the agent may not import of the agent (its __init__.py says why). The
#: model is pure and at the bottom; the sync loop at the top imports every layer but handover;
#: nothing below the assembly (agent.py, cli.py) imports it.
ASSEMBLY = ("agent", "cli")
AGENT_LAYERS: dict[str, tuple[str, ...]] = {
    "model": (
        "store",
        "sync",
        "handover",
        "observability",
        "conntrack",
        "backends",
        "state_api",
        "settings",
        *ASSEMBLY,
    ),
    "store": ("sync", "handover", "observability", "conntrack", "backends", "state_api", *ASSEMBLY),
    "observability": ("sync", "handover", "conntrack", "backends", *ASSEMBLY),
    "conntrack": ("store", "sync", "handover", "observability", *ASSEMBLY),
    "backends": ("store", "sync", "handover", "observability", "conntrack", *ASSEMBLY),
    "handover": ("store", "sync", "observability", *ASSEMBLY),
    "sync": ("handover", *ASSEMBLY),
    "state_api": ("store", "sync", "handover", "conntrack", *ASSEMBLY),
}
#: The agent's top level: the assembly and the settings, every other module is in a layer.
AGENT_TOP = {"__init__.py", "__main__.py", "agent.py", "cli.py", "settings.py"}


def layer_violations(root: Path, layer: str) -> dict[str, list[str]]:
    """The imports of the agent's folder `root`/`layer` into layers it may not import."""
    forbidden = tuple(f"kpx_agent.{name}" for name in AGENT_LAYERS[layer])
    found: dict[str, list[str]] = {}
    for path in (root / layer).rglob("*.py"):
        rel = path.relative_to(root)
        package = ".".join(("kpx_agent", *rel.parent.parts))
        bad = sorted(
            n for n in imported_modules(path, package) if any(_is(n, f) for f in forbidden)
        )
        if bad:
            found[str(rel)] = bad
    return found


@pytest.mark.parametrize("layer", sorted(AGENT_LAYERS))
def test_agent_layers_import_only_what_they_may(layer: str) -> None:
    assert (AGENT / layer / "__init__.py").is_file(), f"kpx_agent/{layer} is a package"
    assert not layer_violations(AGENT, layer)


def test_the_agent_top_level_is_only_the_assembly() -> None:
    """A new module goes into the layer it belongs to, not beside agent.py."""
    top = {p.name for p in AGENT.glob("*.py")}
    folders = {p.name for p in AGENT.iterdir() if (p / "__init__.py").is_file()}
    assert top == AGENT_TOP
    assert folders == set(AGENT_LAYERS)


def test_the_layer_rule_sees_what_it_must(tmp_path: Path) -> None:
    """Relative and absolute imports into a forbidden layer are found, allowed ones are not."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "x.py").write_text(
        "from .types import IP\nfrom ..sync.proxier import Proxier\nimport kpx_agent.store\n"
        "from kpx_agent import agent\n"
    )
    (tmp_path / "sync").mkdir()
    (tmp_path / "sync" / "y.py").write_text(
        "from ..model.types import IP\nfrom ..store import compact\n"
        "from ..handover.rollback import rollback_due\n"
    )
    assert layer_violations(tmp_path, "model") == {
        "model/x.py": [
            "kpx_agent.agent",
            "kpx_agent.store",
            "kpx_agent.sync.proxier",
            "kpx_agent.sync.proxier.Proxier",
        ],
    }
    assert layer_violations(tmp_path, "sync") == {
        "sync/y.py": ["kpx_agent.handover.rollback", "kpx_agent.handover.rollback.rollback_due"],
    }


# -- only kpx_kube talks HTTP to the apiserver ----------------------------------------------------

#: Folders scanned: everything of ours that runs (product, harness, benchmarks, tests).
SCANNED = ("agents", "kube", "operator", "api", "harness", "bench", "tests")
#: HTTP client modules (`aiohttp` is its client unless `aiohttp.web`, a server).
HTTP_CLIENTS = (
    "aiohttp",
    "urllib.request",
    "http.client",
    "requests",
    "httpx",
    "urllib3",
    "kubernetes",
    "kubernetes_asyncio",
    "kr8s",
    "lightkube",
    "pykube",
)
#: Our own HTTP servers (health, metrics, service health checks).
HTTP_SERVERS = ("aiohttp.web",)
SERVER_PACKAGES = ("agents/kpx_agent", "operator/kpx_operator")
#: HTTP clients that are not apiserver clients, each with why.
NOT_APISERVER = {
    # etcd's JSON gateway and the components' /healthz while the control plane starts
    "harness/kpx_cluster/controlplane.py": {"urllib.request"},
    # the operator's own /healthz
    "tests/e2e/test_operator.py": {"urllib.request"},
    # a server answering what no apiserver sends (a JSON array as a list, a non-JSON watch
    # line), for the client's decoding of them
    "tests/unit/test_fuzz_watch_events.py": {"aiohttp"},
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
            if rel.startswith("kube/kpx_kube/") or ".venv" in path.parts:
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


# -- the mode seam: one typed contract, nothing reaches into a mode -------------------------------

REGISTRY_FILE = BACKENDS / "__init__.py"
#: Each mode's module (a package, or a one-file mode such as state_only.py).
MODE_MODULES = tuple(sorted(REGISTRY.values()))


def _module_of(path: Path, folder: str) -> str:
    """The dotted name of the product module at `path`, under the product folder `folder`."""
    rel = path.relative_to(ROOT / folder.split("/")[0]).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imports_into_modes(path: Path, module: str, package: str) -> set[str]:
    """What the module `module` (file `path`, in `package`) imports of a mode it is not part
    of; the registry may import any."""
    if path == REGISTRY_FILE:
        return set()
    return {
        name
        for name in imported_modules(path, package)
        for mode in MODE_MODULES
        if _is(name, mode) and not _is(module, mode)
    }


def test_only_the_registry_imports_into_a_mode() -> None:
    """A mode's package is reached only through the registry (backends.load, typed as
    base.Mode): no product module outside it imports its modules, so an agent in one mode
    loads another mode's code only when it removes that mode's leftovers."""
    offenders = {}
    for folder in PRODUCT_FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            package = ".".join(path.relative_to(ROOT / folder.split("/")[0]).parent.parts)
            if names := imports_into_modes(path, _module_of(path, folder), package):
                offenders[str(path.relative_to(ROOT))] = sorted(names)
    assert not offenders, f"imports into a mode's package from outside it: {offenders}"
    assert {"kpx_agent.backends.ipvs", "kpx_agent.backends.state_only"} <= set(MODE_MODULES)


def test_the_into_a_mode_rule_sees_what_it_must(tmp_path: Path) -> None:
    """The rule itself: the core importing a mode's module (any form) is refused; a mode
    importing its own modules, the contract, or the registry importing a mode passes."""
    core = tmp_path / "cli.py"
    core.write_text(
        "from .backends.ipvs.leftovers import plan\nimport kpx_agent.backends.state_only\n"
        "from .backends import nftables\nfrom .backends.base import Mode\n"
        "from .backends import load\n"
    )
    assert imports_into_modes(core, "kpx_agent.cli", "kpx_agent") == {
        "kpx_agent.backends.ipvs.leftovers",
        "kpx_agent.backends.ipvs.leftovers.plan",
        "kpx_agent.backends.state_only",
        "kpx_agent.backends.nftables",
    }
    own = tmp_path / "leftovers.py"
    own.write_text("from .model import VirtualKey\nfrom ..base import Draining\n")
    assert (
        imports_into_modes(own, "kpx_agent.backends.ipvs.leftovers", "kpx_agent.backends.ipvs")
        == set()
    )
    assert imports_into_modes(REGISTRY_FILE, "kpx_agent.backends", "kpx_agent.backends") == set()


def _loose(annotation: ast.expr | None) -> bool:
    """Whether a type annotation says nothing: Any or object anywhere in it."""
    if annotation is None:
        return False
    for node in ast.walk(annotation):
        if isinstance(node, ast.Name) and node.id in ("Any", "object"):
            return True
        if isinstance(node, ast.Attribute) and node.attr == "Any":
            return True
    return False


def _is_load(node: ast.AST) -> bool:
    """A call of the registry's `load` (`load(...)`, `backends.load(...)`)."""
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    if isinstance(func, ast.Name):
        return func.id == "load"
    return (
        isinstance(func, ast.Attribute)
        and func.attr == "load"
        and isinstance(func.value, ast.Name)
        and func.value.id == "backends"
    )


def _loose_signatures(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """Any or object in a parameter `load` or named for a backend; in a function named for a
    backend (and the functions inside it), anywhere in the signature."""
    named = "backend" in node.name.lower()
    functions = [
        fn for fn in ast.walk(node) if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
    ]
    found = []
    for fn in functions if named else [node]:
        for arg in [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]:
            seam = named or arg.arg == "load" or "backend" in arg.arg.lower()
            if seam and arg.annotation is not None and _loose(arg.annotation):
                found.append(
                    f"line {arg.lineno}: {fn.name}({arg.arg}: {ast.unparse(arg.annotation)})"
                )
        if named and fn.returns is not None and _loose(fn.returns):
            found.append(f"line {fn.lineno}: {fn.name} -> {ast.unparse(fn.returns)}")
    return found


def seam_violations(source: str) -> list[str]:
    """Where a core module (of the agent, outside the mode packages) leaves the typed mode
    seam: a capability probe (getattr, hasattr, isinstance) on a backend or a loaded mode,
    or Any/object where a loaded mode or a backend is typed (a variable bound to `load(...)`
    or named for a backend, a parameter `load` or named for a backend, anything in a
    function named for a backend)."""
    tree = ast.parse(source)
    loaded = {
        target.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign | ast.AnnAssign)
        and node.value is not None
        and _is_load(node.value)
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(target, ast.Name)
    }

    def seam(expr: ast.expr) -> bool:
        named = isinstance(expr, ast.Name) and expr.id in loaded
        return "backend" in ast.unparse(expr).lower() or _is_load(expr) or named

    def probe(node: ast.AST) -> bool:
        return (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "isinstance")
            and bool(node.args)
            and seam(node.args[0])
        )

    def loose_binding(node: ast.AST) -> bool:
        if not isinstance(node, ast.AnnAssign) or not _loose(node.annotation):
            return False
        return seam(node.target) or (node.value is not None and _is_load(node.value))

    found: list[str] = []
    for node in ast.walk(tree):
        if probe(node) or loose_binding(node):
            found.append(f"line {getattr(node, 'lineno', '?')}: {ast.unparse(node)}")
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            found += _loose_signatures(node)
    return sorted(set(found))


def _core_modules() -> list[Path]:
    """The agent's modules outside the mode packages (the registry and the contract too)."""
    return [
        p
        for p in AGENT.rglob("*.py")
        if not any(_is(_module_of(p, "agents/kpx_agent"), m) for m in MODE_MODULES)
    ]


def test_the_mode_seam_is_typed() -> None:
    """The registry's `load` returns base.Mode (not object or Any), and no core module probes
    a backend or a mode for a capability or types one loosely: every capability the core uses
    is a method of base.Backend (with a default), every mode is a base.Mode."""
    registry = ast.parse(REGISTRY_FILE.read_text())
    [load] = [n for n in registry.body if isinstance(n, ast.FunctionDef) and n.name == "load"]
    assert load.returns is not None and ast.unparse(load.returns) == "Mode"
    paths = _core_modules()
    assert {"agent.py", "proxier.py", "cli.py", "make_before_break.py"} <= {p.name for p in paths}
    assert not any("ipvs" in p.parts for p in paths)
    offenders = {
        str(p.relative_to(ROOT)): found for p in paths if (found := seam_violations(p.read_text()))
    }
    assert not offenders, f"Any, object or a capability probe on the mode seam: {offenders}"


def test_the_seam_rule_sees_what_it_must() -> None:
    """The rule itself, on what the core did before the seam was typed (each is found), and
    on the typed forms (none is)."""
    before = (
        "def cleanup(args):\n"
        "    module: Any = backends.load(args.mode)\n"  # 2
        "    module.cleanup()\n"
        "def remover(other, load: Callable[[str], object]):\n"  # 4
        "    module: object = load(other)\n"  # 5
        "    cleanup = getattr(module, 'cleanup')\n"  # 6
        "def backend_for(paths) -> Callable[[AgentSettings], Any]:\n"  # 7
        "    def create(settings: AgentSettings) -> Any:\n"  # 8
        "        return backends.load(settings.mode).create(settings.proxy, paths)\n"
        "    return create\n"
        "class Proxier:\n"
        "    def check(self):\n"
        "        programmed = getattr(self.backend, 'programmed', None)\n"  # 13
        "        if isinstance(self.backend, DriftCheck):\n"  # 14
        "            pass\n"
        "        if hasattr(load('ipvs'), 'remove'):\n"  # 16
        "            pass\n"
        "def run(backend: typing.Any) -> None:\n"  # 18
        "    pass\n"
    )
    lines = [v.split(":")[0] for v in seam_violations(before)]
    assert lines == sorted(f"line {n}" for n in (2, 4, 5, 6, 7, 8, 13, 14, 16, 18)), lines
    after = (
        "def cleanup(args):\n"
        "    backends.load(args.mode).cleanup()\n"
        "def remover(other, load: Callable[[str], Mode]):\n"
        "    load(other).remove_leftovers(handover)\n"
        "def backend_for(paths) -> Callable[[AgentSettings], Backend]:\n"
        "    def create(settings: AgentSettings) -> Backend:\n"
        "        return backends.load(settings.mode).create(settings.proxy, paths)\n"
        "    return create\n"
        "def check(self, overrides: dict[str, Any]):\n"
        "    if not self.backend.programmed() or isinstance(exc, BackendError):\n"
        "        value = getattr(block, 'masquerade_bit', 14)\n"
    )
    assert seam_violations(after) == []


@pytest.mark.parametrize("mode", ["nftables", "iptables", "ipvs"])
def test_an_agent_built_as_the_cli_builds_it_loads_no_other_modes_code(mode: str) -> None:
    """cli.build_agent for `mode`, in a fresh interpreter: of the mode packages, only that
    mode's modules are imported (an nftables agent loads no ipvs code), although the agent's
    leftover removal lists every other mode (their code is loaded only to remove them)."""
    script = f"""
import ssl, sys
from kpx_agent import cli, settings as settings_mod
from kpx_agent.backends import load
from kpx_kube import Client, Credentials
args = cli._run_parser().parse_args(["--mode", {mode!r}, "--node-name", "n1"])
settings = settings_mod.resolve(settings_mod.load({mode!r}, None, cli._overrides(args)))
client = Client(Credentials("https://127.0.0.1:1", ssl.create_default_context()))
agent = cli.build_agent(settings, load(settings.mode), args, client)
assert agent.backend.mode == {mode!r}, agent.backend.mode
print(",".join(sorted(agent.leftover_removal.pending)))
print(",".join(sorted(m for m in sys.modules if m.startswith("kpx_agent.backends."))))
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=False, timeout=120
    )
    assert done.returncode == 0, done.stderr
    pending, modules = (line.split(",") for line in done.stdout.splitlines())
    assert set(pending) == set(REGISTRY) - {mode}
    own = f"kpx_agent.backends.{mode}"
    assert own in modules and f"{own}.backend" in modules  # the check sees a loaded mode
    others = [m for m in modules for o in MODE_MODULES if _is(m, o) and o != own]
    assert not others, f"an agent of mode {mode} imported {others}"
