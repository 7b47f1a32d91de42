"""The scheduler half of the vLLM connector (engine-core process): plans, never copies."""
