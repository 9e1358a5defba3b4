"""What GitOps tools read from an object's status, computed by their own logic on real objects:

- kstatus (sigs.k8s.io/cli-utils' status.Compute: Flux, kpt, `helm --wait` with kstatus) and
  Flux's `healthCheckExprs` (CEL, with cel-go as Flux sets it up), through the checker
  toolchain/kstatus builds (`make setup-kstatus`);
- Argo CD's health: examples/gitops/argocd/health.lua run by Debian's lua5.4 with `obj` set as
  Argo CD sets it (a global holding the object).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
GITOPS = REPO / "examples" / "gitops"
HEALTH_LUA = GITOPS / "argocd" / "health.lua"
FLUX_KUSTOMIZATION = GITOPS / "flux" / "kustomization.yaml"


def kstatus_binary() -> Path:
    """The checker toolchain/build-kstatus.sh builds, keyed by the pinned cli-utils version."""
    go_mod = (REPO / "toolchain" / "kstatus" / "go.mod").read_text()
    pinned = re.search(r"^\s*(?:require\s+)?sigs\.k8s\.io/cli-utils (v\S+)$", go_mod, re.M)
    assert pinned is not None, "toolchain/kstatus/go.mod does not require sigs.k8s.io/cli-utils"
    cache = Path(os.environ.get("PROXY_CACHE_DIR", Path.home() / ".cache" / "kpx"))
    path = cache / "bin" / f"kstatus-{pinned.group(1)}" / "kstatus"
    if not os.access(path, os.X_OK):
        pytest.fail(
            f"the kstatus checker is not built ({path} missing): run `make setup` "
            "(or toolchain/build-kstatus.sh)",
            pytrace=False,
        )
    return path


def lua_binary() -> str:
    found = shutil.which("lua5.4")
    if found is None:
        pytest.fail("lua5.4 is missing: run `make setup` (Debian package lua5.4)", pytrace=False)
    return found


def flux_exprs() -> dict[str, str]:
    """The healthCheckExprs entry for ProxyConfiguration in examples/gitops/flux."""
    ks = yaml.safe_load(FLUX_KUSTOMIZATION.read_text())
    (entry,) = [e for e in ks["spec"]["healthCheckExprs"] if e["kind"] == "ProxyConfiguration"]
    return {k: entry[k] for k in ("current", "inProgress", "failed")}


@dataclass(frozen=True)
class Health:
    kstatus: str  # Current, InProgress, Failed, ...
    kstatus_message: str
    cel: str  # what Flux's healthCheckExprs give; "Error" when they cannot be evaluated
    argocd: str  # Healthy, Progressing, Degraded, ...
    argocd_message: str


def kstatus(obj: Mapping[str, Any]) -> tuple[str, str, str]:
    """(kstatus, its message, the CEL expressions' verdict)."""
    exprs = flux_exprs()
    argv = [
        str(kstatus_binary()),
        "-current",
        exprs["current"],
        "-in-progress",
        exprs["inProgress"],
        "-failed",
        exprs["failed"],
    ]
    run = subprocess.run(argv, input=json.dumps(obj), capture_output=True, text=True, timeout=30)
    if run.returncode == 0:
        out = json.loads(run.stdout)
        return out["status"], out["message"], out["cel"]
    # The CEL expressions could not be evaluated (e.g. no status field): kstatus alone.
    assert "cannot evaluate" in run.stderr, run.stderr
    alone = subprocess.run(
        [str(kstatus_binary())],
        input=json.dumps(obj),
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    out = json.loads(alone.stdout)
    return out["status"], out["message"], "Error"


def lua_literal(value: Any) -> str:
    """A JSON value as a Lua expression (null: nil, as Argo CD's JSON-to-Lua conversion)."""
    if value is None:
        return "nil"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        escaped = "".join(
            chr(b) if 32 <= b < 127 and chr(b) not in '"\\' else f"\\{b:03d}"
            for b in value.encode()
        )
        return f'"{escaped}"'
    if isinstance(value, list):
        return "{" + ", ".join(lua_literal(v) for v in value) + "}"
    if isinstance(value, dict):
        items = (f"[{lua_literal(str(k))}] = {lua_literal(v)}" for k, v in value.items())
        return "{" + ", ".join(items) + "}"
    raise TypeError(f"not a JSON value: {value!r}")


def argocd(obj: Mapping[str, Any], script: Path = HEALTH_LUA) -> tuple[str, str]:
    """(health status, message) of Argo CD's health check `script` on `obj`."""
    program = (
        f"obj = {lua_literal(dict(obj))}\n"
        f"local hs = dofile({lua_literal(str(script))})\n"
        'io.write(hs.status, "\\n", hs.message or "")\n'
    )
    run = subprocess.run(
        [lua_binary(), "-"], input=program, capture_output=True, text=True, timeout=30, check=True
    )
    status, _, message = run.stdout.partition("\n")
    return status, message


def health(obj: Mapping[str, Any]) -> Health:
    ks, ks_message, cel = kstatus(obj)
    hs, hs_message = argocd(obj)
    return Health(ks, ks_message, cel, hs, hs_message)
