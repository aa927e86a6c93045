"""What the vocab-parallel head exchanges and costs on gloo ranks of this
machine, against one process holding the whole weight.

Per chunk it prints, for each loss family and top_k: the loss's
all-gathers and the bytes they send per row (each rank sends them once;
each rank receives (W - 1) times that), the all-reduce of the gradient of
hidden (H float32 values a row, once per call), rank 0's time inside the
exchanges and the all-reduce (waiting for the slowest rank included), and
the time of a training call (forward and backward, FUSED) on W ranks and
on one process (the median of --repeat calls). Domino runs with a
correction of rank --correction_rank (its weight [V, R] sharded as the
head's; the all-reduce then carries the correction inputs' gradient too,
H + R float32 values a row) and without top_k (it takes none).

    python3 examples/pytorch/distributed/vocab_parallel_benchmark.py \
        --world 2 --vocab 32768 --hidden 1024 --rows 1024

With --local_rows the vocab group is also the data-parallel group
(dflash_objective's rows="local"): each rank brings 1 / W of the --rows
and they are gathered; the table adds the bytes each rank sends in that
gather per row of its own, and the gradient exchange is one reduce-scatter
(an all-reduce of every rank's parts under torch 1.13, whose gloo has no
reduce_scatter) of H (+ R) float32 values a row; the per-chunk figures are
per chunk of all W ranks' rows, as the single process's.

Each rank and the single process run the head on --threads threads, so
the time ratio is against the ideal 1 / W of a vocabulary split W ways
(the machine needs W x --threads free cores for the ranks). The metric
top-k (head.metric_top_k, default 16: SpecForge's top-k recall and mass)
is most of the forward record; --metric_top_k 0 leaves it out.
"""

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dflash.torch import _vocab_parallel, dflash_objective
from dflash.torch.distributed import shard_rows

FAMILIES = {
    "dflash": "loss { dflash { gamma: 7 } }",
    "dspark": "loss { dspark { gamma: 7 confidence_weight: 0 } }",
    "jsd": "loss { distillation { divergence: JSD } }",
    "domino": "loss { domino { lambda_base: 0.3 } }",
}
TEACHER = {"dspark", "jsd"}
# Families that read a correction apart from the logits.
SPLIT = {"domino"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--rows", type=int, default=1024,
                   help="rows per call (B N K, K = 16)")
    p.add_argument("--chunk_blocks", type=int, default=16)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--threads", type=int, default=1,
                   help="head threads per rank")
    p.add_argument("--families", default="dflash,dspark,jsd")
    p.add_argument("--top_k", default="0,16")
    p.add_argument("--metric_top_k", type=int, default=16)
    p.add_argument("--correction_rank", type=int, default=16,
                   help="Domino's correction rank R")
    p.add_argument("--local_rows", action="store_true",
                   help='rows="local": each rank its own 1 / W of the rows')
    return p.parse_args(argv)


