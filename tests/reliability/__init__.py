"""Helpers of the reliability suite (test_reliability_*.py beside them, benchmarks/reliability_report.py):
block contents that prove their own identity, a crash child and its checker, fault injection,
a full-stack rig, a manager reference model and a soak loop."""
