"""Engine connectors: ``kvtier.connectors.vllm`` is kvtier as a vLLM KV connector.

Nothing is imported here, so ``import kvtier`` never pulls in an engine.
"""