def batch(args):
    g = torch.Generator().manual_seed(0)
    k = 16
    blocks = max(1, args.rows // k)
    hidden = torch.randn(blocks, 1, k, args.hidden, generator=g)
    return {
        "hidden": hidden,
        "teacher": torch.randn(blocks, 1, k, args.hidden, generator=g),
        "weight": torch.randn(args.vocab, args.hidden, generator=g)
        / args.hidden**0.5,
        "target_ids": torch.randint(0, args.vocab, (blocks, 1, k),
                                    generator=g),
        "weight_mask": torch.ones(blocks, 1, k),
        "z": torch.randn(blocks, 1, k, args.correction_rank, generator=g),
        "m": torch.randn(args.vocab, args.correction_rank, generator=g)
        / args.correction_rank**0.5,
    }


def own_rows(x, rank, world):
    """Rank `rank`'s 1 / W of the batch's sequences (--local_rows)."""
    blocks = x["hidden"].shape[0]
    if blocks % world:
        raise SystemExit(f"--local_rows: {blocks} sequences of 16 rows do "
                         f"not split evenly over {world} ranks")
    each = blocks // world
    mine = dict(x)
    for name in ("hidden", "teacher", "target_ids", "weight_mask", "z"):
        mine[name] = x[name][rank * each:(rank + 1) * each]
    return mine


def timed_call(x, weight, m, family, top_k, args, group):
    if group is not None and args.local_rows:
        extra_rows = {"rows": "local"}
    else:
        extra_rows = {}
    hidden = x["hidden"].clone().requires_grad_()
    extra = {"teacher_hidden": x["teacher"]} if family in TEACHER else {}
    if family in SPLIT:
        extra["correction_inputs"] = x["z"].clone().requires_grad_()
        extra["correction_weight"] = m
    start = time.perf_counter()
    terms = dflash_objective(hidden, weight, x["target_ids"],
                             x["weight_mask"],
                             config=FAMILIES[family]
                             + f" head {{ metric_top_k: {args.metric_top_k} }}",
                             top_k=top_k, threads=args.threads,
                             chunk_blocks=args.chunk_blocks,
                             vocab_group=group, **extra, **extra_rows)
    terms.loss_num.backward()
    return time.perf_counter() - start, terms.diagnostics.stats["chunks"]


def cases(args):
    return [(f, int(k)) for f in args.families.split(",")
            for k in args.top_k.split(",") if f not in SPLIT or int(k) == 0]


def gradient_exchange(group):
    """What rows="local"'s gradient exchange runs on this gloo: a
    reduce-scatter, or an all-reduce where gloo has no reduce_scatter
    (torch 1.13), as _vocab_parallel.reduce_scatter_rows does."""
    out = torch.zeros(1)
    try:
        dist.reduce_scatter(out, [torch.zeros(1)] * dist.get_world_size(group),
                            op=dist.ReduceOp.SUM, group=group)
    except RuntimeError as error:
        if "does not support reduce_scatter" not in str(error):
            raise
        return "all-reduce (this gloo has no reduce_scatter)"
    return "reduce-scatter"


def rank_main(rank, world, args, directory):
    torch.set_num_threads(args.threads)
    dist.init_process_group(
        "gloo", init_method="file://" + os.path.join(directory, "r"),
        rank=rank, world_size=world)
    x = batch(args)
    if args.local_rows:
        x = own_rows(x, rank, world)
    group = dist.group.WORLD
    if args.local_rows:
        exchange = gradient_exchange(group)
        if rank == 0:
            torch.save(exchange, os.path.join(directory, "exchange.pt"))
    weight = shard_rows(x["weight"], group)
    m = shard_rows(x["m"], group)
    counts = {"calls": 0, "values": 0, "seconds": 0.0, "row_bytes": 0}
    original = _vocab_parallel._all_gather_into
    summing = _vocab_parallel.sum_over

    def counting(group, world):
        gather = original(group, world)

        def all_gather(local, out):
            start = time.perf_counter()
            gather(local, out)
            counts["seconds"] += time.perf_counter() - start
            counts["calls"] += 1
            counts["values"] += local.nbytes // 8
        return all_gather

    def timed_sum(group, tensors):
        start = time.perf_counter()
        summing(group, tensors)
        counts["seconds"] += time.perf_counter() - start

    gathering = _vocab_parallel.exchange_rows
    scattering = _vocab_parallel.reduce_scatter_rows

    def timed_gather(shard, send):
        start = time.perf_counter()
        out = gathering(shard, send)
        counts["seconds"] += time.perf_counter() - start
        if send.tensor is not None:
            counts["row_bytes"] += (send.tensor.numel()
                                    * send.padded.element_size())
        return out

    def timed_scatter(shard, parts):
        start = time.perf_counter()
        out = scattering(shard, parts)
        counts["seconds"] += time.perf_counter() - start
        return out

    _vocab_parallel._all_gather_into = counting
    _vocab_parallel.sum_over = timed_sum
    _vocab_parallel.exchange_rows = timed_gather
    _vocab_parallel.reduce_scatter_rows = timed_scatter
    own = x["target_ids"].numel()
    # The loss's exchanges run over every rank's rows.
    rows = own * (world if args.local_rows else 1)
    for family, top_k in cases(args):
        timed_call(x, weight, m, family, top_k, args, group)  # Warm-up.
        counts.update(calls=0, values=0, seconds=0.0, row_bytes=0)
        seconds = []
        for _ in range(args.repeat):
            elapsed, chunks = timed_call(x, weight, m, family, top_k, args,
                                         group)
            seconds.append(elapsed)
        calls = counts["calls"] / args.repeat
        values = counts["values"] / args.repeat
        if rank == 0:
            if args.local_rows:
                # Every rank's rows in chunks (equal shares).
                chunks *= world
            torch.save({"seconds": seconds, "chunks": chunks,
                        "row_bytes": counts["row_bytes"] / args.repeat / own,
                        "exchange": counts["seconds"] / args.repeat,
                        "rounds": calls, "values": values, "rows": rows},
                       os.path.join(directory, f"{family}_{top_k}.pt"))
    dist.destroy_process_group()


def main(argv=None):
    args = parse_args(argv)
    directory = tempfile.mkdtemp()
    mp.spawn(rank_main, args=(args.world, args, directory),
             nprocs=args.world)
    torch.set_num_threads(args.threads)
    x = batch(args)
    print(f"V {args.vocab}, H {args.hidden}, {x['target_ids'].numel()} rows "
          f"a call, chunks of {args.chunk_blocks * 16} rows; {args.world} "
          f"gloo ranks against one process, {args.threads} thread(s) "
          f"each; metric_top_k {args.metric_top_k}; medians of "
          f"{args.repeat}"
          + ("; rows='local' (each rank 1 / W of the rows)"
             if args.local_rows else ""))
    exchange = (torch.load(os.path.join(directory, "exchange.pt"))
                if args.local_rows else "all-reduce")
    print("| family | top_k | all-gathers / chunk | sent B / row "
          "(all-gathers) | "
          + exchange
          + " B / row (d hidden, Domino's d z) | "
          "exchange ms / chunk | ranks ms / chunk | one process ms / chunk | "
          "ratio (ideal "
          f"{1 / args.world:.2f}) |"
          + (" row gather B / own row |" if args.local_rows else ""))
    print("|---|---|---|---|---|---|---|---|---|"
          + ("---|" if args.local_rows else ""))
    for family, top_k in cases(args):
        whole = (x, x["weight"], x["m"], family, top_k, args, None)
        timed_call(*whole)
        single = [timed_call(*whole)[0] for _ in range(args.repeat)]
        r = torch.load(os.path.join(directory, f"{family}_{top_k}.pt"))
        chunks = r["chunks"]
        ranks_ms = 1e3 * statistics.median(r["seconds"]) / chunks
        one_ms = 1e3 * statistics.median(single) / chunks
        reduced = 4 * (args.hidden
                       + (args.correction_rank if family in SPLIT else 0))
        print(f"| {family} | {top_k} | {r['rounds'] / chunks:.1f} | "
              f"{8 * r['values'] / r['rows']:.0f} | {reduced} | "
              f"{1e3 * r['exchange'] / chunks:.1f} | {ranks_ms:.1f} | "
              f"{one_ms:.1f} | {ranks_ms / one_ms:.2f} |"
              + (f" {r['row_bytes']:.0f} |" if args.local_rows else ""))


if __name__ == "__main__":
    main()
