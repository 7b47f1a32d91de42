"""The disk tier's LMDB index: records by key, its checks, and the inventory read at start-up."""
