"""The helper processes the disk and shared tiers start: isolated start-up, the wire between a
worker and its child, and the CPU pool as a child maps it."""
