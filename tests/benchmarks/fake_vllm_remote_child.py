"""Stands in for ``benchmarks/vllm_remote_child.py`` without vLLM or a GPU: the same arguments
and command protocol, and the same ``--kv-transfer-config`` (``transfer_dict``) read by
kvtier's own loader. With ``tiers.host`` it does what a real instance's scheduler does with
the pool's index: it takes its region of the host's real service (started by the first
instance, in the harness's directory) under its engine id, counts the blocks any instance
published as cached tokens, and publishes the blocks it computed. Without it, its own blocks
alone are cached (a private CPU tier). No bytes move: the harness's bookkeeping is what is
tested, not the tier."""

from __future__ import annotations

import hashlib
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "benchmarks"))

import vllm_remote_child as real  # noqa: E402
from vllm_remote import kv_bytes_per_token  # noqa: E402

TAG = real.TAG


def block_keys(prompt: list[int], block: int) -> list[bytes]:
    """A chained hash per full block, as vLLM's prefix hashes are."""
    keys, h = [], b""
    for i in range(len(prompt) // block):
        h = hashlib.sha256(h + json.dumps(prompt[i * block:(i + 1) * block]).encode()).digest()
        keys.append(h)
    return keys


class Blocks:
    """This instance's blocks, and the host pool's when it has one."""

    def __init__(self, a) -> None:
        from kvtier.config import load_config  # what the connector's settings call, sans vLLM
        from kvtier.manager.host import open_host_tier

        d = real.transfer_dict(a.connector, a.cpu_bytes, a.block_size, a.snapshot,
                               remote=json.loads(a.remote), host=json.loads(a.host),
                               engine_id=a.engine_id)
        self.block = a.block_size
        self.own: set[bytes] = set()
        self.host = None
        if d is not None and d["kv_connector"] == "KVTierConnector":
            config = load_config(data=d["kv_connector_extra_config"]["kvtier"])
            if config.host is not None:
                block_bytes = kv_bytes_per_token(a.shape) * a.block_size
                self.host = open_host_tier(config, f"fake-{a.shape}", block_bytes,
                                           d["engine_id"])
                self.slots = config.cpu_slots(block_bytes)
        self.stored = 0

    def gen(self, prompt: list[int]) -> int:
        """Cached tokens of ``prompt`` (a full hit still computes its last block); its
        blocks are stored (published) afterwards."""
        keys = block_keys(prompt, self.block)
        held = [k in self.own for k in keys]
        if self.host is not None:
            held = [h or s for h, s in zip(held, self.host.held(keys))]
        n = next((i for i, h in enumerate(held) if not h), len(keys))
        new = [k for k, h in zip(keys, held) if not h]
        self.own.update(new)
        self.stored += len(new)
        if self.host is not None and new:
            self.host.publish(new, [self.host.base + (self.stored - len(new) + i) % self.slots
                                    for i in range(len(new))])
        return min(n, (len(prompt) - 1) // self.block) * self.block


def main() -> None:
    a = real.parser().parse_args()
    blocks = Blocks(a)
    print(TAG + json.dumps({"ready": True, "start_s": 0.1}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "gen":
            prompt = cmd["prompt"]
            reply = {"ms": 1.0, "cached": blocks.gen(prompt),
                     "tokens": [(sum(prompt) + i) % 1000 for i in range(cmd.get("max_tokens", 1))]}
        elif op == "stats":
            reply = {"manager": {"stored_blocks": {"CPU": blocks.stored}, "hit_blocks": {}},
                     "engine_id": a.engine_id, "gpu_util": a.gpu_util}
        elif op in ("reset", "settle"):
            reply = {"ok": True}
        else:
            print(TAG + json.dumps({"bye": True}), flush=True)
            break
        print(TAG + json.dumps(reply), flush=True)
    if blocks.host is not None:
        blocks.host.close()


if __name__ == "__main__":
    main()
