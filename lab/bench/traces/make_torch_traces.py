#!/usr/bin/env python3
"""Record PyTorch allocation traces for `carve replay`, on a GPU machine.

Trains a small GPT-like transformer (or, for `cnn_*`, a residual conv net) for a few steps with
varying batch and sequence (image) shapes, a side stream that prefetches the next batch and
keeps an EMA of the weights, under
`torch.cuda.memory._record_memory_history`. The snapshot's trace is converted to RMM's CSV
(`Thread,Time,Action,Pointer,Size,Stream`), which `carve replay` reads. Beside each CSV, a JSON
file records what PyTorch's own caching allocator reserved (`max_memory_reserved`) and the
logical peak (`max_memory_allocated`), so the ratios can be compared with carve's.

    python3 bench/traces/make_torch_traces.py --out traces/          # every config, both allocators
    python3 bench/traces/make_torch_traces.py --convert snap.pickle --out traces/  # any snapshot

Each config runs in a fresh process (PYTORCH_CUDA_ALLOC_CONF must be set before CUDA starts):
once with the native caching allocator (the trace is taken from this run) and once with
`expandable_segments:True` (only its reserved peak is kept).
"""

import argparse
import json
import os
import pickle
import subprocess
import sys

# name -> (layers, d_model, heads, ff, vocab, batch sizes, sequence lengths, steps)
CONFIGS = {
    "gpt_small": (6, 768, 12, 3072, 32000, [4, 8, 12, 16], [128, 256, 512, 1024], 24),
    "gpt_medium": (12, 1024, 16, 4096, 50304, [2, 4, 6, 8], [256, 512, 768, 1024, 2048], 24),
    "gpt_varlen": (8, 1024, 16, 4096, 32000, [1, 3, 5, 7, 9], [96, 200, 333, 700, 1500], 30),
    # Gradient accumulation over micro-batches of varying size, with activation checkpointing.
    "gpt_accum": (8, 1024, 16, 4096, 32000, [2, 5, 3, 8], [256, 512, 1024], 12),
}

# Convolutional nets: name -> (widths per stage, batch sizes, image sizes, steps).
CNN_CONFIGS = {
    "cnn_varres": ([64, 128, 256, 512], [16, 32, 24, 48], [96, 160, 224, 128], 24),
}


def convert(trace, out_csv):
    """Writes a snapshot's device trace as RMM CSV. Returns (allocations, frees, logical peak)."""
    live = {}
    in_use = peak = 0
    allocs = frees = 0
    with open(out_csv, "w") as f:
        f.write("Thread,Time,Action,Pointer,Size,Stream\n")
        for i, e in enumerate(trace):
            action = e.get("action")
            addr, size = e.get("addr", 0), e.get("size", 0)
            stream = e.get("stream", 0) or 0
            t = e.get("time_us")
            if t is None:
                t = i
            t = int(t)
            stamp = "%02d:%02d:%02d.%06d" % (
                (t // 3_600_000_000) % 24,
                (t // 60_000_000) % 60,
                (t // 1_000_000) % 60,
                t % 1_000_000,
            )
            if action == "alloc":
                if addr in live:  # a trace that missed a free: close it first
                    f.write("1,%s,free,%#x,%d,%#x\n" % (stamp, addr, live[addr][0], live[addr][1]))
                    in_use -= live[addr][0]
                    frees += 1
                live[addr] = (size, stream)
                in_use += size
                peak = max(peak, in_use)
                allocs += 1
                f.write("1,%s,allocate,%#x,%d,%#x\n" % (stamp, addr, size, stream))
            elif action in ("free_requested", "free_completed"):
                # The client's free is `free_requested`; blocks allocated before recording
                # started are unknown to the log and skipped.
                if addr in live:
                    size, s = live.pop(addr)
                    in_use -= size
                    frees += 1
                    f.write("1,%s,free,%#x,%d,%#x\n" % (stamp, addr, size, s))
    return allocs, frees, peak


def gpt(name):
    """The transformer of config `name`, and its step: (model, batches, shapes, steps, step)."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    layers, d, heads, ff, vocab, batches, seqs, steps = CONFIGS[name]
    accumulate = name == "gpt_accum"

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc1, self.fc2 = nn.Linear(d, ff), nn.Linear(ff, d)

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, heads, d // heads).unbind(2)
            y = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
            )
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.pos = nn.Embedding(vocab, d), nn.Embedding(max(seqs), d)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

        def forward(self, idx):
            t = idx.shape[1]
            x = self.emb(idx) + self.pos(torch.arange(t, device=idx.device))
            for blk in self.blocks:
                x = checkpoint(blk, x, use_reentrant=False) if accumulate else blk(x)
            return self.head(self.ln(x))

    def host_batch(rng, step):
        b = batches[step % len(batches)]
        t = seqs[(step * 7 + 3) % len(seqs)]
        return torch.randint(0, vocab, (b, t + 1), generator=rng).pin_memory()

    def train_step(model, batch):
        # Micro-batches of one sequence each under accumulation, else the whole batch at once.
        parts = batch.split(1) if accumulate else [batch]
        for part in parts:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(part[:, :-1])
                loss = F.cross_entropy(logits.float().view(-1, vocab), part[:, 1:].reshape(-1))
            (loss / len(parts)).backward()
            del logits, loss

    return GPT(), host_batch, steps, train_step


def cnn(name):
    """The residual conv net of config `name`, as `gpt` returns a transformer."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    widths, batches, sizes, steps = CNN_CONFIGS[name]
    classes = 1000

    class Res(nn.Module):
        def __init__(self, c_in, c_out, stride):
            super().__init__()
            self.c1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
            self.c2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
            self.b1, self.b2 = nn.BatchNorm2d(c_out), nn.BatchNorm2d(c_out)
            self.skip = None if stride == 1 and c_in == c_out else nn.Conv2d(c_in, c_out, 1, stride)

        def forward(self, x):
            y = self.b2(self.c2(F.relu(self.b1(self.c1(x)))))
            return F.relu(y + (x if self.skip is None else self.skip(x)))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Conv2d(3, widths[0], 7, 2, 3)
            layers, c = [], widths[0]
            for i, w in enumerate(widths):
                layers += [Res(c, w, 1 if i == 0 else 2), Res(w, w, 1)]
                c = w
            self.layers = nn.Sequential(*layers)
            self.fc = nn.Linear(c, classes)

        def forward(self, x):
            x = self.layers(F.max_pool2d(F.relu(self.stem(x)), 3, 2, 1))
            return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))

    def host_batch(rng, step):
        b = batches[step % len(batches)]
        s = sizes[(step * 5 + 1) % len(sizes)]
        return torch.randn((b, 3, s, s), generator=rng).pin_memory()

    def train_step(model, batch):
        target = torch.arange(batch.shape[0], device=batch.device) % classes
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(batch).float(), target)
        loss.backward()
        del loss

    return Net(), host_batch, steps, train_step


