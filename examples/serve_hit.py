"""Where a repeated prompt's prefix came from, on a server examples/serve.sh started: one
prompt twice, vLLM's own prefix cache reset in between, then the cached tokens vLLM reports
and kvtier's hits per tier (from its metrics endpoint, what ``kvtier stats --url`` reads).

    VLLM_SERVER_DEV_MODE=1 examples/serve.sh MODEL ...        # in one terminal
    python examples/serve_hit.py                               # in another

``VLLM_SERVER_DEV_MODE=1`` lets this script reset vLLM's prefix cache (``/reset_prefix_cache``);
without it the second request is a hit in vLLM's own GPU cache and kvtier is not asked. The
prompt is token ids, so any model and no tokenizer will do. ``--url`` and ``--metrics`` default
to serve.sh's defaults (vLLM on port 8000; examples/kvtier.yaml's metrics on 9400).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request

PROMPT = [(13 * i) % 989 + 7 for i in range(100)]  # token ids: 3 whole blocks of 32


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read() or b"{}")


def _model(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
        return json.loads(r.read())["data"][0]["id"]


def cached_tokens(url: str, model: str) -> int:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 1, "temperature": 0.0}
    usage = _post(url + "/v1/completions", body).get("usage") or {}
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def reset_prefix_cache(url: str) -> bool:
    """vLLM refuses while blocks are held (kvtier's store of the first request may still be
    in flight): try again for a while."""
    for _ in range(600):
        try:
            if _post(url + "/reset_prefix_cache", {}).get("success", True):
                return True
        except urllib.error.HTTPError as exc:
            if exc.code == 404:  # the server was not started with VLLM_SERVER_DEV_MODE=1
                return False
        time.sleep(0.05)
    return False


def hits_per_tier(metrics_url: str) -> dict[str, int]:
    from kvtier.cli.stats_cmd import collect_stats

    tiers = collect_stats(None, None, metrics_url)["tiers"]
    return {name: int(t["hit_blocks"]) for name, t in tiers.items() if t.get("hit_blocks")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="the vLLM server")
    ap.add_argument("--metrics", default="http://127.0.0.1:9400/metrics",
                    help="kvtier's metrics endpoint (the YAML's metrics section)")
    args = ap.parse_args(argv)
    model = _model(args.url)
    first = cached_tokens(args.url, model)
    print(f"first request:  {first} of {len(PROMPT)} prompt tokens cached")
    if not reset_prefix_cache(args.url):
        print("could not reset vLLM's prefix cache: start serve.sh with VLLM_SERVER_DEV_MODE=1",
              file=sys.stderr)
        return 1
    second = cached_tokens(args.url, model)
    print(f"second request: {second} of {len(PROMPT)} prompt tokens cached "
          "(vLLM's prefix cache was reset in between)")
    hits = hits_per_tier(args.metrics)
    shown = ", ".join(f"{tier} {n}" for tier, n in hits.items()) or "none"
    print(f"kvtier's hit blocks per tier: {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
