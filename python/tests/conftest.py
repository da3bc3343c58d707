import os

import pytest

import carve


def gpu_or_skip():
    """Skip (or, with CARVE_REQUIRE_GPU=1, fail) when no CUDA device is present."""
    if carve.is_available():
        return
    reason = "no CUDA device (carve.is_available() is False)"
    if os.environ.get("CARVE_REQUIRE_GPU") == "1":
        pytest.fail(f"CARVE_REQUIRE_GPU=1 but {reason}")
    pytest.skip(reason)
