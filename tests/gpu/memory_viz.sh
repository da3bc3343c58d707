#!/usr/bin/env bash
# carve's memory snapshots in PyTorch's viewer, and PyTorch's snapshots in carve replay.
# Needs python with torch (the GPU machine has it) and the staged carve binary (.gpu/bin/carve,
# from ../shared/tools/gpu-stage), or CARVE=path/to/carve.
#
#   bash tests/gpu/memory_viz.sh          # prints one line per check, "memory_viz: all ok" at the end
#
# 1. carve writes snapshots (replay on simulated memory, and on the GPU when there is one) and
#    `python -m torch.cuda._memory_viz` turns each into HTML (trace_plot, segment_plot) and text
#    (stats, trace); the HTML must embed the same pickle.
# 2. PyTorch records a real snapshot (when CUDA is available) and `carve replay --format torch`
#    replays it on carve's pool and arena.
set -euo pipefail
cd "$(dirname "$0")/../.." || exit 1
carve=${CARVE:-.gpu/bin/carve}
[ -x "$carve" ] || carve=target/release/carve
[ -x "$carve" ] || carve=target/debug/carve
[ -x "$carve" ] || { echo "no carve binary (set CARVE=...)"; exit 2; }
py=${PYTHON:-python3}
work=${OUT:-$(mktemp -d)}/memory_viz
mkdir -p "$work"

# A small multi-stream allocation log.
"$py" - "$work/log.csv" <<'PY'
import random, sys
random.seed(7)
rows = ["Thread,Time,Action,Pointer,Size,Stream"]
live, addr = {}, 0x10000
for i in range(2000):
    if random.random() < 0.55 or not live:
        size = random.choice([512, 4096, 65536, 1 << 20, 3 << 20]) * random.randint(1, 4)
        addr += size + 4096
        live[addr] = size
        rows.append(f"{1 + i % 2},t,allocate,{addr:#x},{size},{'0x0' if i % 3 else '0x55'}")
    else:
        a = random.choice(list(live))
        rows.append(f"1,t,free,{a:#x},{live.pop(a)},0x0")
open(sys.argv[1], "w").write("\n".join(rows) + "\n")
PY

check_snapshot() { # FILE
  local f=$1 base
  base=${f%.pickle}
  "$py" -m torch.cuda._memory_viz stats "$f" > "$base.stats.txt"
  "$py" -m torch.cuda._memory_viz trace "$f" > "$base.trace.txt"
  "$py" -m torch.cuda._memory_viz trace_plot "$f" -o "$base.trace.html"
  "$py" -m torch.cuda._memory_viz segment_plot "$f" -o "$base.segments.html"
  "$py" - "$f" "$base.trace.html" "$base.segments.html" <<'PY'
import base64, json, pickle, re, sys
snap = pickle.load(open(sys.argv[1], "rb"))
for html in sys.argv[2:]:
    text = open(html).read()
    m = re.search(r"const local_files = (\[.*?\])\n", text, re.S)
    assert m, f"{html}: no embedded snapshot"
    blob = base64.b64decode(json.loads(m.group(1))[0]["base64"])
    # _memory_viz pads the pickle with NULs to a multiple of 3; pickle stops at its STOP opcode.
    assert pickle.loads(blob) == snap, f"{html}: different pickle"
events = sum(len(t) for t in snap["device_traces"])
print(f"  {sys.argv[1]}: {len(snap['segments'])} segments, {events} events; HTML ok")
PY
  grep -q "total_reserved" "$base.stats.txt"
  echo "ok: _memory_viz stats/trace/trace_plot/segment_plot on $(basename "$f")"
}

# 1a. Simulated memory: no GPU needed.
"$carve" replay "$work/log.csv" --resource pool,arena,binning,cuda --simulate-capacity 8 \
  --snapshot "$work/sim.pickle" --no-progress > "$work/replay-sim.txt"
for f in "$work"/sim.*.pickle; do check_snapshot "$f"; done

# 1b. On the GPU.
"$carve" info > "$work/info.txt" 2>&1 || true
if grep -q "CUDA device" "$work/info.txt"; then
  "$carve" replay "$work/log.csv" --resource pool,async,cuda --snapshot "$work/gpu.pickle" \
    --no-progress > "$work/replay-gpu.txt"
  for f in "$work"/gpu.*.pickle; do check_snapshot "$f"; done
else
  echo "skipped: no GPU for carve replay on a device"
fi

# 2. A real PyTorch snapshot, replayed by carve.
if "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  "$py" - "$work/torch.pickle" <<'PY'
import sys, torch
torch.cuda.memory._record_memory_history(max_entries=100000)
side = torch.cuda.Stream()
keep = []
for step in range(50):
    n = 256 + 64 * (step % 7)
    x = torch.randn(n, n, device="cuda")
    with torch.cuda.stream(side):
        y = torch.randn(n, 2 * n, device="cuda")
    torch.cuda.current_stream().wait_stream(side)
    z = x @ y
    if step % 5 == 0:
        keep.append(z.sum(0))
    del x, y, z
torch.cuda.synchronize()
torch.cuda.memory._dump_snapshot(sys.argv[1])
print(f"  torch snapshot: peak reserved {torch.cuda.max_memory_reserved()} bytes")
PY
  "$carve" replay "$work/torch.pickle" --resource pool,arena --simulate-capacity 8 \
    --plot "$work/torch.svg" --no-progress | tee "$work/replay-torch.txt" | grep -E "replay on|peak"
  grep -q "failed allocations 0" "$work/replay-torch.txt"
  echo "ok: carve replay --format torch (auto-detected) on a PyTorch snapshot"
else
  echo "skipped: torch without CUDA, no real PyTorch snapshot"
fi
echo "memory_viz: all ok (files in $work)"
