"""Rebuild which blocks an instance holds, per tier, from its KV events alone.

This is what a router or indexer (llm-d style) keeps for every instance: ``BlockStored`` adds
hashes to a tier, ``BlockRemoved`` takes them out, ``AllBlocksCleared`` empties every tier.
It works for vLLM's own stream too; kvtier's publisher adds the disk tier ("STORAGE") and
access events (counted here as hits per tier).

After a ``Gap`` (history lost: the consumer was away longer than the replay buffer reaches)
the index is marked stale until the next ``AllBlocksCleared``, which kvtier's publisher sends,
followed by everything it holds, as soon as a consumer reports a gap.

    python examples/block_index_consumer.py --endpoint tcp://127.0.0.1:5570 \\
        --replay-endpoint tcp://127.0.0.1:5571
"""

from __future__ import annotations

import argparse
import time
from collections import Counter, defaultdict

from kvtier.observe.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Delivery,
    EventSubscriber,
    Gap,
    KvtierEventBatch,
)


class BlockIndex:
    def __init__(self) -> None:
        self.tiers: dict[str, set] = defaultdict(set)
        self.hits: Counter[str] = Counter()  # blocks hit, per tier
        self.hit_tokens: Counter[str] = Counter()
        self.stale = False  # True between a Gap and the next AllBlocksCleared
        self.last_seq = -1  # for a reconnect: EventSubscriber(start_seq=last_seq + 1)

    def apply(self, item: Delivery | Gap) -> None:
        if isinstance(item, Gap):
            self.stale = True
            return
        self.apply_batch(item.batch)
        self.last_seq = item.seq

    def apply_batch(self, batch: KvtierEventBatch) -> None:
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self.tiers[ev.medium or "?"].update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                self.tiers[ev.medium or "?"].difference_update(ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                self.tiers.clear()
                self.stale = False
        for acc in batch.access:
            self.hits[acc.medium or "?"] += len(acc.block_hashes)
            self.hit_tokens[acc.medium or "?"] += acc.num_tokens

    def sets(self) -> dict[str, set]:
        return {tier: set(keys) for tier, keys in self.tiers.items() if keys}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--replay-endpoint")
    ap.add_argument("--topic", default="")
    ap.add_argument("--every", type=float, default=2.0, help="seconds between summaries")
    args = ap.parse_args()
    index = BlockIndex()
    sub = EventSubscriber(args.endpoint, replay_endpoint=args.replay_endpoint, topic=args.topic,
                          start_seq=0 if args.replay_endpoint else None)
    next_print = time.monotonic()
    try:
        while True:
            for item in sub.poll(0.5):
                index.apply(item)
            if time.monotonic() >= next_print:
                if args.replay_endpoint:  # catch batches the live stream missed while idle
                    for item in sub.sync():
                        index.apply(item)
                counts = ", ".join(f"{t} {len(k)}" for t, k in sorted(index.tiers.items()))
                hits = ", ".join(f"{t} {n}" for t, n in sorted(index.hits.items()))
                flag = " (stale: waiting for a resync)" if index.stale else ""
                print(f"seq {index.last_seq}: blocks {counts or 'none'}; "
                      f"hits {hits or 'none'}{flag}",
                      flush=True)
                next_print = time.monotonic() + args.every
    except KeyboardInterrupt:
        pass
    finally:
        sub.close()


if __name__ == "__main__":
    main()
