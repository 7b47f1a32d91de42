"""Host time of kvtier's connector hooks per engine step, in vLLM's CPU engine (tiny model).

Why: past saturation kvtier's decode steps were slower than native's (issue 46). A connector's
hooks run on vLLM's engine thread every step (scheduler side: lookups, ``build_connector_meta``,
``update_connector_output``; worker side: ``bind_connector_metadata``, the per-layer
``wait_for_layer_load``, ``wait_for_save``, ...), so their cost adds to every step of a
CPU-bound engine. This times every hook (wall clock, around the call) while a multi-turn load
runs with more requests than running slots and a small engine KV cache (waiting requests are
looked up again at every step, as on a full server), and prints the hooks' time per step.
vLLM's native connector does not start on a CPU engine, so there is no side-by-side here; the
GPU run's phases are ``step_phases.py``.

    python benchmarks/diagnostics/hook_cost.py --seqs 16 --requests 128 --gpu-blocks 160
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
         "update_connector_output", "request_finished", "take_events", "get_kv_connector_stats",
         "bind_connector_metadata", "start_load_kv", "wait_for_layer_load", "save_kv_layer",
         "wait_for_save", "get_finished", "clear_connector_metadata",
         "build_connector_worker_meta", "handle_preemptions", "on_new_request")


def timed(cls, names, totals, counts, prefix) -> None:
    """Wrap ``cls``'s methods to add their wall time to ``totals[prefix + name]``."""
    for name in names:
        fn = getattr(cls, name, None)
        if fn is None:
            continue

        @functools.wraps(fn)
        def wrapper(*args, _fn=fn, _key=prefix + name, **kwargs):
            t0 = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                totals[_key] += time.perf_counter() - t0
                counts[_key] += 1

        setattr(cls, name, wrapper)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", type=int, default=16, help="vLLM's max_num_seqs (running slots)")
    p.add_argument("--requests", type=int, default=128, help="conversations per turn")
    p.add_argument("--gpu-blocks", type=int, default=160, help="the engine's KV blocks")
    p.add_argument("--cpu-blocks", type=int, default=1024, help="kvtier's CPU tier, blocks")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=32, help="generated per turn")
    p.add_argument("--store-every-steps", type=int, default=None,
                   help="kvtier's store_every_steps (default: kvtier's)")
    a = p.parse_args(argv)
    sys.path[:0] = [ROOT, os.path.join(ROOT, "tests", "connectors", "vllm")]
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
    import engine_util as eu
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.core import EngineCore

    from kvtier.connectors.vllm import KVTierConnector

    totals: dict[str, float] = collections.defaultdict(float)
    counts: dict[str, int] = collections.defaultdict(int)
    timed(EngineCore, ("step", "step_with_batch_queue"), totals, counts, "engine.")
    timed(KVTierConnector, HOOKS, totals, counts, "hook.")
    keys = {} if a.store_every_steps is None else {"store_every_steps": a.store_every_steps}
    llm = LLM(model=eu.write_model(tempfile.mkdtemp()), skip_tokenizer_init=True,
              dtype="float32", enforce_eager=True, block_size=eu.BLOCK, max_model_len=512,
              kv_transfer_config=eu.kvtier_transfer_config(a.cpu_blocks, **keys), seed=0,
              max_num_seqs=a.seqs, num_gpu_blocks_override=a.gpu_blocks)
    sp = SamplingParams(temperature=0.0, max_tokens=a.new_tokens, ignore_eos=True,
                        detokenize=False)
    prompts = eu.prompts(a.requests, 256, seed=1)
    print("| turn | steps | engine step ms | hooks ms per step | hooks' share | top hooks (us per step) |")
    print("|---|---|---|---|---|---|")
    for turn in range(a.turns):
        totals.clear()
        counts.clear()
        outs = llm.generate([TokensPrompt(prompt_token_ids=q) for q in prompts], sp,
                            use_tqdm=False)
        # the next turn: the history (kvtier hits once vLLM's own cache is reset) plus 32 new
        prompts = [(q + list(o.outputs[0].token_ids) + eu.prompts(1, 32, seed=97 * turn + i)[0])
                   [-480:] for i, (q, o) in enumerate(zip(prompts, outs))]
        llm.reset_prefix_cache()
        steps = counts["engine.step"] + counts["engine.step_with_batch_queue"]
        engine = totals["engine.step"] + totals["engine.step_with_batch_queue"]
        hooks = {k[5:]: v for k, v in totals.items() if k.startswith("hook.")}
        top = sorted(hooks.items(), key=lambda kv: -kv[1])[:4]
        print(f"| {turn} | {steps} | {engine / steps * 1e3:.2f} | "
              f"{sum(hooks.values()) / steps * 1e3:.3f} | {sum(hooks.values()) / engine:.1%} | "
              + ", ".join(f"{k} {v / steps * 1e6:.0f}" for k, v in top) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
