"""The engine's registered KV caches as kvtier sees them, checked against the connector settings.

Why a check: every copy addresses pages by the geometry the scheduler planned with; caches that
miss a layer or hold pages of another size (a layout kvtier does not know) must stop start-up
with a clear error, not move wrong bytes later. Mamba/SSM state layers are seen as whole
padded pages (:mod:`state_pages`).
"""

from __future__ import annotations

from typing import Mapping

import torch

from kvtier.connectors.vllm.settings import ConnectorSettings, ConnectorSetupError
from kvtier.connectors.vllm.worker.state_pages import state_pages
from kvtier.tiers.gpu_view import GpuKvView


def engine_view(settings: ConnectorSettings, kv_caches: Mapping[str, torch.Tensor]) -> GpuKvView:
    missing = [n for n in settings.layer_names if n not in kv_caches]
    if missing:
        raise ConnectorSetupError(
            f"kvtier: KV caches of layers {missing[:4]} were not registered (got "
            f"{list(kv_caches)[:4]}...)"
        )
    state = set(settings.state_layers)
    view = GpuKvView({n: state_pages(n, kv_caches[n], settings.page_bytes) if n in state
                      else kv_caches[n] for n in settings.layer_names}, "block_pages")
    if view.page_bytes != settings.page_bytes:
        raise ConnectorSetupError(
            f"kvtier: registered KV pages hold {view.page_bytes} B per block and layer, the "
            f"KV cache spec says {settings.page_bytes} B; unsupported cache layout"
        )
    return view
