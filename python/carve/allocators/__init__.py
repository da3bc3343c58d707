"""Allocators for CuPy, Numba and PyTorch in RMM's ``rmm.allocators`` layout. Each submodule
imports its library; the implementations are :mod:`carve.cupy`, :mod:`carve.numba` and
:mod:`carve.torch`."""
