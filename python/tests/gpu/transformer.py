"""A small transformer and training loop shared by the GPU tests and bench/python."""

import torch

# (batch, sequence length) per step: varying shapes make the allocator split and reuse.
SHAPES = [(8, 64), (8, 128), (4, 96), (16, 32), (8, 256), (8, 64), (4, 200), (8, 128)]
VOCAB, D_MODEL, HEADS, LAYERS = 1000, 256, 4, 2


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, D_MODEL)
        layer = torch.nn.TransformerEncoderLayer(
            D_MODEL, HEADS, dim_feedforward=4 * D_MODEL, batch_first=True, dropout=0.0
        )
        self.encoder = torch.nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.head = torch.nn.Linear(D_MODEL, VOCAB)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens)))


def make_model(seed=0, device="cuda"):
    torch.manual_seed(seed)
    return TinyLM().to(device)


def make_optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def batches(shapes, seed=1, device="cuda"):
    """Token batches of the given (batch, sequence) shapes, from a seeded generator."""
    gen = torch.Generator(device=device).manual_seed(seed)
    for batch, seq in shapes:
        yield torch.randint(0, VOCAB, (batch, seq), device=device, generator=gen)


def step(model, opt, tokens):
    """One training step (next-token loss); returns the loss tensor."""
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss


def train(model, shapes, seed=1, device="cuda"):
    """Trains one step per shape; returns the losses (floats)."""
    opt = make_optimizer(model)
    return [float(step(model, opt, t).item()) for t in batches(shapes, seed, device)]
