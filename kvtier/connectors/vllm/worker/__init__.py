"""The worker half of the vLLM connector (one per GPU worker): executes, decides nothing."""
