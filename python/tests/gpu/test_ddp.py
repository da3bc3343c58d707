"""DDP training on 2 GPUs under torchrun (bench/python/ddp_train.py): carve's pool, its expandable
pool, and an expandable pool registered with NCCL, each against PyTorch's native allocator with
the same seeds; the losses must match to the last printed digit. Skips without 2 GPUs (fails
instead with CARVE_REQUIRE_GPUS=2)."""

import os
import subprocess
import sys

import pytest

import carve

from .conftest import need

HERE = os.path.dirname(os.path.abspath(__file__))
# The repository's lab/bench, or the staged copy beside python/tests.
CANDIDATES = [
    os.path.join(HERE, "..", "..", "..", "lab", "bench", "python", "ddp_train.py"),
    os.path.join(HERE, "..", "..", "..", "bench", "python", "ddp_train.py"),
]


def two_gpus():
    if carve._carve.device_count() >= 2:
        return
    reason = f"needs 2 GPUs, found {carve._carve.device_count()}"
    # As the Rust multi-GPU tests: CARVE_REQUIRE_GPUS=2 makes a missing second GPU a failure.
    if os.environ.get("CARVE_REQUIRE_GPUS") == "2":
        pytest.fail(f"CARVE_REQUIRE_GPUS=2 but {reason}")
    pytest.skip(reason)


@pytest.mark.parametrize("allocators", ["carve-pool,carve-expandable", "carve-nccl"])
def test_ddp_losses_match_native(allocators):
    two_gpus()
    need("torch")
    script = next((os.path.abspath(c) for c in CANDIDATES if os.path.exists(c)), None)
    assert script, f"ddp_train.py not found in {CANDIDATES}"
    proc = subprocess.run(
        [sys.executable, script, "--allocators", "native," + allocators],
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = proc.stdout + proc.stderr
    print(out)
    assert proc.returncode == 0, out
    rows = [l for l in proc.stdout.splitlines() if l.startswith("| carve")]
    assert len(rows) == 2 * len(allocators.split(",")), out
    assert all(l.rstrip().endswith("| yes |") for l in rows), out
    assert proc.stdout.count("CHECKED rank=") == 2 * len(allocators.split(",")), out
