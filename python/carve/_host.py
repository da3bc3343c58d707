"""Page-locked host memory as numpy arrays, with PyCUDA's names: :func:`pagelocked_empty`,
:func:`pagelocked_zeros` (and their ``_like`` forms) and :class:`host_alloc_flags`; the device
pointer of a mapped array; and :func:`mem_get_info`.

Each array's memory is a :class:`carve._carve.PagelockedAllocation` (from ``cuMemHostAlloc``):
the array's ``.base``, which keeps it alive and frees it when the last view goes. As in
PyCUDA, ``ary.base.get_device_pointer()`` gives a mapped array's device address and
``ary.base.get_flags()`` the flags the driver records."""

from __future__ import annotations

import enum
import numbers
from typing import TYPE_CHECKING, Any, Optional, Sequence, Tuple, Union

from . import _carve

if TYPE_CHECKING:
    import numpy

Shape = Union[int, Sequence[int]]


class host_alloc_flags(enum.IntFlag):  # noqa: N801 (PyCUDA's name)
    """``cuMemHostAlloc`` flags, as PyCUDA's ``pycuda.driver.host_alloc_flags``; combine with
    ``|``."""

    #: Pinned for every CUDA context, not only the allocating one.
    PORTABLE = _carve.HOST_ALLOC_PORTABLE
    #: Mapped into the device's address space: kernels reach it through
    #: :func:`get_device_pointer` without a copy.
    DEVICEMAP = _carve.HOST_ALLOC_DEVICEMAP
    #: Write-combined: fast host writes and transfers to the device, very slow host reads.
    WRITECOMBINED = _carve.HOST_ALLOC_WRITECOMBINED


def _shape(shape: Shape) -> Tuple[int, ...]:
    if isinstance(shape, numbers.Integral):
        shape = (shape,)
    dims = tuple(int(d) for d in shape)
    if any(d < 0 for d in dims):
        raise ValueError(f"negative dimensions are not allowed: {dims}")
    return dims


def pagelocked_zeros(
    shape: Shape,
    dtype: Any = float,
    order: str = "C",
    mem_flags: int = 0,
    *,
    device: Optional[int] = None,
) -> "numpy.ndarray":
    """A zeroed numpy array in page-locked host memory with ``mem_flags``
    (:class:`host_alloc_flags`), pinned in ``device``'s context (None: the current one), as
    PyCUDA's ``pagelocked_zeros``."""
    import numpy as np

    dims = _shape(shape)
    dt = np.dtype(dtype)
    if dt.hasobject:
        raise TypeError(f"page-locked arrays cannot hold Python objects (dtype {dt})")
    if order not in ("C", "F"):
        raise ValueError(f"order must be 'C' or 'F', not {order!r}")
    count = 1
    for d in dims:
        count *= d
    alloc = _carve.PagelockedAllocation(count * dt.itemsize, int(mem_flags), device)
    if dt.fields is not None or dt.subdtype is not None:
        # Records and sub-arrays need numpy's full description: a view of the bytes.
        return np.asarray(alloc).view(dt).reshape(dims, order=order)
    strides = None
    if order == "F":
        strides, step = [], dt.itemsize
        for d in dims:
            strides.append(step)
            step *= d
    # The allocation itself is the array's base, as PyCUDA's HostAllocation is.
    alloc.set_array_layout(list(dims), dt.str, dt.itemsize, strides)
    return np.asarray(alloc)


def pagelocked_empty(
    shape: Shape,
    dtype: Any = float,
    order: str = "C",
    mem_flags: int = 0,
    *,
    device: Optional[int] = None,
) -> "numpy.ndarray":
    """A numpy array in page-locked host memory, as PyCUDA's ``pagelocked_empty`` (carve
    zeroes the memory: its resource hands out host blocks zeroed)."""
    return pagelocked_zeros(shape, dtype, order, mem_flags, device=device)


def _like_order(array: "numpy.ndarray") -> str:
    return "F" if array.flags.f_contiguous and not array.flags.c_contiguous else "C"


def pagelocked_empty_like(
    array: "numpy.ndarray", mem_flags: int = 0, *, device: Optional[int] = None
) -> "numpy.ndarray":
    """:func:`pagelocked_empty` with ``array``'s shape, dtype and order."""
    return pagelocked_empty(
        array.shape, array.dtype, _like_order(array), mem_flags, device=device
    )


def pagelocked_zeros_like(
    array: "numpy.ndarray", mem_flags: int = 0, *, device: Optional[int] = None
) -> "numpy.ndarray":
    """:func:`pagelocked_zeros` with ``array``'s shape, dtype and order."""
    return pagelocked_zeros(
        array.shape, array.dtype, _like_order(array), mem_flags, device=device
    )


def allocation_of(array: Any) -> "_carve.PagelockedAllocation":
    """The page-locked allocation under ``array`` (a view of one included); ``TypeError`` for
    memory carve did not pin."""
    base = array
    while base is not None and not isinstance(base, _carve.PagelockedAllocation):
        base = getattr(base, "base", None)
    if base is None:
        raise TypeError("not an array in carve's page-locked memory (see carve.pagelocked_empty)")
    return base


def get_device_pointer(array: Any) -> int:
    """The device address of ``array``'s first element, for a kernel to read or write it
    without a copy: ``array`` must be (a view of) an array from :func:`pagelocked_empty` with
    :attr:`host_alloc_flags.DEVICEMAP`, else :class:`carve.UnsupportedError`."""
    alloc = allocation_of(array)
    offset = array.__array_interface__["data"][0] - alloc.ptr
    return alloc.get_device_pointer() + offset


def mem_get_info(device: Optional[int] = None) -> Tuple[int, int]:
    """``(free, total)`` bytes of ``device`` (None: the device whose context is current on
    this thread, else 0), as PyCUDA's ``mem_get_info`` and CuPy's ``memGetInfo``."""
    return _carve.mem_info(_carve.current_device() if device is None else device)
