"""Numba under carve: kernels with carve's EMM plugin (fresh process: Numba picks its memory
manager once) and with a carve device heap (the ported examples/numba_heap.py)."""

import os

from .conftest import need, run_script

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


def test_emm_plugin_runs_kernels_on_carve_memory():
    need("numba")
    out = run_script("numba_emm.py", env={"NUMBA_CUDA_MEMORY_MANAGER": "carve.numba"})
    assert "numba emm: ok" in out


def test_device_heap_example():
    need("numba")
    example = os.path.join(ROOT, "examples", "numba_heap.py")
    out = run_script(os.path.relpath(example, os.path.dirname(__file__)), "--capacity", "65536")
    assert "all checks passed" in out
