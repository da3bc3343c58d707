"""ONNX Runtime's CUDA execution provider allocates through carve.

    opts = carve.onnxruntime.provider_options(carve.PoolResource(carve.CudaResource(0)))
    sess = onnxruntime.InferenceSession(model, providers=[("CUDAExecutionProvider", opts)])

The options are the addresses of carve's ``gpu_external_alloc`` / ``gpu_external_free`` /
``gpu_external_empty_cache`` functions as decimal strings, as the provider expects. Blocks are
recorded with their resource and size, so the provider's size-less frees work.
"""

from __future__ import annotations

from typing import Dict, Optional

from . import _carve
from ._resources import Resource, _as_raw

__all__ = ["provider_options"]


def provider_options(resource: Optional[Resource] = None) -> Dict[str, str]:
    """Binds carve's ONNX Runtime symbols to ``resource`` (None: the current carve resource of
    the calling thread's device) and returns the CUDA provider options that select them."""
    _carve.ort_set_resource(None if resource is None else _as_raw(resource))
    fns = _carve.function_addresses()
    return {
        "gpu_external_alloc": str(fns["carve_ort_alloc"]),
        "gpu_external_free": str(fns["carve_ort_free"]),
        "gpu_external_empty_cache": str(fns["carve_ort_empty_cache"]),
    }
