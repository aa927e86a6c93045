"""Helpers of the distributed tests: ranks on gloo under
torch.multiprocessing.spawn with a join that times out, and a small draft
model whose micro-batches every rank and the single-process reference
compute alike.

A rank's function runs as fn(rank, world, *args) after
init_process_group("gloo") (a file rendezvous in a fresh directory, so tests
never share a port); what it returns comes back to the caller, one entry per
rank. A rank that raises fails the run with its traceback; ranks still
running after `timeout` seconds are killed and the run fails as a hang.
"""

import os
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dflash.torch import dflash_objective

# The toy draft's sizes: hidden states [B, N, K, H] from inputs [B, N, K, I];
# the frozen lm_head [V, H]; Domino's correction rank R.
N, K, I, H, V, R = 2, 4, 6, 8, 37, 3

# One config per mode's SpecForge family. DSpark without its confidence
# term: the confidence logits are float32, and the checks here are float64
# at 1e-12.
CONFIGS = {
    "dflash": "loss { dflash { gamma: 7 } }",
    "dspark": "loss { dspark { gamma: 3 confidence_weight: 0 } }",
    "domino": ("loss { domino { lambda_base: 0.3 pure_draft_prefix_len: 1 "
               "gamma: 4 } } head { correction_rank: %d }" % R),
}


def _rank_main(rank: int, world: int, directory: str, fn: Callable[..., Any],
               args: Sequence[Any]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method="file://" + os.path.join(directory, "rendezvous"),
        rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(directory, f"rank{rank}.pt"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world: int, *args: Any,
              timeout: float = 60.0) -> List[Any]:
    """fn(rank, world, *args) on `world` gloo ranks; their results in rank
    order. A hang (ranks alive after `timeout` s) is an AssertionError."""
    directory = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
    context = mp.spawn(_rank_main, args=(world, directory, fn, args),
                       nprocs=world, join=False)
    deadline = time.monotonic() + timeout
    while not context.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            for process in context.processes:
                process.join()
            raise AssertionError(
                f"{world} ranks still running after {timeout:.0f} s: a hang")
    return [torch.load(os.path.join(directory, f"rank{rank}.pt"))
            for rank in range(world)]


def parameters(mode: str) -> Dict[str, torch.Tensor]:
    """The draft's trainable parameters (float64, the same on every rank):
    a projection to the hidden states and, for Domino, the correction's
    input projection and its [V, R] weight."""
    g = torch.Generator().manual_seed(1234)
    params = {"proj_w": torch.randn(H, I, dtype=torch.float64, generator=g),
              "proj_b": torch.randn(H, dtype=torch.float64, generator=g)}
    if mode == "domino":
        params["corr_w"] = torch.randn(R, I, dtype=torch.float64,
                                       generator=g)
        params["corr_m"] = torch.randn(V, R, dtype=torch.float64,
                                       generator=g) / 2
    return {name: p.requires_grad_() for name, p in params.items()}


def lm_head() -> torch.Tensor:
    g = torch.Generator().manual_seed(99)
    return torch.randn(V, H, dtype=torch.float64, generator=g) / 2


def micro_batch(rank: int, micro: int, blocks: int,
                masked: bool = False) -> Dict[str, torch.Tensor]:
    """Rank `rank`'s micro-batch `micro`: `blocks` sequences of N blocks,
    about a fifth of the rows masked (all of them with `masked`)."""
    g = torch.Generator().manual_seed(1000 * rank + micro)
    mask = (torch.rand(blocks, N, K, generator=g) > 0.2).double()
    mask[..., 0] = 0
    if masked:
        mask.zero_()
    return {
        "x": torch.randn(blocks, N, K, I, dtype=torch.float64, generator=g),
        "teacher": torch.randn(blocks, N, K, H, dtype=torch.float64,
                               generator=g),
        "target_ids": torch.randint(0, V, (blocks, N, K), generator=g),
        "weight_mask": mask,
    }


def concatenated(batches: Sequence[Dict[str, torch.Tensor]]
                 ) -> Dict[str, torch.Tensor]:
    """Micro-batches as one batch (their sequences one after another)."""
    return {name: torch.cat([b[name] for b in batches])
            for name in batches[0]}


def objective(mode: str, params: Dict[str, torch.Tensor],
              weight: torch.Tensor, batch: Dict[str, torch.Tensor],
              chunk_blocks: Optional[int] = None) -> Any:
    """The mode's family of dflash_objective on one batch through the
    draft: hidden = x W^T + b (and Domino's z = tanh(x C^T), M)."""
    x = batch["x"]
    hidden = x @ params["proj_w"].t() + params["proj_b"]
    extra: Dict[str, Any] = {}
    if mode == "dspark":
        extra["teacher_hidden"] = batch["teacher"]
    if mode == "domino":
        extra["correction_inputs"] = torch.tanh(x @ params["corr_w"].t())
        extra["correction_weight"] = params["corr_m"]
    if chunk_blocks is not None:
        extra["chunk_blocks"] = chunk_blocks
    return dflash_objective(hidden, weight, batch["target_ids"],
                            batch["weight_mask"], config=CONFIGS[mode],
                            threads=1, **extra)


def synchronise(params: Dict[str, torch.Tensor], grad_sync: str) -> None:
    """The gradients combined over the default group as DDP does ("mean")
    or summed ("sum")."""
    world = dist.get_world_size()
    for p in params.values():
        assert p.grad is not None
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        if grad_sync == "mean":
            p.grad.div_(world)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| over max |want| (the absolute error where want is
    all zeros)."""
    got = torch.as_tensor(got, dtype=torch.float64)
    want = torch.as_tensor(want, dtype=torch.float64)
    scale = float(want.abs().max()) if want.numel() else 0.0
    error = float((got - want).abs().max()) if want.numel() else 0.0
    return error / scale if scale > 0 else error
