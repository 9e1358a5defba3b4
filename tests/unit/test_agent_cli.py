"""proxy-agent refuses bad configuration with the field named, and exits non-zero."""

from __future__ import annotations

from pathlib import Path

import pytest

from kpx_agent.cli import main


def test_bad_config_file_is_refused_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "config.yaml"
    bad.write_text(
        "apiVersion: proxy.kpx.dev/v1alpha1\nkind: AgentConfiguration\nmode: nftables\n"
        "nftables:\n  masqueradeBit: 40\n  syncPeriod: soon\n"
    )
    assert main(["--config", str(bad), "--node-name", "n1"]) == 2
    err = capsys.readouterr().err
    assert "nftables.masqueradeBit" in err and "31" in err
    assert "nftables.syncPeriod" in err


def test_mode_flag_must_agree_with_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text("apiVersion: proxy.kpx.dev/v1alpha1\nkind: AgentConfiguration\nmode: nftables\n")
    assert main(["--mode", "iptables", "--config", str(cfg), "--node-name", "n1"]) == 2
    assert "--mode iptables" in capsys.readouterr().err


def test_flag_values_are_validated_by_the_same_models(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--mode", "nftables", "--cluster-cidr", "10.0.0.1/8", "--node-name", "n1"]) == 2
    assert "clusterCIDRs" in capsys.readouterr().err


def test_neither_mode_nor_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--node-name", "n1"]) == 2
    assert "--mode" in capsys.readouterr().err


def test_mode_without_a_backend_exits_saying_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every mode has a backend now: take ipvs out of the gate to see the refusal path.
    import kpx_api.modes

    monkeypatch.setattr(
        kpx_api.modes,
        "MODES_WITH_BACKEND",
        frozenset({kpx_api.modes.Mode.NFTABLES, kpx_api.modes.Mode.IPTABLES}),
    )
    cfg = tmp_path / "config.yaml"
    cfg.write_text(
        "apiVersion: proxy.kpx.dev/v1alpha1\nkind: AgentConfiguration\nmode: ipvs\n"
        "ipvs:\n  acknowledgeDeprecation: true\n"
    )
    for argv in (
        ["--mode", "ipvs", "--config", str(cfg), "--node-name", "n1"],
        ["--mode", "ipvs", "--node-name", "n1"],
        ["cleanup", "--mode", "ipvs"],
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "mode ipvs has no backend in the kpx agent yet" in err, err
        assert "nftables" in err
        assert "keeps working" not in err


def test_mode_ipvs_passes_the_gate_and_logs_its_deprecation(
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import kpx_agent.cli

    monkeypatch.setattr(kpx_agent.cli, "remove_other_modes", lambda mode: None)
    # No credentials: the agent stops after the gate, the backend lookup and the warning.
    assert main(["--mode", "ipvs", "--node-name", "n1"]) == 2
    err = capsys.readouterr().err
    assert "has no backend" not in err
    assert "credentials" in err
    assert any("deprecated" in r.message and "nftables" in r.message for r in caplog.records)
