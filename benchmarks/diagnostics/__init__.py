"""One-off diagnostics: where a benchmark's time went, not what a user measures.

Profile and trace summaries (profile_summary, pyspy_summary, cprofile_tables), per-request
breakdowns (request_counters, request_phases, serve_phases, step_phases, vllm_marks and
serve_marks/), the connector hooks' host time per step (hook_cost), the
A/B and host diagnostics the real-vLLM harness can run inside its engine (vllm_e2e_diag) and
single-question experiments (d2h_readback, enqueue_cost, gil_starvation, writeback_contention,
arc_cost). Each is run by path (``python benchmarks/diagnostics/X.py``; siblings import each
other by basename) or imported by the harness as ``diagnostics.X`` (benchmarks/ leads sys.path
there). Nothing here imports back from a harness module but the engine helpers
(vllm_e2e_engine) and host_probe.
"""
