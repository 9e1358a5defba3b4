"""`helm test`: the release works. Run by the test Pod of templates/tests/ (python3, stdlib only).

Every request goes to the apiserver at the kubernetes Service's ClusterIP (the kubelet's
KUBERNETES_SERVICE_HOST/PORT), so its first answer shows that a Service answers through the
agents' rules (without kube-proxy nothing else programs that address); TLS is verified with the
cluster CA. Then the operator's Deployment is Ready (every replica ready and available), and the
ProxyConfiguration is Ready (condition Ready=True for its current generation). Each check
waits up to TIMEOUT seconds; the first failure ends the test with exit code 1 and says why.
"""

from __future__ import annotations

import json
import os
import ssl
import sys
import time
import urllib.request
from collections.abc import Callable
from typing import Any

SA = "/var/run/secrets/kubernetes.io/serviceaccount"
Check = Callable[[], "tuple[bool, str]"]


def deployment_ready(obj: dict[str, Any]) -> tuple[bool, str]:
    """Every replica of the Deployment's current generation ready and available."""
    spec, status = obj.get("spec", {}), obj.get("status", {})
    want = spec.get("replicas", 1)
    ready, available = status.get("readyReplicas", 0), status.get("availableReplicas", 0)
    updated = status.get("updatedReplicas", 0)
    current = status.get("observedGeneration", 0) >= obj["metadata"].get("generation", 0)
    said = f"{ready}/{want} ready, {available} available, {updated} updated"
    return current and ready >= want and available >= want and updated >= want, said


def proxyconfiguration_ready(obj: dict[str, Any]) -> tuple[bool, str]:
    """Condition Ready=True, observed for the object's current generation."""
    generation = obj["metadata"].get("generation", 0)
    for cond in obj.get("status", {}).get("conditions", []):
        if cond.get("type") == "Ready":
            seen = cond.get("observedGeneration", generation)
            said = f"Ready={cond.get('status')} ({cond.get('reason')}: {cond.get('message')})"
            return cond.get("status") == "True" and seen == generation, said
    return False, "no Ready condition yet"


def base_url(host: str, port: str) -> str:
    return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"


def wait(what: str, check: Check, timeout: float, interval: float = 2.0) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        try:
            ok, said = check()
        except Exception as exc:  # any failure is reported, and retried until the timeout
            ok, said = False, f"{type(exc).__name__}: {exc}"
        if ok:
            print(f"ok: {what}: {said}", flush=True)
            return True
        if time.monotonic() > deadline:
            print(f"FAILED: {what}: {said} (after {timeout:.0f} s)", flush=True)
            return False
        time.sleep(interval)


def main() -> int:
    host, port = os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"]
    base = base_url(host, port)
    context = ssl.create_default_context(cafile=f"{SA}/ca.crt")
    with open(f"{SA}/token", encoding="utf-8") as f:
        token = f.read().strip()
    timeout = float(os.environ.get("TIMEOUT", "120"))

    def get(path: str) -> dict[str, Any]:
        url = base + path  # https://<the kubernetes Service's ClusterIP>:<port>/...
        headers = {"Authorization": f"Bearer {token}"}
        request = urllib.request.Request(url, headers=headers)  # noqa: S310 - https only
        with urllib.request.urlopen(request, context=context, timeout=10) as answer:  # noqa: S310
            return dict(json.load(answer))

    def service_answers() -> tuple[bool, str]:
        version = get("/version")
        return True, f"the kubernetes Service at {host}:{port} answers ({version['gitVersion']})"

    namespace, deployment = os.environ["NAMESPACE"], os.environ["DEPLOYMENT"]
    checks: list[tuple[str, Check]] = [
        ("a Service answers through the agents", service_answers),
        (
            f"Deployment {namespace}/{deployment} is Ready",
            lambda: deployment_ready(
                get(f"/apis/apps/v1/namespaces/{namespace}/deployments/{deployment}")
            ),
        ),
    ]
    if pxc := os.environ.get("PROXYCONFIGURATION"):
        checks.append(
            (
                f"ProxyConfiguration {pxc} is Ready",
                lambda: proxyconfiguration_ready(
                    get(f"/apis/proxy.kpx.dev/v1alpha1/proxyconfigurations/{pxc}")
                ),
            )
        )
    else:
        print("skipped: the release creates no ProxyConfiguration", flush=True)
    return 0 if all(wait(what, check, timeout) for what, check in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
