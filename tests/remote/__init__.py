"""Real Redis/Valkey servers for the shared-tier tests (started here, stopped by PID)."""
