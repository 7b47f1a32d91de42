"""The layered CUDA load's choice between strided DMAs per run and UVA reads (no GPU needed)."""

from kvtier.transfer.cuda.direct import MIN_AVG_RUN, scattered


def test_short_runs_read_through_uva_long_runs_use_dma():
    assert not scattered(1, 2048)  # one run: one strided DMA per layer
    assert not scattered(2048 // MIN_AVG_RUN, 2048)
    assert scattered(2048, 2048)  # every slot its own run (a reversed free chain)
    assert scattered(2048 // MIN_AVG_RUN + 1, 2048)
    assert not scattered(4, 7) and scattered(5, 7)  # small jobs: a few DMAs are fine
