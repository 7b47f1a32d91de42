"""Helpers of the reliability suite (tests/test_reliability_*.py, benchmarks/reliability_report.py):
block contents that prove their own identity, a crash child and its checker, fault injection,
a full-stack rig, a manager reference model and a soak loop."""
