"""Engine connectors. ``kvtier.connectors.vllm`` holds ``KVTierConnector`` for vLLM 0.32.

Nothing is imported here, so ``import kvtier`` never pulls in an engine.
"""
