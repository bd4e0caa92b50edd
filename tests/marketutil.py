"""Helpers for market tests: run kvasir services as subprocesses and read the lines they announce."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Generator, Iterator
from typing import Any

import httpx

from kvasir.core.identity import Identity
from kvasir.market import auth


class Proc:
    """A ``kvasir`` subprocess whose stdout and stderr lines are collected by reader threads."""

    def __init__(self, *args: str) -> None:
        self.args = args
        self.p = subprocess.Popen(
            [sys.executable, "-m", "kvasir", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ),
        )
        self.out: list[str] = []
        self.err: list[str] = []
        self.readers = [
            threading.Thread(target=self._read, args=(stream, sink), daemon=True)
            for stream, sink in ((self.p.stdout, self.out), (self.p.stderr, self.err))
        ]
        for t in self.readers:
            t.start()

    @staticmethod
    def _read(stream: Any, sink: list[str]) -> None:
        for line in stream:
            sink.append(line.rstrip("\n"))

    def wait_line(self, pattern: str, timeout: float = 60) -> re.Match[str]:
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.out):
                if m := rx.search(line):
                    return m
            if self.p.poll() is not None:
                time.sleep(0.2)
                raise AssertionError(f"{self.args[0]} exited {self.p.returncode}: {self.err[-20:]}")
            time.sleep(0.05)
        raise AssertionError(f"no line matching {pattern!r} from {self.args[0]}; stderr: {self.err[-20:]}")

    def wait(self, timeout: float = 60) -> int:
        """Wait for a process that ends by itself; its output is complete afterwards."""
        try:
            self.p.wait(timeout)
        finally:
            self.stop()
        return self.p.returncode

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15) -> int:
        if self.p.poll() is None:
            self.p.send_signal(sig)
            try:
                self.p.wait(timeout)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(5)
        for t in self.readers:
            t.join(5)
        for stream in (self.p.stdout, self.p.stderr):
            if stream is not None:
                stream.close()
        return self.p.returncode


@contextlib.contextmanager
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    try:
        yield started
    finally:
        for p in reversed(started):
            p.stop()


def wait_for(check: Callable[[], Any], timeout: float, what: str, interval: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what} (last: {last!r})")


def coverage(url: str) -> dict[str, Any]:
    r = httpx.get(f"{url}/v1/coverage", timeout=10)
    r.raise_for_status()
    model: dict[str, Any] = r.json()["models"][0]
    return model


class SignAuth(httpx.Auth):
    """Signs each request as kvasir.market.auth asks, with ``identity`` at ``clock()`` (tests move the clock)."""

    requires_request_body = True

    def __init__(self, identity: Identity, clock: Callable[[], float] = time.time) -> None:
        self.identity = identity
        self.clock = clock

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        target = request.url.raw_path.decode()
        request.headers.update(auth.sign_request(self.identity, request.method, target, request.content, self.clock()))
        yield request


def signed_model(body: dict[str, Any], operator: Identity) -> dict[str, Any]:
    """A model record's wire body with the operator's signature."""
    from kvasir.market.records import ModelRecord

    return ModelRecord.from_wire(body).signed(operator).to_wire()
