"""Helpers shared by tests in several folders (and by ``benchmarks/remote_tier.py``).

``valkey_servers`` / ``valkey_fixtures``: real Redis/Valkey servers on 127.0.0.1, started here
and stopped by PID (tiers/remote, cli, connectors/vllm). ``disk_records``: where a block's disk
record lives, to damage or inspect it (tiers/disk, connectors/vllm, the reliability helpers).
``remote_blocks``: the shared tier's ``RemoteBlockIO`` in the test's process over bytearray
slots (tiers/remote).

Importable as ``support`` from every test folder: pytest's default ``prepend`` import mode puts
tests/ on sys.path for tests/conftest.py (tests/ has no ``__init__.py``).
"""
