"""carve's exceptions. Every error carve raises is a :class:`CarveError` carrying carve's message."""


class CarveError(Exception):
    """Base class of every carve error."""


class OutOfMemoryError(CarveError, MemoryError):
    """The resource could not satisfy the request."""

    def __new__(cls, *args: object, **kwargs: object) -> "OutOfMemoryError":
        # ``OutOfMemoryError.__new__`` would otherwise be MemoryError's, which refuses this
        # class; tblib (Dask's exception pickling) rebuilds exceptions through it.
        return CarveError.__new__(cls, *args, **kwargs)


class InvalidArgumentError(CarveError, ValueError):
    """A zero size, a bad alignment, an overflowing size, or another bad argument."""


class InvalidHandleError(CarveError, ValueError):
    """A resource handle that is not live (destroyed, or never created)."""


class NoDeviceError(CarveError, RuntimeError):
    """No CUDA driver, no device, or a device ordinal out of range."""


class DriverError(CarveError, RuntimeError):
    """A CUDA driver call failed."""


class BadPointerError(CarveError, ValueError):
    """A pointer the resource does not own, a double free, or a size mismatch."""


class UnsupportedError(CarveError, NotImplementedError):
    """The operation is not available for this resource."""


class CarveIOError(CarveError, OSError):
    """A file could not be written (the logging adaptor)."""
