"""Loaded by every Python process of a ``vllm serve`` that ``vllm_serve.py --vllm-marks``
starts (this folder leads its ``PYTHONPATH``): marks vLLM's step, intake and output phases on
kvtier's timeline (``vllm_marks.py``) in the API server and the engine core. Benchmark only."""

import os
import sys

if os.environ.get("KVTIER_TIMELINE"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import vllm_marks

    vllm_marks.install_on_import()
