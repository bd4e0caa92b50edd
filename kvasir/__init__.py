"""Kvasir: one large language model across a ring of ordinary devices, with no central master."""

__version__ = "0.1.0"
