"""fetch-window and serve-model: byte-identical stages from HTTP Range requests, the byte budget, resume, and
sources that ignore Range, lie about lengths or serve wrong bytes."""

from __future__ import annotations

import filecmp
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import h11
import pytest
import trio

from kvasir.core.errors import InputError, ModelFileError
from kvasir.net.http import HttpConnection, HttpRequest, serve_http
from kvasir.net.seed import ModelSeeder, parse_range
from kvasir.shard.cache import file_sha256, model_sha256
from kvasir.shard.fetch import SourceError, fetch_window, temp_paths
from kvasir.shard.gguf_header import HeaderCursor, NeedBytes
from kvasir.shard.gguf_io import read_gguf
from kvasir.shard.slice import slice_model, window_ranges
from tests.conftest import run_cli


class Source:
    """A seeder that can misbehave: drop the connection after some requests, lie about ranges, corrupt bytes."""

    def __init__(self, path: Path, sha: str) -> None:
        self.seeder = ModelSeeder(path, sha)
        self.mode = "good"
        self.requests = 0
        self.fail_after: int | None = None
        self.data_offset = read_gguf(path).data_offset

    async def handle(self, http: HttpConnection, request: HttpRequest) -> None:
        self.requests += 1
        size = self.seeder.size
        rng = parse_range(dict(request.headers).get("range"), size)
        if self.fail_after is not None and self.requests > self.fail_after:
            raise ConnectionError("simulated interruption")
        if self.mode == "good" or rng is None:
            await self.seeder.handle(http, request)
            return
        off, n = rng
        data = self.seeder.path.read_bytes()[off : off + n]
        status, headers = 206, [("content-range", f"bytes {off}-{off + n - 1}/{size}")]
        if self.mode == "no-range":
            status, headers, data = 200, [], self.seeder.path.read_bytes()
        elif self.mode == "wrong-range":
            headers = [("content-range", f"bytes {off + 1}-{off + n}/{size}")]
        elif self.mode == "wrong-size" and off > 0:
            headers = [("content-range", f"bytes {off}-{off + n - 1}/{size + 7}")]
        elif self.mode == "short" and n > 1000:
            data = data[: n // 2]
        elif self.mode == "corrupt" and off >= self.data_offset and n > 1000:
            data = data[:10] + bytes([data[10] ^ 0xFF]) + data[11:]
        await http.send(h11.Response(status_code=status, headers=[("content-length", str(len(data))), *headers]))
        await http.send(h11.Data(data=data))
        await http.send(h11.EndOfMessage())


def _names(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


@pytest.fixture
def llama(tiny_model: Callable[..., Path]) -> Path:
    return tiny_model("llama", "q8_0")


@pytest.fixture
async def source(llama: Path, cache_dir: Path) -> AsyncIterator[tuple[str, Source]]:
    src = Source(llama, model_sha256(llama, cache_dir))
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_http, src.handle, "127.0.0.1", 0)
        yield f"http://127.0.0.1:{port}/{llama.name}", src
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize(("arch", "quant"), [("llama", "q8_0"), ("gemma3", "f32"), ("qwen35", "q8_0")])
async def test_fetch_is_byte_identical_and_within_budget(
    arch: str, quant: str, tiny_model: Callable[..., Path], cache_dir: Path, tmp_path: Path
) -> None:
    model = tiny_model(arch, quant)
    sha = model_sha256(model, cache_dir)
    gg = read_gguf(model)
    n = gg.get(f"{gg.get('general.architecture')}.block_count")
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_http, ModelSeeder(model, sha).handle, "127.0.0.1", 0)
        for a, b in [(0, 2), (2, 3), (n - 2, n), (0, n - 1)]:
            ref, out = tmp_path / f"ref-{a}-{b}.gguf", tmp_path / f"out-{a}-{b}.gguf"
            slice_model(model, a, b, ref, source_sha256=sha)
            res = await fetch_window(f"http://127.0.0.1:{port}/", a, b, out, sha256=file_sha256(ref))
            assert filecmp.cmp(ref, out, shallow=False), (a, b)
            window = sum(k for _, k in window_ranges(gg, a, b))
            assert res.window_bytes == window
            assert res.bytes_fetched <= (window + gg.data_offset) * 1.01
            assert res.bytes_fetched < gg.file_size
        nursery.cancel_scope.cancel()
    assert [n for n in _names(tmp_path) if n.startswith(".")] == []


def test_header_requests_never_reach_past_the_header(tiny_model: Callable[..., Path]) -> None:
    """Asking for exactly [buffered, header_ends_after) each time, as fetch does, ends exactly at the header's end."""
    for arch in ("llama", "gemma3", "qwen35moe"):
        model = tiny_model(arch, "f32")
        raw = model.read_bytes()
        cursor = HeaderCursor(str(model), file_size=len(raw))
        step = cursor.feed(b"")
        requests = 0
        while isinstance(step, NeedBytes):
            assert cursor.buffered < step.at_least <= step.header_ends_after
            step = cursor.feed(raw[cursor.buffered : step.header_ends_after])
            requests += 1
        gg = read_gguf(model)
        assert cursor.buffered == step.header_end <= gg.data_offset < step.header_end + gg.alignment
        assert requests < 100


async def test_header_over_the_cap_fails_before_it_is_fetched(
    llama: Path, source: tuple[str, Source], tmp_path: Path
) -> None:
    url, _ = source
    out = tmp_path / "stage.gguf"
    with pytest.raises(ModelFileError, match="header too large"):
        await fetch_window(url, 2, 4, out, max_header_bytes=1000)
    assert _names(tmp_path) == []  # no stage, no temp file, no resume record
    res = await fetch_window(url, 2, 4, out, max_header_bytes=read_gguf(llama).data_offset)
    assert res.header_bytes <= read_gguf(llama).data_offset


