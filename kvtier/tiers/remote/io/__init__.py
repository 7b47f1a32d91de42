"""The shared tier's I/O child processes: each maps the CPU pool and moves block bytes between
its slots and the servers."""
