"""What a black-box client of the state API meets at its edges: the socket's directory (created
private, an existing one never changed, a shared one refused), mode external from the command line
alone, and a malformed request answered INVALID_ARGUMENT in one log line (real gRPC calls on a
real unix socket)."""

from __future__ import annotations

import asyncio
import logging
import os
import stat
from pathlib import Path

import grpc
import pytest

from kpx_agent.state_api.address import Listen
from kpx_agent.state_api.publisher import Publisher
from kpx_agent.state_api.server import StateServer
from kpx_agent.state_api.socket_directory import (
    SocketDirectoryError,
    directory_problem,
    prepare_socket_directory,
)
from kpx_localstate_client import WATCH_METHOD
from kpx_localstate_client import localstate_pb2 as pb

# --- the socket's directory ----------------------------------------------------------------------


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_missing_directory_is_created_private_with_its_parents(tmp_path: Path) -> None:
    directory = tmp_path / "a" / "b"
    prepare_socket_directory(directory)
    assert _mode(directory) == 0o750
    prepare_socket_directory(directory)  # now existing, the agent's own: accepted as it is
    assert _mode(directory) == 0o750


@pytest.mark.parametrize("mode", [0o755, 0o700, 0o777, 0o1755])
def test_an_existing_directory_is_used_as_it_is(tmp_path: Path, mode: int) -> None:
    """0777 without the sticky bit is what Kubernetes makes of an emptyDir (private to the
    pod): accepted, and left 0777."""
    directory = tmp_path / "d"
    directory.mkdir()
    os.chmod(directory, mode)

    async def main() -> None:
        server = StateServer(Publisher(), Listen(path=directory / "state.sock"))
        await server.start()
        assert stat.S_ISSOCK((directory / "state.sock").stat().st_mode)
        assert _mode(directory) == mode
        await server.stop()

    asyncio.run(main())
    assert _mode(directory) == mode
    assert list(directory.iterdir()) == []


def test_a_shared_temporary_directory_is_refused_and_left_alone(tmp_path: Path) -> None:
    shared = tmp_path / "tmp"
    shared.mkdir()
    os.chmod(shared, 0o1777)

    async def main() -> None:
        server = StateServer(Publisher(), Listen(path=shared / "kpx.sock"))
        with pytest.raises(SocketDirectoryError, match=r"is a shared directory \(mode 1777"):
            await server.start()

    asyncio.run(main())
    assert _mode(shared) == 0o1777
    assert list(shared.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another user")
def test_a_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chmod(theirs, 0o755)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(SocketDirectoryError, match=r"owned by uid 65534, neither the agent's"):
        prepare_socket_directory(theirs)
    assert _mode(theirs) == 0o755


def test_directory_problem_of_a_file_and_of_root_owned_directories(tmp_path: Path) -> None:
    file = tmp_path / "f"
    file.write_text("")
    assert directory_problem(file, file.stat(), os.geteuid()) == f"{file} is not a directory"
    tmp = os.stat("/")
    assert directory_problem(Path("/"), tmp, 12345) is None  # root's own, not world-writable


# --- mode external from the command line alone ---------------------------------------------------


def test_mode_external_runs_from_the_command_line_alone() -> None:
    """`--mode external --state-socket PATH` with no configuration file: the agent serves the
    state API with external's default sync periods; no backend image is asked for."""
    from kpx_agent import settings as settings_mod
    from kpx_agent.cli import _overrides, _run_parser

    args = _run_parser().parse_args(["--mode", "external", "--state-socket", "/run/x/s.sock"])
    config = settings_mod.load("external", None, _overrides(args))
    settings = settings_mod.resolve(config)
    assert (settings.mode, settings.state_api) == ("external", "unix:///run/x/s.sock")
    assert (settings.sync_period, settings.min_sync_period) == (30.0, 1.0)
    assert config.external is None


def test_the_operator_still_needs_the_backend_image() -> None:
    from kpx_api import parse_spec
    from kpx_api.errors import ConfigError

    with pytest.raises(ConfigError, match=r"mode external needs spec\.external"):
        parse_spec({"mode": "external"})


def test_the_agent_exits_2_naming_the_flag_on_a_shared_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kpx_agent.cli import main

    shared = tmp_path / "tmp"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    code = main(
        [
            "--mode",
            "external",
            "--state-socket",
            f"{shared}/kpx.sock",
            "--kubeconfig",
            str(tmp_path / "none"),
        ]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"proxy-agent: --state-socket {shared}/kpx.sock: {shared} is a shared")
    assert _mode(shared) == 0o1777


# --- a malformed request -------------------------------------------------------------------------


def test_a_malformed_request_gets_invalid_argument_and_one_log_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> tuple[grpc.StatusCode, str, grpc.StatusCode]:
        server = StateServer(Publisher(), Listen(path=tmp_path / "s" / "state.sock"))
        await server.start()
        try:
            async with grpc.aio.insecure_channel(server.listen.target) as channel:
                method = channel.stream_stream(WATCH_METHOD)  # raw bytes both ways
                call = method(iter([b"\xff\xff\xff"]))
                with pytest.raises(grpc.aio.AioRpcError) as bad:
                    await call.read()
                # The server goes on serving well-formed requests.
                good = method(iter([pb.WatchRequest().SerializeToString()]), timeout=0.5)
                with pytest.raises(grpc.aio.AioRpcError) as waiting:
                    await good.read()  # no state published yet: no answer before the deadline
            return bad.value.code(), bad.value.details() or "", waiting.value.code()
        finally:
            await server.stop()

    with caplog.at_level(logging.DEBUG):
        code, details, later = asyncio.run(main())
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("malformed WatchRequest: ")
    assert later == grpc.StatusCode.DEADLINE_EXCEEDED
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [r.getMessage().split(":")[0] for r in warnings] == ["state API"]
    assert "\n" not in warnings[0].getMessage() and warnings[0].exc_info is None


# --- the size of a full state --------------------------------------------------------------------

#: gRPC's default limit on a received message (every language's default: 4 MiB).
GRPC_DEFAULT_MAX_RECEIVE = 4 * 1024 * 1024


def test_a_full_state_at_10000_services_is_over_grpc_default_receive_limit() -> None:
    """bench/workload.py's 10,000 Services (one TCP port, 10 endpoints each) as one node's
    state, encoded as the server sends it: about 5.4 MB (docs/state-api.md), over the 4 MiB a
    client in another language accepts unless it raises its limit."""
    import sys

    bench = Path(__file__).resolve().parents[2] / "bench"
    if str(bench) not in sys.path:
        sys.path.insert(0, str(bench))
    from kpx_agent.model.types import DataplaneSettings
    from workload import node_local_state

    pub = Publisher()
    pub.publish(node_local_state(10_000), DataplaneSettings(), None)
    size = len(pub.answer("", 0, False))
    assert size > GRPC_DEFAULT_MAX_RECEIVE
    assert 5_200_000 < size < 5_600_000, size  # the figure in docs/state-api.md
    per_port = size / 10_000
    assert GRPC_DEFAULT_MAX_RECEIVE / per_port > 7_500  # over the limit from ~7,800 ports on
