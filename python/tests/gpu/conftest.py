import os
import subprocess
import sys

import pytest

import carve

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(autouse=True)
def _gpu():
    """Every test here needs a GPU: skip without one, fail instead with CARVE_REQUIRE_GPU=1."""
    if carve.is_available():
        return
    reason = "no CUDA device (carve.is_available() is False)"
    if os.environ.get("CARVE_REQUIRE_GPU") == "1":
        pytest.fail(f"CARVE_REQUIRE_GPU=1 but {reason}")
    pytest.skip(reason)


def need(module):
    """Import `module`, or skip (fail with CARVE_REQUIRE_GPU=1) when it is not installed."""
    try:
        return __import__(module)
    except ImportError as e:
        if os.environ.get("CARVE_REQUIRE_GPU") == "1":
            pytest.fail(f"CARVE_REQUIRE_GPU=1 but {module} is missing: {e}", pytrace=False)
        pytest.skip(f"{module} is not installed", allow_module_level=True)


def run_script(name, *args, env=None, timeout=600):
    """Runs a helper script of this folder in a fresh interpreter (for process-wide switches:
    torch's allocator swap, Numba's memory manager); fails with its output on non-zero exit."""
    full_env = dict(os.environ, **(env or {}))
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, name), *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
    )
    out = proc.stdout + proc.stderr
    print(out)
    assert proc.returncode == 0, out
    return out
