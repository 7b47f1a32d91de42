"""KeyMap's batch helpers for store planning: which kvtier blocks have engine blocks, and their
engine block ids in the order the store's CPU slots are in (a mismatch stores one block's
bytes under another's key)."""

from kvtier.connectors.vllm.scheduler.requests import KeyMap


def test_allocated_skips_blocks_with_a_null_engine_block():
    km = KeyMap(32, 16, 16)  # two engine blocks per kvtier block
    assert km.allocated([5, 6, 7, 8], 0, 2) == [0, 1]  # the one-slice path
    assert km.allocated([5, 6, 0, 7, 8, 9], 0, 3) == [0, 2]  # block 1 half freed
    assert km.allocated([5, 6, 0, 7, 8, 9], 1, 3) == [2]
    assert km.allocated([0, 0], 0, 1) == []


def test_gpu_ids_follow_the_order_asked_for():
    km = KeyMap(32, 16, 16)
    table = list(range(100, 120))
    assert km.gpu_ids_of(table, [0, 1, 2]) == (100, 101, 102, 103, 104, 105)
    assert km.gpu_ids_of(table, [1, 3]) == (102, 103, 106, 107)
    # a permutation of a run is not that run: each block keeps its own engine blocks
    assert km.gpu_ids_of(table, [0, 2, 1, 3]) == (100, 101, 104, 105, 102, 103, 106, 107)
    assert km.gpu_ids_of(table, []) == ()
