"""carve.dask on two GPUs: one Dask worker per GPU, each with a carve pool, sums a CuPy array
(and a PyTorch tensor) on carve memory; every worker's statistics count it (dask_workers.py)."""

import os

import pytest

import carve

from .conftest import need, run_script

need("cupy")
need("distributed")


def test_one_worker_per_gpu_reduces_on_carve_pools():
    if carve.device_count() < 2:
        reason = f"needs 2 GPUs, found {carve.device_count()}"
        # As the Rust multi-GPU tests: CARVE_REQUIRE_GPUS=2 makes a missing second GPU a failure.
        if os.environ.get("CARVE_REQUIRE_GPUS") == "2":
            pytest.fail(f"CARVE_REQUIRE_GPUS=2 but {reason}")
        pytest.skip(reason)
    out = run_script("dask_workers.py", "--workers", "2", timeout=300)
    assert out.count('"worker": ') == 2, out
    assert "OK" in out.splitlines(), out
