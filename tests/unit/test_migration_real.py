"""kpx_cluster.migration_real's pure part: the simulator's backend Deployment rewritten for
real kubelets (the harness's modules run as files from a ConfigMap in the agent image)."""

from __future__ import annotations

import copy

import pytest

from kpx_cluster.migration import app_objects
from kpx_cluster.migration_real import SCRIPT_DIR, SCRIPTS, on_real_nodes, scripts_config_map

IMAGE = "ghcr.io/kpx/kpx-agent:0.1.0"


def test_backends_run_the_harness_files_from_the_config_map_in_the_agent_image() -> None:
    deploy, *services = app_objects("ns", {"k": "v"}, 3)
    real = on_real_nodes(copy.deepcopy(deploy), IMAGE)
    spec = real["spec"]["template"]["spec"]
    commands = {c["name"]: c["command"] for c in spec["containers"]}
    assert commands["echo"][:2] == ["python3", f"{SCRIPT_DIR}/echo_server.py"]
    assert commands["hold"][:3] == ["python3", f"{SCRIPT_DIR}/migration_load.py", "hold-server"]
    # the arguments after the module stay as the simulator's
    sim = {c["name"]: c["command"] for c in deploy["spec"]["template"]["spec"]["containers"]}
    assert commands["echo"][2:] == sim["echo"][3:]
    for container in spec["containers"]:
        assert container["image"] == IMAGE and container["imagePullPolicy"] == "Never"
        assert container["volumeMounts"] == [{"name": "scripts", "mountPath": SCRIPT_DIR}]
        # not BestEffort: the agents' CPU-bound start must not starve the backends
        assert container["resources"]["requests"]["cpu"] == "100m", container
    assert spec["volumes"] == [{"name": "scripts", "configMap": {"name": "load-scripts"}}]
    assert [on_real_nodes(s, IMAGE) for s in services] == services


def test_a_container_that_runs_no_harness_module_is_refused() -> None:
    deploy = app_objects("ns", {"k": "v"}, 1)[0]
    deploy["spec"]["template"]["spec"]["containers"][0]["command"] = ["sleep", "1"]
    with pytest.raises(ValueError, match="not a harness module"):
        on_real_nodes(deploy, IMAGE)


def test_the_config_map_holds_every_file_the_backends_run() -> None:
    data = scripts_config_map("ns")["data"]
    assert set(data) == set(SCRIPTS)
    assert all('if __name__ == "__main__":' in text for text in data.values())
