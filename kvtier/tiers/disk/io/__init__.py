"""The disk tier's I/O child process (its server, the worker's handle on it) and the replicated
(MLA) store that writes from one rank."""