async def test_a_source_whose_size_differs_from_the_record_is_refused(
    llama: Path, source: tuple[str, Source], tmp_path: Path
) -> None:
    url, _ = source
    size = read_gguf(llama).file_size
    with pytest.raises(SourceError, match="the model's record says"):
        await fetch_window(url, 2, 4, tmp_path / "stage.gguf", file_bytes=size + 1)
    assert _names(tmp_path) == []  # refused before the sparse file was made
    assert (await fetch_window(url, 2, 4, tmp_path / "stage.gguf", file_bytes=size)).window_bytes > 0


async def test_resume_after_interruption(llama: Path, source: tuple[str, Source], tmp_path: Path) -> None:
    url, src = source
    ref = tmp_path / "ref.gguf"
    slice_model(llama, 0, 4, ref, source_sha256=src.seeder.sha256)
    out = tmp_path / "stage.gguf"
    before = src.requests
    await fetch_window(url, 0, 4, tmp_path / "count.gguf")
    src.fail_after = src.requests + (src.requests - before) - 1  # the last range request fails
    with pytest.raises(SourceError):
        await fetch_window(url, 0, 4, out)
    sparse, record = temp_paths(out)
    assert sparse.exists() and record.exists() and not out.exists()
    src.fail_after = None
    res = await fetch_window(url, 0, 4, out, sha256=file_sha256(ref))
    assert res.resumed_bytes > 0 and res.bytes_fetched + res.resumed_bytes >= res.window_bytes
    assert filecmp.cmp(ref, out, shallow=False)
    assert not sparse.exists() and not record.exists()


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        ("no-range", "does not honour HTTP Range"),
        ("wrong-range", "lies about lengths"),
        ("wrong-size", "lies about lengths"),
        ("short", "bytes asked for"),
    ],
)
async def test_lying_sources_leave_nothing(mode: str, message: str, source: tuple[str, Source], tmp_path: Path) -> None:
    url, src = source
    src.mode = mode
    out = tmp_path / "stage.gguf"
    with pytest.raises(SourceError, match=message):
        await fetch_window(url, 2, 4, out)
    assert not out.exists()


async def test_wrong_bytes_fail_the_hash(llama: Path, source: tuple[str, Source], tmp_path: Path) -> None:
    url, src = source
    ref = tmp_path / "ref.gguf"
    slice_model(llama, 2, 4, ref, source_sha256=src.seeder.sha256)
    src.mode = "corrupt"
    out = tmp_path / "stage.gguf"
    with pytest.raises(SourceError, match="wrong bytes"):
        await fetch_window(url, 2, 4, out, sha256=file_sha256(ref))
    assert _names(tmp_path) == ["ref.gguf"]  # nothing half-written, no temp left
    src.mode = "good"
    await fetch_window(url, 2, 4, out, sha256=file_sha256(ref))
    assert filecmp.cmp(ref, out, shallow=False)


async def test_window_outside_the_model(source: tuple[str, Source], tmp_path: Path) -> None:
    url, _ = source
    with pytest.raises(InputError, match="outside"):
        await fetch_window(url, 4, 9, tmp_path / "x.gguf")


def test_parse_range() -> None:
    assert parse_range(None, 100) is None
    assert parse_range("bytes=0-9", 100) == (0, 10)
    assert parse_range("bytes=90-", 100) == (90, 10)
    assert parse_range("bytes=-5", 100) == (95, 5)
    assert parse_range("bytes=0-1000", 100) == (0, 100)
    assert parse_range("bytes=0-1,5-6", 100) is None


def test_cli_fetch_window_and_serve_model(llama: Path, tmp_path: Path) -> None:
    seeder = subprocess.Popen(
        [sys.executable, "-m", "kvasir", "serve-model", str(llama), "--listen", "127.0.0.1:0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    plain = subprocess.Popen(
        [sys.executable, "-m", "http.server", "0", "--bind", "127.0.0.1", "--directory", str(llama.parent)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert seeder.stdout is not None and plain.stdout is not None
        url = seeder.stdout.readline().split("serving ")[1].split()[0]
        r = run_cli("slice", str(llama), "--layers", "0:2", "-o", str(tmp_path / "ref.gguf"))
        assert r.returncode == 0, r.stderr
        r = run_cli("fetch-window", url, "--layers", "0:2", "-o", str(tmp_path / "out.gguf"), "--json")
        assert r.returncode == 0, r.stderr
        assert filecmp.cmp(tmp_path / "ref.gguf", tmp_path / "out.gguf", shallow=False)
        r = run_cli("fetch-window", url, "--layers", "0:2", "-o", str(tmp_path / "bad.gguf"), "--sha256", "0" * 64)
        assert r.returncode == 2 and "wrong bytes" in r.stderr and not (tmp_path / "bad.gguf").exists()
        port = plain.stdout.readline().split("port ")[1].split()[0]
        r = run_cli(
            "fetch-window",
            f"http://127.0.0.1:{port}/{llama.name}",
            "--layers",
            "0:2",
            "-o",
            str(tmp_path / "plain.gguf"),
        )
        assert r.returncode == 2 and "does not honour HTTP Range" in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
    finally:
        for p in (seeder, plain):
            p.terminate()
            p.wait(10)
            if p.stdout is not None:
                p.stdout.close()
