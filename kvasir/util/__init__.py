"""Small helpers with no domain knowledge: atomic file output, host:port parsing, backoff, directories, CLI runner."""
