"""The capture callback's C source (``capture.c``), compiled on first use; a package so wheels carry it."""
