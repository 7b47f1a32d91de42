"""Diagnostics of ``vllm_e2e.py`` inside a configuration's running engine.

``drop_page_cache`` makes a disk hit cold. The rest says where the host's time goes in a short
request. A 16-token prompt is host-bound on an H100: its time is vLLM's Python and CUDA launches, so it
measures the host as much as the configuration. Two diagnostics for that, run after the sweep
in the configuration's own process (``vllm_e2e_child.py``):

* ``cpu_scan`` (``--cpu-scan N``): the same request with the engine thread pinned to each vCPU
  in turn. On the lent machines the vCPUs ran plain Python 1.5-1.9x apart, and which ones were
  slow changed within a minute (a neighbour on the physical core: nothing inside the guest
  shows it), so two processes compared on whichever core they happened to get differ by that
  much. Compare configurations CPU by CPU, or time them with ``--quiet-core``.
* ``sampled_loop`` (``--pyspy N``): N such requests sampled by py-spy with native frames
  (``pyspy_summary.py`` compares the profiles function by function, CUDA driver included).
"""

from __future__ import annotations

import os
import statistics
import time

from vllm_e2e_engine import BYPASS, gen, reset, timed, tokens


def computed_16(llm, a, seed: int, n: int) -> list[float]:
    """One 16-token prompt (``seed``) computed once to warm up, then ``n`` times after a GPU
    prefix-cache reset (kvtier told to stay out, as its paired recomputes are): the times, ms."""
    p = tokens(16, seed, a.vocab)
    extra = BYPASS if a.connector.startswith("kvtier") else None
    gen(llm, p, extra_args=extra)
    ms = []
    for _ in range(n):
        reset(llm)
        ms.append(timed(llm, p, extra)[0])
    return ms


def sampled_loop(llm, a) -> dict:
    """``--pyspy N``: N requests of one 16-token prompt computed again and again (kvtier told to
    stay out, as its paired recomputes are), sampled by py-spy with native frames: where the
    engine thread's time goes in a short request, function by function down into the CUDA
    driver, comparable between configurations. Returns the requests' times."""
    import ctypes
    import signal
    import subprocess

    ctypes.CDLL(None).prctl(0x59616D61, ctypes.c_ulong(-1), 0, 0, 0)  # PR_SET_PTRACER, any
    path = os.path.join(a.pyspy_dir, f"{a.shape}-{a.label}.txt")
    os.makedirs(a.pyspy_dir, exist_ok=True)
    spy = subprocess.Popen([a.pyspy_bin, "record", "--pid", str(os.getpid()), "--rate", "1000",
                            "--native", "--threads", "--idle", "--format", "raw",
                            "--output", path], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(2.0)  # py-spy attached and sampling
    ms = [round(x, 2) for x in computed_16(llm, a, 4242, a.pyspy)]
    spy.send_signal(signal.SIGINT)
    try:
        err = spy.communicate(timeout=60)[1].decode(errors="replace")[-400:]
    except subprocess.TimeoutExpired:
        spy.kill()
        err = "py-spy did not stop"
    return {"ms": ms, "profile": path, "pyspy": err}


def cpu_scan(llm, a) -> dict:
    """``--cpu-scan N``: the engine thread pinned to each CPU it may use in turn, N requests of
    one 16-token prompt computed on each (kvtier told to stay out), plus the pure-Python probe.
    A lent machine's vCPUs are not equally fast (a busy neighbour on the physical core steals
    cycles): a short request's time depends on where the engine thread happens to run, which
    differs between processes. The scan separates that from a configuration's own cost:
    compare configurations CPU by CPU."""
    from host_probe import python_ms  # benchmarks/: the harness imports this module

    out = {}
    try:
        for cpu in a.cpus:
            os.sched_setaffinity(0, {cpu})  # this thread only (the engine's, in-process)
            ms = computed_16(llm, a, 4343, a.cpu_scan)
            out[str(cpu)] = {"ms": round(statistics.median(ms), 2),
                             "min": round(min(ms), 2), "python_ms": python_ms(3)}
    finally:
        os.sched_setaffinity(0, a.cpus)
    return out


def drop_page_cache(root: str) -> None:
    """Ask the kernel to drop the cached pages of every file under ``root`` (no root
    privileges needed: POSIX_FADV_DONTNEED on clean pages)."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            try:
                fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass
            finally:
                os.close(fd)