def record(name, out_dir, alloc_conf, keep_trace):
    import torch

    dev = torch.device("cuda")
    torch.manual_seed(0)
    net, host_batch, steps, train_step = (cnn if name in CNN_CONFIGS else gpt)(name)

    if keep_trace:
        try:
            torch.cuda.memory._record_memory_history(
                enabled="all", context=None, stacks="python", max_entries=5_000_000
            )
        except TypeError:
            torch.cuda.memory._record_memory_history(max_entries=5_000_000)

    model = net.to(dev)
    ema = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    side = torch.cuda.Stream()
    rng = torch.Generator().manual_seed(1)

    with torch.cuda.stream(side):
        nxt = host_batch(rng, 0).to(dev, non_blocking=True)
    for step in range(steps):
        torch.cuda.current_stream().wait_stream(side)
        batch = nxt
        batch.record_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # prefetch the next batch on the side stream
            nxt = host_batch(rng, step + 1).to(dev, non_blocking=True)
        train_step(model, batch)
        opt.step()
        opt.zero_grad(set_to_none=True)
        del batch
        if step % 3 == 2:  # EMA of the weights on the side stream
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for e, p in zip(ema, model.parameters()):
                    e.mul_(0.99).add_(p.detach() * 0.01)
    torch.cuda.synchronize()

    stats = {
        "config": name,
        "alloc_conf": alloc_conf,
        "max_memory_allocated": torch.cuda.max_memory_allocated(),
        "max_memory_reserved": torch.cuda.max_memory_reserved(),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
    }
    stats["ratio"] = stats["max_memory_reserved"] / max(1, stats["max_memory_allocated"])
    if keep_trace:
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        trace = snap["device_traces"][torch.cuda.current_device()]
        allocs, frees, peak = convert(trace, os.path.join(out_dir, "torch_%s.csv" % name))
        stats.update(trace_allocations=allocs, trace_frees=frees, trace_logical_peak=peak)
    print(json.dumps(stats))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default="traces")
    ap.add_argument("--configs", default=",".join(list(CONFIGS) + list(CNN_CONFIGS)))
    ap.add_argument("--convert", help="convert a pickled torch.cuda.memory._snapshot() instead")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--keep-trace", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    if args.convert:
        with open(args.convert, "rb") as f:
            snap = pickle.load(f)
        for dev, trace in enumerate(snap["device_traces"]):
            if trace:
                base = os.path.splitext(os.path.basename(args.convert))[0]
                out = os.path.join(args.out, "%s_dev%d.csv" % (base, dev))
                print(out, convert(trace, out))
        return
    if args.child:
        record(args.child, args.out, os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), args.keep_trace)
        return

    for name in args.configs.split(","):
        results = {}
        for label, conf in (("native", ""), ("expandable", "expandable_segments:True")):
            env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=conf)
            cmd = [sys.executable, __file__, "--out", args.out, "--child", name]
            if label == "native":
                cmd.append("--keep-trace")
            out = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if out.returncode != 0:
                sys.stderr.write(out.stdout + out.stderr)
                sys.exit("%s (%s) failed with exit status %d" % (name, label, out.returncode))
            results[label] = json.loads(out.stdout.strip().splitlines()[-1])
        with open(os.path.join(args.out, "torch_%s.json" % name), "w") as f:
            json.dump(results, f, indent=1)
        n, e = results["native"], results["expandable"]
        print(
            "%s: %d allocations, logical peak %.2f GiB; PyTorch reserved %.2f GiB (%.2fx), "
            "expandable segments %.2f GiB (%.2fx)"
            % (
                name,
                n.get("trace_allocations", 0),
                n["max_memory_allocated"] / 2**30,
                n["max_memory_reserved"] / 2**30,
                n["ratio"],
                e["max_memory_reserved"] / 2**30,
                e["ratio"],
            )
        )


if __name__ == "__main__":
    main()
