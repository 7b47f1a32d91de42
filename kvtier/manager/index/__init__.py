"""A tier's resident blocks: entries, their states and pins, eviction order, walks."""
