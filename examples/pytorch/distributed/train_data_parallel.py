"""Data-parallel training of a small DFlash draft with dflash's fused head,
DDP and GlobalNormalizer, on CPU ranks over gloo.

Each rank holds a data shard of its own (micro-batches of different sizes
on different ranks), runs --accumulation micro-batches per optimizer step
(DDP's no_sync() on all but the last) and backpropagates
GlobalNormalizer.loss(terms); GlobalNormalizer.step() then sums the
window's denominators and metrics over the ranks in one all-reduce and
scales the gradients, so the step follows the gradient of all ranks' data
together, as SpecForge's trainer normalises it (--mode dflash, the
default; dspark and domino are its other conventions).

    python3 examples/pytorch/distributed/train_data_parallel.py --world 2
    torchrun --nproc-per-node 2 examples/pytorch/distributed/train_data_parallel.py

With --world 1 --shards 2 one process trains on both shards' data at once:
in dflash mode the same steps as two ranks, up to rounding.

With --vocab_ranks R the ranks form groups of R that split the lm_head's
vocabulary (FusedHead(..., vocab_group=), each rank holding its rows:
dflash.torch.distributed.shard_linear) and share a data replica; the
world / R replicas are data-parallel (DDP and GlobalNormalizer over the
ranks holding the same shard). --world 2 --vocab_ranks 2 --shards 2 takes
the same steps as --world 1 --shards 2 (tested), and --world 4
--vocab_ranks 2 (2 x 2 data x vocab) those of --world 2, up to float32
rounding.
"""

import argparse
import contextlib
import json
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from dflash.torch import FusedHead
from dflash.torch.distributed import GlobalNormalizer, shard_linear


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2, help="ranks to spawn")
    p.add_argument("--shards", type=int, default=0,
                   help="data shards (default: one per rank)")
    p.add_argument("--vocab_ranks", type=int, default=1,
                   help="ranks per vocab-parallel group (divides --world)")
    p.add_argument("--mode", default="dflash",
                   choices=("dflash", "dspark", "domino"))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--accumulation", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--block", type=int, default=8)
    p.add_argument("--anchors", type=int, default=4)
    p.add_argument("--out", default="", help="write rank 0's report (JSON)")
    return p.parse_args(argv)


def micro_batch(shard, step, micro, args, embedding, successor):
    """Shard `shard`'s micro-batch: 1 + shard sequences of a Markov chain
    (each token's successor with probability 0.9), the target's states at
    the anchors, labels and weight mask as DFlash lays them out."""
    g = torch.Generator().manual_seed(7919 * shard + 131 * step + micro)
    b, n, k = 1 + shard, args.anchors, args.block
    length = n * k + 1
    tokens = torch.empty(b, length, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, args.vocab, (b,), generator=g)
    for s in range(1, length):
        follow = torch.rand(b, generator=g) < 0.9
        tokens[:, s] = torch.where(
            follow, successor[tokens[:, s - 1]],
            torch.randint(0, args.vocab, (b,), generator=g))
    anchors = torch.arange(n) * k
    labels = anchors.view(n, 1) + torch.arange(k)
    weight_mask = (torch.arange(k) > 0).float().expand(b, n, k).clone()
    return embedding[tokens[:, anchors]], tokens[:, labels], weight_mask


def run(rank, world, args, rendezvous):
    torch.set_num_threads(1)
    if rendezvous:
        dist.init_process_group("gloo", init_method=rendezvous, rank=rank,
                                world_size=world)
    else:  # torchrun
        dist.init_process_group("gloo")
    g = torch.Generator().manual_seed(0)  # The same target and draft on
    successor = torch.randperm(args.vocab, generator=g)  # every rank.
    embedding = torch.randn(args.vocab, args.hidden, generator=g)
    lm_head = torch.nn.Linear(args.hidden, args.vocab, bias=False)
    lm_head.weight.data = torch.randn(args.vocab, args.hidden,
                                      generator=g) / args.hidden**0.5
    # Ranks [d R, (d + 1) R) share data replica d and split the vocabulary;
    # the ranks holding the same rows are data-parallel. Every rank makes
    # every group, in the same order.
    vocab_ranks = args.vocab_ranks
    replicas = world // vocab_ranks
    replica, part = divmod(rank, vocab_ranks)
    vocab_group = data_group = None
    if vocab_ranks > 1:
        vocab_groups = [dist.new_group(list(range(d * vocab_ranks,
                                                  (d + 1) * vocab_ranks)))
                        for d in range(replicas)]
        data_groups = [dist.new_group(list(range(v, world, vocab_ranks)))
                       for v in range(vocab_ranks)]
        vocab_group, data_group = vocab_groups[replica], data_groups[part]
        lm_head = shard_linear(lm_head, vocab_group)  # This rank's rows.
    head = FusedHead(lm_head, loss_type="dflash", gamma=7, threads=1,
                     vocab_group=vocab_group)
    torch.manual_seed(1)
    draft = torch.nn.Sequential(
        torch.nn.Linear(args.hidden, 64), torch.nn.GELU(),
        torch.nn.Linear(64, args.block * args.hidden))
    model = DistributedDataParallel(draft, process_group=data_group)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    norm = GlobalNormalizer(data_group, mode=args.mode)
    shards = range(replica, args.shards or replicas, replicas)
    report = {"loss": [], "accuracy": []}
    for step in range(args.steps):
        for micro in range(args.accumulation):
            parts = [micro_batch(s, step, micro, args, embedding, successor)
                     for s in shards]
            states, target_ids, weight_mask = (torch.cat(t)
                                               for t in zip(*parts))
            b, n = target_ids.shape[:2]
            last = micro == args.accumulation - 1
            with model.no_sync() if not last else contextlib.nullcontext():
                hidden = model(states).view(b, n, args.block, args.hidden)
                terms = head(hidden.contiguous(), target_ids, weight_mask)
                norm.loss(terms).backward()
        # After DDP's average: sum over the window and the ranks, scale.
        result = norm.step(model.parameters())
        optimizer.step()
        optimizer.zero_grad()
        report["loss"].append(result.loss)
        report["accuracy"].append(float(result.metrics["accuracy"]))
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step + 1:3d}  loss {result.loss:.4f}  accuracy "
                  f"{report['accuracy'][-1]:.3f}  rows "
                  f"{int(result.sums['accuracy'][1])} over {world} ranks"
                  + (f" ({vocab_ranks} vocab shards)" if vocab_ranks > 1
                     else ""),
                  flush=True)
    report["parameters"] = [p.detach().flatten().tolist()
                            for p in draft.parameters()]
    if args.out:
        with open(f"{args.out}.rank{rank}", "w") as f:
            json.dump(report, f)
    dist.destroy_process_group()


def main(argv=None):
    args = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", args.world))
    if args.vocab_ranks < 1 or world % args.vocab_ranks:
        raise SystemExit(f"--vocab_ranks {args.vocab_ranks} must divide the "
                         f"world size {world}")
    if "RANK" in os.environ:  # Started by torchrun.
        run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args,
            None)
        return
    rendezvous = "file://" + os.path.join(tempfile.mkdtemp(), "rendezvous")
    mp.spawn(run, args=(args.world, args, rendezvous), nprocs=args.world)


if __name__ == "__main__":
    main()
