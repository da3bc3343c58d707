#!/usr/bin/env python3
"""A synthetic allocation trace with the character of a PyTorch transformer training run, in
RMM's CSV, for tests until real traces (make_torch_traces.py) exist. Deterministic.

Per step, with a batch and sequence length that vary from step to step: the forward pass keeps
most activations for the backward pass and frees temporaries at once; the backward pass frees
activations in reverse order while it allocates parameter gradients; the optimizer allocates its
state on the first step and temporaries on every step; gradients are freed at the end of the
step (`zero_grad(set_to_none=True)`). A side stream prefetches the next batch and updates an EMA
of the weights with small temporaries. Sizes are rounded to 512 bytes, as PyTorch's caching
allocator rounds them.

    python3 bench/traces/make_synthetic_trace.py > tests/data/synthetic_transformer.csv
"""

import argparse
import random
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--ff", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    d, ff, vocab, layers = args.d, args.ff, args.vocab, args.layers
    main_s, side_s = 0, 0x5A1D0
    out = sys.stdout
    out.write("Thread,Time,Action,Pointer,Size,Stream\n")
    state = {"t": 0, "next": 0x7F0000000000}
    live = {}

    def stamp():
        state["t"] += 3
        t = state["t"]
        return "%02d:%02d:%02d.%06d" % (t // 3_600_000_000, (t // 60_000_000) % 60, (t // 1_000_000) % 60, t % 1_000_000)

    def alloc(nbytes, stream=main_s):
        size = max(512, (nbytes + 511) // 512 * 512)
        addr = state["next"]
        state["next"] += size + 4096  # distinct addresses; the replay ignores them
        live[addr] = (size, stream)
        out.write("1,%s,allocate,%#x,%d,%#x\n" % (stamp(), addr, size, stream))
        return addr

    def free(addr):
        size, stream = live.pop(addr)
        out.write("1,%s,free,%#x,%d,%#x\n" % (stamp(), addr, size, stream))

    # Parameters: per layer qkv, proj, fc1, fc2 weights and biases, two layer norms (fp32).
    shapes = [vocab * d, 2048 * d]
    for _ in range(layers):
        shapes += [3 * d * d, 3 * d, d * d, d, ff * d, ff, d * ff, d, d, d, d, d]
    shapes += [d, d, vocab * d]
    params = [alloc(4 * n) for n in shapes]
    ema = [alloc(4 * n, side_s) for n in shapes]
    adam = None
    batches, seqs = [4, 8, 12, 16], [128, 256, 384, 512, 1024]
    nxt = alloc(8 * 4 * 129, side_s)
    for step in range(args.steps):
        b, t = batches[step % len(batches)], seqs[(step * 7 + 3) % len(seqs)]
        batch = nxt
        nxt = alloc(8 * batches[(step + 1) % len(batches)] * (seqs[((step + 1) * 7 + 3) % len(seqs)] + 1), side_s)
        bt = b * t
        saved = [alloc(2 * bt * d)]  # embeddings (bf16)
        for _ in range(layers):
            ln = alloc(2 * bt * d)
            qkv = alloc(2 * bt * 3 * d)
            att = alloc(2 * bt * d)
            lse = alloc(4 * b * 8 * t)  # attention statistics
            proj = alloc(2 * bt * d)
            res = alloc(2 * bt * d)
            ln2 = alloc(2 * bt * d)
            fc1 = alloc(2 * bt * ff)
            gelu = alloc(2 * bt * ff)
            fc2 = alloc(2 * bt * d)
            free(proj)
            out_ = alloc(2 * bt * d)
            free(fc2)
            casts = [alloc(2 * n) for n in (3 * d * d, d * d, ff * d, d * ff)]  # bf16 weight copies
            saved += [ln, qkv, att, lse, res, ln2, fc1, gelu, out_] + casts
            for _ in range(rng.randint(1, 4)):  # small scalars and indices
                free(alloc(rng.choice([4, 8, 64, 512, 2048])))
        logits = alloc(2 * bt * vocab)
        logits32 = alloc(4 * bt * vocab)
        loss = alloc(4)
        free(logits)
        # Backward: gradient of the logits, then layers in reverse.
        glog = alloc(4 * bt * vocab)
        free(logits32)
        grads = [None] * len(shapes)
        grads[-1] = alloc(4 * shapes[-1])
        g = alloc(2 * bt * d)
        free(glog)
        for layer in reversed(range(layers)):
            base = 2 + 12 * layer
            for j in reversed(range(12)):
                tmp = alloc(2 * bt * (ff if j in (4, 6) else d))
                if grads[base + j] is None:
                    grads[base + j] = alloc(4 * shapes[base + j])
                free(tmp)
            for _ in range(13):
                free(saved.pop())
            ng = alloc(2 * bt * d)
            free(g)
            g = ng
        free(saved.pop())
        grads[0], grads[1] = alloc(4 * shapes[0]), alloc(4 * shapes[1])
        grads[-2], grads[-3] = alloc(4 * d), alloc(4 * d)
        free(g)
        free(loss)
        free(batch)
        if adam is None:
            adam = [alloc(4 * n) for n in shapes for _ in range(2)]
        for n in shapes:  # foreach optimizer temporaries, in groups
            free(alloc(4 * n))
        for x in grads:
            free(x)
        if step % 3 == 2:
            for n in shapes:
                free(alloc(4 * n, side_s))
    for a in list(live):
        free(a)


if __name__ == "__main__":
    main()
