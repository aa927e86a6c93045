"""A tiny DFlash draft model trained on CPU with dflash_objective.

The "target model" is a seeded Markov chain over a vocabulary: each token is
followed by a fixed successor with probability 0.9. Its hidden state at a
position is a fixed random embedding of the token there. A DFlash draft sees
the target's state at an anchor and predicts the K tokens of the block that
starts there (position k predicts anchor + k; k = 0, the anchor itself,
carries no loss), through the target's frozen lm_head. The draft here is a
small MLP over the anchor state and a learned embedding of k.

Each step samples a batch of anchors, runs the draft, and trains it with
dflash_objective (the fused C++ head: no logits are materialised), printing
loss, accuracy, time per step and peak memory.

    python3 examples/pytorch/train_draft.py --steps 300
"""

import argparse
import resource
import time

import torch

from dflash.torch import FusedHead


class MarkovTarget:
    """The frozen target model: its token chain, hidden states and lm_head."""

    def __init__(self, vocab, hidden, seed):
        g = torch.Generator().manual_seed(seed)
        self.successor = torch.randperm(vocab, generator=g)
        self.embedding = torch.randn(vocab, hidden, generator=g)
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(torch.randn(vocab, hidden, generator=g)
                                      / hidden**0.5)
        self.vocab = vocab

    def sequences(self, batch, length, g):
        tokens = torch.empty(batch, length, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, self.vocab, (batch,), generator=g)
        for s in range(1, length):
            follow = torch.rand(batch, generator=g) < 0.9
            random = torch.randint(0, self.vocab, (batch,), generator=g)
            tokens[:, s] = torch.where(follow, self.successor[tokens[:, s - 1]],
                                       random)
        return tokens


class Draft(torch.nn.Module):
    def __init__(self, hidden, block, width):
        super().__init__()
        self.position = torch.nn.Embedding(block, hidden)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(2 * hidden, width), torch.nn.GELU(),
            torch.nn.Linear(width, width), torch.nn.GELU(),
            torch.nn.Linear(width, hidden))

    def forward(self, anchor_states):
        """[B, N, H] target states at the anchors -> [B, N, K, H]."""
        b, n, h = anchor_states.shape
        k = self.position.weight.shape[0]
        x = torch.cat([anchor_states.unsqueeze(2).expand(b, n, k, h),
                       self.position.weight.expand(b, n, k, h)], dim=-1)
        return self.mlp(x)


def make_batch(target, args, g):
    """Anchors, labels and weight mask as DFlash lays out a batch."""
    tokens = target.sequences(args.batch, args.seq_len, g)
    anchors = torch.stack([
        torch.randperm(args.seq_len - 1, generator=g)[:args.anchors]
        .sort().values for _ in range(args.batch)])
    k = torch.arange(args.block)
    label_index = anchors.unsqueeze(-1) + k
    in_range = label_index < args.seq_len
    target_ids = tokens.gather(1, label_index.clamp(max=args.seq_len - 1)
                               .flatten(1)).view_as(label_index)
    weight_mask = (in_range & (k > 0)).float()
    anchor_states = target.embedding[tokens.gather(1, anchors)]
    return anchor_states, target_ids, weight_mask


def peak_memory_mib(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def train(args, report=print):
    """Trains the draft; returns the loss of every step."""
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    target = MarkovTarget(args.vocab, args.hidden, args.seed)
    decay = {} if args.loss.startswith("dpace") else {"gamma": args.gamma}
    head = FusedHead(target.lm_head, loss_type=args.loss, mode=args.mode,
                     chunk_blocks=args.chunk_blocks, **decay).to(device)
    draft = Draft(args.hidden, args.block, args.width).to(device)
    optimizer = torch.optim.AdamW(draft.parameters(), lr=args.lr)
    g = torch.Generator().manual_seed(args.seed + 1)
    losses = []
    for step in range(1, args.steps + 1):
        anchor_states, target_ids, weight_mask = (
            t.to(device) for t in make_batch(target, args, g))
        start = time.perf_counter()
        hidden = draft(anchor_states)
        terms = head(hidden, target_ids, weight_mask)
        loss = terms.loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        losses.append(loss.item())
        if step % args.log_every == 0 or step == 1:
            accuracy = (terms.correct_num / terms.accuracy_den).item()
            report(f"step {step:4d}  loss {loss.item():.4f}  "
                   f"accuracy {accuracy:.3f}  {seconds * 1e3:7.1f} ms/step  "
                   f"peak {peak_memory_mib(device):.0f} MiB")
    return losses


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--anchors", type=int, default=32)
    parser.add_argument("--block", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--loss", default="dflash",
                        help="dflash_objective's loss_type")
    parser.add_argument("--gamma", type=float, default=7.0,
                        help="the loss's decay (D-PACE has none)")
    parser.add_argument("--mode", default="fused")
    parser.add_argument("--chunk_blocks", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--log_every", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


if __name__ == "__main__":
    train(parse_args())
