"""carve's calls release the GIL while they block, so other Python threads run meanwhile.
Shown on the CPU with a logging adaptor writing into a FIFO: the write blocks until a Python
thread reads, which it can only do while the writer has released the GIL. The script runs in a
child process, so a call that holds the GIL shows as a timeout, not a hung suite."""

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import gc, os, sys, threading
    import carve

    fifo = sys.argv[1]
    lines = []
    opened = threading.Event()
    drain = threading.Event()

    def reader():
        opened.wait()
        with open(fifo) as f:
            drain.wait()
            for line in f:
                lines.append(line)

    threading.Thread(target=reader, daemon=True).start()
    # Opening a FIFO to write blocks until the reader opens it, which the reader thread only
    # does after this thread has entered carve's call.
    threading.Timer(0.2, opened.set).start()
    log = carve.LoggingAdaptor(carve.HostResource(), fifo, auto_flush=True)
    # More lines than the pipe holds: the writes block until the reader drains, which it only
    # starts once this thread is inside carve's calls.
    threading.Timer(0.2, drain.set).start()
    for _ in range(3000):
        p = log.allocate(256)
        log.deallocate(p, 256)
        b = carve.DeviceBuffer(256, log)
        del b
    del log
    gc.collect()

    # Teardown: the adaptor's last flush meets a full pipe, which a Python thread drains only
    # once this thread is inside the resource's destructor.
    fifo2 = sys.argv[2]
    drain2 = threading.Event()
    got = []

    def reader2():
        with open(fifo2, "rb") as f:
            drain2.wait()
            got.append(f.read())

    t2 = threading.Thread(target=reader2, daemon=True)
    t2.start()
    log = carve.LoggingAdaptor(carve.HostResource(), fifo2)  # buffered: no write yet
    filler = os.open(fifo2, os.O_WRONLY | os.O_NONBLOCK)
    try:
        while True:
            os.write(filler, b"x" * 4096)
    except BlockingIOError:
        pass
    os.close(filler)
    p = log.allocate(256)
    log.deallocate(p, 256)
    threading.Timer(0.2, drain2.set).start()
    del log
    t2.join()
    assert got and b"allocate" in got[0] and b"free" in got[0], got[0][-300:]
    print("done", file=sys.stderr)
    """
)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_blocking_calls_release_the_gil(tmp_path):
    fifo, fifo2 = tmp_path / "log.csv", tmp_path / "teardown.csv"
    os.mkfifo(fifo)
    os.mkfifo(fifo2)
    try:
        proc = subprocess.run(
            [sys.executable, "-c", SCRIPT, str(fifo), str(fifo2)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"a carve call blocked while holding the GIL (deadlock): {e.stderr!r}")
    assert proc.returncode == 0 and "done" in proc.stderr, proc.stderr
