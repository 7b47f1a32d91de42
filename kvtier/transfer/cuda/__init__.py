"""The CUDA copy path between the engine's KV tensors and the pinned CPU pool.

Gather/scatter kernels move scattered pages through a GPU staging ring; the copy engines move
the staged chunks to and from pinned memory in large DMA requests, pipelined on dedicated
streams. CuPy is used when importable (kernels, cheap ``cudaMemcpyAsync``); otherwise torch
indexing does the gather (slower, same bytes). Importing this package needs neither CUDA nor
CuPy; building a handler needs CUDA.
"""

from kvtier.transfer.cuda.handlers import CudaCpuToGpuHandler, CudaGpuToCpuHandler

__all__ = ["CudaCpuToGpuHandler", "CudaGpuToCpuHandler"]
