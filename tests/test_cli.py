"""The CLI's error contract: one line on stderr and exit 2 for KvasirError and OSError (bare or out of a trio
nursery), 130 for Ctrl-C, a traceback only for bugs; checked on real processes for a busy port."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import trio

from kvasir.core.errors import InputError, RingError
from kvasir.util.cli import error_line, reportable, run_main, run_trio, serve_announced

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------------------------------- in process


async def _fail_in_nursery(*errors: BaseException) -> None:
    async def boom(exc: BaseException) -> None:
        raise exc

    async with trio.open_nursery() as nursery:
        for exc in errors:
            nursery.start_soon(boom, exc)


def test_run_trio_unwraps_a_lone_failure() -> None:
    with pytest.raises(InputError, match="bad flag"):
        run_trio(_fail_in_nursery, InputError("bad flag"))
    with pytest.raises(ZeroDivisionError):  # a bug comes out bare too, with its own traceback
        run_trio(_fail_in_nursery, ZeroDivisionError("oops"))


def test_run_trio_reports_the_first_kvasir_or_os_error_of_several() -> None:
    with pytest.raises(PermissionError):
        run_trio(_fail_in_nursery, ValueError("noise"), PermissionError(13, "Permission denied"))
    with pytest.raises((PermissionError, RingError)):  # trio does not order the leaves
        run_trio(_fail_in_nursery, ValueError("noise"), PermissionError(13, "Permission denied"), RingError("x"))
    with pytest.raises(BaseExceptionGroup):  # several bugs: nothing to pick, the group stays whole
        run_trio(_fail_in_nursery, ValueError("a"), TypeError("b"))


def test_reportable_prefers_ctrl_c() -> None:
    group = BaseExceptionGroup("g", [RingError("x"), ExceptionGroup("inner", [ValueError()]), KeyboardInterrupt()])
    assert isinstance(reportable(group), KeyboardInterrupt)


def test_run_trio_returns_the_value() -> None:
    async def seven() -> int:
        return 7

    assert run_trio(seven) == 7


def test_serve_announced_reports_the_started_value() -> None:
    seen: list[int] = []

    async def service(task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started(8123)

    run_trio(serve_announced, service, seen.append)
    assert seen == [8123]


def test_run_main_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    def raising(exc: BaseException) -> int:
        raise exc

    assert run_main("kvasir x", lambda: 0) == 0
    assert run_main("kvasir x", lambda: raising(InputError("--layers 'a': expected A:B"))) == 2
    assert run_main("kvasir x", lambda: raising(FileNotFoundError(2, "No such file or directory", "m.gguf"))) == 2
    assert run_main("kvasir x", lambda: raising(ExceptionGroup("g", [OSError(98, "Address already in use")]))) == 2
    assert run_main("kvasir x", lambda: raising(KeyboardInterrupt())) == 130
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "kvasir x: error: --layers 'a': expected A:B",
        "kvasir x: error: No such file or directory: m.gguf",
        "kvasir x: error: Address already in use",
    ]
    with pytest.raises(ZeroDivisionError):
        run_main("kvasir x", lambda: raising(ZeroDivisionError()))


def test_error_line_of_os_errors() -> None:
    assert error_line(OSError(98, "Address already in use")) == "Address already in use"
    assert error_line(OSError("no errno")) == "no errno"


# ---------------------------------------------------------------------------------------------------- processes


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60, check=False
    )


def test_market_on_a_busy_port_is_one_line(busy_port: int, tmp_path: Path) -> None:
    out = _run(["-m", "kvasir", "market", "--listen", f"127.0.0.1:{busy_port}", "--db", "m.sqlite"], tmp_path)
    assert out.returncode == 2, out.stderr
    assert out.stderr.splitlines() == [
        f"kvasir market: error: cannot listen on 127.0.0.1:{busy_port}: Address already in use"
    ]


def test_serve_model_on_a_busy_port_is_one_line(
    busy_port: int, tmp_path: Path, tiny_model: Callable[..., Path]
) -> None:
    model = tiny_model("llama")
    out = _run(["-m", "kvasir", "serve-model", str(model), "--listen", f"127.0.0.1:{busy_port}"], tmp_path)
    assert out.returncode == 2, out.stderr
    assert out.stderr.splitlines() == [
        f"kvasir serve-model: error: cannot listen on 127.0.0.1:{busy_port}: Address already in use"
    ]


def test_relay_on_a_busy_port_is_one_line(busy_port: int, tmp_path: Path) -> None:
    out = _run(
        ["-m", "kvasir.relay", "--listen", f"127.0.0.1:{busy_port}", "--trust-key", "ed25519:" + "A" * 43], tmp_path
    )
    assert out.returncode == 2, out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("relay: error: ") and "in use" in lines[0], out.stderr


def test_an_open_api_off_loopback_needs_keys_or_consent(tmp_path: Path) -> None:
    """N22 (security-2): ``--api-host 0.0.0.0`` without ``--api-key-file`` used to start an open API silently."""
    args = ["-m", "kvasir", "node", "--manifest", "ring.toml", "--rank", "0", "--api-port", "8080"]
    out = _run([*args, "--api-host", "0.0.0.0"], tmp_path)
    assert out.returncode == 2, out.stderr
    assert out.stderr.splitlines() == [
        "kvasir node: error: --api-host 0.0.0.0 without --api-key-file would let anyone use the ring: "
        "give --api-key-file FILE, or --allow-open-api to mean it"
    ]
    # Consent (or loopback) passes this check and fails only later, on the missing manifest.
    for extra in (["--api-host", "0.0.0.0", "--allow-open-api"], ["--api-host", "::1"]):
        out = _run([*args, *extra], tmp_path)
        assert out.returncode == 2 and "ring.toml" in out.stderr and "api-host" not in out.stderr, out.stderr
