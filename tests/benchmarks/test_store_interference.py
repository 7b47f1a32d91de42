"""``store_interference.py`` off the GPU: its report of the medians, and a clear refusal."""

from __future__ import annotations

import pytest
import torch

import store_interference as si


def test_the_report_gives_each_store_path_its_ratio_to_compute_alone():
    out = {"gpu": "G", "args": {"shape": "1b", "block_tokens": 16, "store_blocks": 64,
                                "matmul": 8192, "rounds": 40, "repeats": 5},
           "copiers": {"kernel": "PagedCopier", "dma": "BatchCopier"}, "block_bytes": 1 << 19,
           "median": {"alone_ms": 60.0, "kernel_ms": 75.0, "dma_ms": 63.0,
                      "kernel_store_device_ms": 50.0, "dma_store_device_ms": 80.0,
                      "kernel_store_gbps": 20.0, "dma_store_gbps": 15.0}}
    text = si.report(out)
    assert "| kernel | 75.0 | 1.25x | 50.0 | 20.0 |" in text
    assert "| dma | 63.0 | 1.05x | 80.0 | 15.0 |" in text
    assert "(32 MiB)" in text


def test_the_engine_blocks_of_the_shape_have_its_bytes():
    view = si.kv_view("8b", 16, 4, torch.device("cpu"))
    assert view.geometry(1).block_bytes == 32 * 2 * 16 * 8 * 128 * 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_without_cuda_it_refuses_in_one_line(capsys):
    assert si.main([]) == 2
    assert capsys.readouterr().err.strip() == "error: needs a CUDA GPU"
