"""How a store's GPU -> CPU copy delays the sampled tokens' copy to the host (CUDA only).

Why it matters: vLLM reads each step's sampled token ids back with a small device -> host
copy on its compute stream. A KV store's copy of the same step (256 MiB for 8k tokens of a
Llama-1B shape) on a side stream shares the copy engine, which serves what was queued first:
the token readback waited for the whole store (H100: 4.8-4.9 ms for 256 MiB, 1.7-3.4 ms even
with 1 MiB pieces). kvtier therefore plans stores one step late and submits them before the next
forward (``connectors/scheduler_side.py``), not between a forward and its tokens.

Also measured, as the alternative not taken: a store written by SM threads through UVA
addresses leaves the copy engine free (readback ~0.1 ms) but steals SMs from whatever runs
beside it: a concurrent bf16 matmul ran 2.1x (8 CTAs) to 4.4x (132 CTAs) slower on the H100.

Each figure is a ratio to a baseline taken in the same run (no store, or the matmul alone).

    python benchmarks/diagnostics/d2h_readback.py [--mib 256] [--reps 15]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=int, default=256, help="size of the store copy")
    p.add_argument("--reps", type=int, default=15)
    a = p.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("d2h_readback: no CUDA device; nothing measured")
        return 0
    n = a.mib << 20
    big = torch.empty(n, dtype=torch.uint8, device="cuda")
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    tok = torch.zeros(64, dtype=torch.int64, device="cuda")
    tok_h = torch.empty(64, dtype=torch.int64, pin_memory=True)
    side = torch.cuda.Stream()
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def dma(chunk: int) -> None:
        with torch.cuda.stream(side):
            for off in range(0, n, chunk):
                host[off:off + chunk].copy_(big[off:off + chunk], non_blocking=True)

    def readback_ms(store) -> float:
        """Forward, store queued behind it on the side stream, sampler + token readback."""
        torch.cuda.synchronize()
        x @ x
        fwd = torch.cuda.Event()
        fwd.record()
        if store is not None:
            side.wait_event(fwd)
            store()
        tok.add_(1)
        tok_h.copy_(tok, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        fwd.synchronize()
        t0 = time.perf_counter()
        done.synchronize()
        ms = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        return ms

    def median(fn) -> float:
        return statistics.median(fn() for _ in range(a.reps))

    base = median(lambda: readback_ms(None))
    print(f"token readback, no store: {base:.3f} ms")
    for chunk_mib in (a.mib, 16, 4, 1):
        ms = median(lambda: readback_ms(lambda: dma(min(n, chunk_mib << 20))))
        print(f"  behind a {a.mib} MiB DMA store in {chunk_mib} MiB pieces: {ms:.3f} ms "
              f"(+{ms - base:.3f})")
    try:
        import cupy
    except ImportError:
        print("(no CuPy: UVA-kernel stores not measured)")
        return 0
    kernel = cupy.RawKernel(r'''
extern "C" __global__ void cp(const uint4* __restrict__ s, uint4* __restrict__ d, long long n) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x) d[i] = s[i];
}''', "cp")
    with warnings.catch_warnings():  # newer CuPy prefers Stream.from_external
        warnings.simplefilter("ignore", DeprecationWarning)
        cps = cupy.cuda.ExternalStream(side.cuda_stream)

    def uva(ctas: int) -> None:
        with cps:
            kernel((ctas,), (256,), (cupy.uint64(big.data_ptr()), cupy.uint64(host.data_ptr()),
                                     cupy.int64(n // 16)))

    def matmul_ms(store) -> float:
        torch.cuda.synchronize()
        if store is not None:
            store()
        s0, s1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s0.record()
        x @ x
        s1.record()
        s1.synchronize()
        torch.cuda.synchronize()
        return s0.elapsed_time(s1)

    alone = median(lambda: matmul_ms(None))
    for ctas in (8, 32, 132):
        rb = median(lambda: readback_ms(lambda: uva(ctas)))
        mm = median(lambda: matmul_ms(lambda: uva(ctas)))
        print(f"  UVA-kernel store, {ctas} CTAs: readback {rb:.3f} ms; a matmul beside it "
              f"{mm:.2f} ms vs {alone:.2f} alone ({mm / alone:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
