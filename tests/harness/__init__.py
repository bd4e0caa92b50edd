"""Harnesses for tests and benchmarks (fleets of processes, market load, fault injection, audits): not shipped in
the wheel. The public testing kit (``FakeStage``, tiny models) stays in ``kvasir.testing``."""
