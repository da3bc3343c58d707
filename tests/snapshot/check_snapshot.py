#!/usr/bin/env python3
"""Loads a memory snapshot with plain pickle and checks what torch.cuda._memory_viz relies on.

Usage: check_snapshot.py FILE [--expect-segments N] [--expect-events N]

Checks the fields PyTorch's viewer reads, that blocks tile each segment (the assertion in
_memory_viz.segsum), and that every alloc/free event falls inside a segment that exists at that
point of the trace (what MemoryViz.js's segment view needs). Prints a one-line summary.
"""
import pickle
import sys


def fail(msg):
    print(f"check_snapshot: {msg}", file=sys.stderr)
    sys.exit(1)


def main():
    args = sys.argv[1:]
    path = args[0]
    expect = {}
    for flag, value in zip(args[1::2], args[2::2]):
        expect[flag] = int(value)
    with open(path, "rb") as f:
        data = pickle.load(f)
    if not isinstance(data, dict):
        fail("the pickle is not a dict")
    for key in ("segments", "device_traces"):
        if key not in data:
            fail(f"no {key}")
    reserved = allocated = 0
    for i, seg in enumerate(data["segments"]):
        for key in ("device", "address", "total_size", "allocated_size", "active_size",
                    "requested_size", "stream", "segment_type", "blocks"):
            if key not in seg:
                fail(f"segment {i} has no {key}")
        at = seg["address"]
        active = 0
        for b in seg["blocks"]:
            for key in ("address", "size", "requested_size", "state", "frames"):
                if key not in b:
                    fail(f"segment {i}: a block has no {key}")
            if b["address"] != at:
                fail(f"segment {i}: block at {b['address']:#x}, expected {at:#x}")
            if b["state"] not in ("active_allocated", "active_pending_free", "inactive"):
                fail(f"segment {i}: unknown state {b['state']!r}")
            if b["state"] == "active_allocated":
                active += b["size"]
            at += b["size"]
        if at - seg["address"] != seg["total_size"]:
            fail(f"segment {i}: blocks cover {at - seg['address']} of {seg['total_size']} bytes")
        if active != seg["allocated_size"]:
            fail(f"segment {i}: allocated_size {seg['allocated_size']} but blocks hold {active}")
        reserved += seg["total_size"]
        allocated += active
    events = 0
    for d, trace in enumerate(data["device_traces"]):
        segs = {(s["address"], s["total_size"]) for s in data["segments"] if s["device"] == d}
        # Walk back from the final state, as the viewer does, to the segments present earlier.
        live = set(segs)
        seen = []
        for e in reversed(trace):
            for key in ("action", "addr", "size", "stream", "frames"):
                if key not in e:
                    fail(f"device {d}: an event has no {key}")
            a = e["action"]
            if a == "oom" and "device_free" not in e:
                fail(f"device {d}: an oom event has no device_free (_memory_viz trace reads it)")
            if a == "segment_alloc":
                live.discard((e["addr"], e["size"]))
            elif a == "segment_free":
                live.add((e["addr"], e["size"]))
            elif a in ("alloc", "free_requested", "free_completed"):
                seen.append((e["addr"], e["size"], frozenset(live)))
        for addr, size, segments in seen:
            if not any(s <= addr and addr + size <= s + n for s, n in segments):
                fail(f"device {d}: block {addr:#x}+{size} lies in no segment at that time")
        events += len(trace)
    if "--expect-segments" in expect and len(data["segments"]) != expect["--expect-segments"]:
        fail(f"{len(data['segments'])} segments, expected {expect['--expect-segments']}")
    if "--expect-events" in expect and events != expect["--expect-events"]:
        fail(f"{events} events, expected {expect['--expect-events']}")
    print(f"ok: {len(data['segments'])} segments, {reserved} bytes reserved, "
          f"{allocated} allocated, {events} events")


if __name__ == "__main__":
    main()
