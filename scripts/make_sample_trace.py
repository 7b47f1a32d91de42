"""Regenerate kvtier/data/sample_trace.jsonl: the small trace `kvtier bench` replays by default.

Deterministic (seeded). Mixes what real traces show: a few system prompts shared by many
requests (Zipf), multi-turn chats whose prompt grows by one turn each time, and one-off
documents that are never seen again. 512-token blocks, Mooncake field names.
"""

import json
import random
import sys
from pathlib import Path

rng = random.Random(20261122)
next_id = 0


def fresh(n: int) -> list[int]:
    global next_id
    ids = list(range(next_id, next_id + n))
    next_id += n
    return ids


systems = [fresh(rng.randint(2, 6)) for _ in range(8)]
chats: list[list[int]] = []
lines = []
t = 0
for _ in range(400):
    t += rng.randint(5, 200)
    kind = rng.random()
    if kind < 0.45 and chats:  # next turn of an existing chat
        i = rng.randrange(len(chats))
        chats[i] = chats[i] + fresh(rng.randint(1, 3))
        ids = chats[i]
        if len(ids) > 40:
            chats.pop(i)
    elif kind < 0.8:  # new chat on a popular system prompt
        s = systems[min(int(rng.paretovariate(1.2)) - 1, len(systems) - 1)]
        ids = s + fresh(rng.randint(1, 4))
        chats.append(ids)
    else:  # one-off long document
        ids = fresh(rng.randint(8, 24))
    tokens = len(ids) * 512 - rng.randint(0, 400)
    lines.append({"timestamp": t, "input_length": tokens,
                  "output_length": rng.randint(1, 300), "hash_ids": ids})

out = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent.parent / "kvtier/data/sample_trace.jsonl")
out.write_text("".join(json.dumps(x) + "\n" for x in lines))
print(f"wrote {len(lines)} requests, {sum(len(x['hash_ids']) for x in lines)} block refs to {out}")
