"""Running rings on this machine: the process launcher and supervisor behind ``kvasir ring up``, tests and benches."""
