"""A buffer handed to another library (DLPack, CUDA Array Interface) is freed only after the
work that library queued on it: a gate holds the consumer's stream back, the buffer is dropped
and its block reallocated and written, then the gate opens. A free that did not wait lets the
consumer's late write overwrite the new owner's data."""

import ctypes
import gc
import threading

import pytest

import carve

from .conftest import need

torch = need("torch")
cupy = need("cupy")

MiB = 1 << 20
N = 1 * MiB

_GATE = cupy.RawKernel(
    r"""
extern "C" __global__ void carve_gate(const volatile int* flag) {
  while (*flag == 0) {
  }
}
""",
    "carve_gate",
)


class Gate:
    """Holds a stream back until :meth:`open`: a kernel spinning on a flag in mapped pinned
    memory, which the host sets."""

    def __init__(self):
        self.flag = carve.DeviceBuffer(4, carve.PinnedResource(0, device_mapped=True))
        self._word = ctypes.c_int.from_address(self.flag.ptr)
        self._word.value = 0

    def hold(self, stream_handle):
        with cupy.cuda.ExternalStream(stream_handle):
            _GATE((1,), (1,), (cupy.uint64(self.flag.ptr),))

    def open(self):
        self._word.value = 1


def _clear_deferred():
    getattr(carve, "take_deferred_error", lambda: None)()


@pytest.fixture
def gate():
    # CUDA loads kernels lazily, and loading one waits for the device: a fill first launched
    # behind a closed gate would wait for the gate forever. Load the tests' kernels now.
    w = torch.empty(N, dtype=torch.uint8, device="cuda")
    w.fill_(7)
    int((w == 7).sum())
    torch.cuda.synchronize()
    g = Gate()
    yield g
    g.open()
    torch.cuda.synchronize()


def _reuse_and_check(pool, addr, gate, stream=0, write_on=None):
    """Reallocates the freed block, writes 1s to it, opens the gate and checks that the 1s
    survive the consumer's queued write of 7s."""
    again = carve.DeviceBuffer(N, pool, stream=stream)
    assert again.ptr == addr, "the pool handed out another block; the check would be vacuous"
    with torch.cuda.stream(write_on or torch.cuda.default_stream()):
        u = torch.from_dlpack(again)
        u.fill_(1)
    gate.open()
    torch.cuda.synchronize()
    sevens = int((u == 7).sum())
    assert sevens == 0, f"{sevens} bytes of the reused block were overwritten by the consumer"
    assert carve.take_deferred_error() is None


def test_dlpack_free_waits_for_the_consumer_stream(gate):
    _clear_deferred()
    pool = carve.PoolResource(carve.CudaResource(0), 16 * MiB)
    consumer = torch.cuda.Stream()  # non-blocking: the legacy stream does not wait for it
    buf = carve.DeviceBuffer(N, pool)
    addr = buf.ptr
    with torch.cuda.stream(consumer):
        t = torch.from_dlpack(buf)  # torch passes `consumer` as the DLPack stream
        gate.hold(consumer.cuda_stream)
        t.fill_(7)
    del t
    # Dropping the buffer waits for the consumer's work, with the GIL released, so the timer
    # thread can open the gate.
    threading.Timer(0.5, gate.open).start()
    del buf
    gc.collect()
    _reuse_and_check(pool, addr, gate)


def test_cuda_array_interface_free_waits_for_the_consumer(gate):
    _clear_deferred()
    pool = carve.PoolResource(carve.CudaResource(0), 16 * MiB)
    consumer = torch.cuda.Stream()
    buf = carve.DeviceBuffer(N, pool)
    addr = buf.ptr
    with torch.cuda.stream(consumer):
        t = torch.as_tensor(buf, device="cuda")  # the interface names no consumer stream
        gate.hold(consumer.cuda_stream)
        t.fill_(7)
    threading.Timer(0.5, gate.open).start()
    del t, buf
    gc.collect()
    _reuse_and_check(pool, addr, gate)


def test_legacy_stream_consumer_orders_the_free_on_the_buffers_stream(gate):
    """Buffer on a non-blocking stream, consumer on the legacy default stream: the free is
    ordered by an event (no host wait), so the gate can open after the reuse is queued."""
    _clear_deferred()
    pool = carve.PoolResource(carve.CudaResource(0), 16 * MiB)
    producer = torch.cuda.Stream()
    buf = carve.DeviceBuffer(N, pool, stream=producer)  # the stream object is kept alive
    addr = buf.ptr
    with torch.cuda.stream(torch.cuda.default_stream()):
        t = torch.from_dlpack(buf)  # DLPack stream 1: the legacy default stream
        gate.hold(0)
        t.fill_(7)
    del t, buf
    gc.collect()
    _reuse_and_check(pool, addr, gate, stream=producer, write_on=producer)


def test_a_buffer_outlives_the_stream_objects_it_was_given():
    _clear_deferred()
    pool = carve.PoolResource(carve.CudaResource(0), 16 * MiB)
    s = cupy.cuda.Stream(non_blocking=True)
    buf = carve.DeviceBuffer(N, pool, stream=s)
    with s:
        cupy.asarray(buf).fill(3)
    del s
    gc.collect()  # the buffer holds the stream object, so the stream is not destroyed yet
    del buf
    gc.collect()
    assert carve.take_deferred_error() is None
    assert pool.stats()["bytes_in_use"] == 0


def test_a_raw_stream_destroyed_before_the_buffer_is_not_used_by_its_free():
    _clear_deferred()
    pool = carve.PoolResource(carve.CudaResource(0), 16 * MiB)
    s = cupy.cuda.Stream(non_blocking=True)
    buf = carve.DeviceBuffer(N, pool, stream=s.ptr)
    with s:
        cupy.asarray(buf).fill(3)
    s.synchronize()
    del s
    gc.collect()  # cuStreamDestroy: buf's stream handle now dangles
    del buf
    gc.collect()
    assert carve.take_deferred_error() is None
    assert pool.stats()["bytes_in_use"] == 0
    # The block is back in the pool and serves the legacy stream.
    carve.DeviceBuffer(N, pool)
