"""The Python side of the vocab-parallel head (dflash_objective's and
FusedHead's vocab_group=): the group checked, the ranks' agreement on one
call (one small all-gather), the exchange the C++ loss merges its row
records through (torch.distributed's list-form all_gather of float64 CPU
tensors, which Debian's torch 1.13 gloo has), and the sums over the group
(one SUM all-reduce per call of the gradient of hidden and of the
correction's inputs). docs/scaling.md has the design.
"""

from __future__ import annotations

import zlib
from typing import (Any, Callable, Dict, List, NamedTuple, Optional,
                    Sequence, Tuple)

import torch
import torch.distributed as dist

from dflash import _core


def shard_range(vocab: int, world: int, rank: int) -> Tuple[int, int]:
    """Rank `rank`'s rows [start, stop) of `vocab` split over `world` ranks
    in contiguous shards whose sizes differ by at most one, the first
    vocab % world ranks one larger."""
    base, extra = divmod(vocab, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def checked_group(group: object, name: str = "vocab_group"
                  ) -> Tuple[Any, int, int]:
    """`group` (a ProcessGroup this rank is in; torch.distributed
    initialised) with this rank's index in it and its size. Local checks:
    a rank that fails them takes part in no collective."""
    if not dist.is_available():
        raise RuntimeError(f"{name}: this build of torch has no "
                           "torch.distributed")
    if not isinstance(group, dist.ProcessGroup):
        outside: object = dist.GroupMember.NON_GROUP_MEMBER
        if group is outside or (type(group) is type(outside)
                                and group == outside):
            raise ValueError(
                f"{name}: this rank is not a member of the group "
                "(torch.distributed.new_group returned NON_GROUP_MEMBER "
                "here)")
        raise TypeError(f"{name}: must be a torch.distributed.ProcessGroup "
                        f"(dist.group.WORLD for every rank), got "
                        f"{type(group).__name__}")
    if not dist.is_initialized():
        raise ValueError(f"{name}: torch.distributed is not initialised")
    try:
        world = dist.get_world_size(group)
        rank = dist.get_rank(group)
    except RuntimeError as error:
        raise ValueError(f"{name}: not a usable process group ({error})"
                         ) from error
    if world < 1 or rank < 0:
        raise ValueError(f"{name}: this rank is not a member of the group")
    backend = str(dist.get_backend(group)).lower()
    if backend != "gloo":
        raise ValueError(
            f"{name}: the vocab-parallel head runs on CPU tensors over a "
            f"gloo group, got a {backend} group")
    return group, rank, world


class Shard(NamedTuple):
    """One call's vocab shard, as every rank of the group agreed on it."""

    group: Any
    rank: int
    world: int
    offset: int  # This rank's first row in the whole vocabulary.
    rows: int  # This rank's rows (lm_head_weight.shape[0]).
    vocab: int  # The whole vocabulary: the sum of the ranks' rows.
    core: _core.VocabShard


# The call's description every rank sends (float64, exact integers): a
# refusal flag, then the fields below. Rows may differ between ranks;
# everything else must not.
_FIELDS = ("refused", "rows", "B", "N", "K", "H", "dtype", "top_k",
           "return_rows", "gradients", "trainable", "bias", "teacher_hidden",
           "confidence_logits", "correction rank", "config", "target_ids",
           "weight_mask", "lm_head_weight's columns", "inputs' dtypes, "
           "shapes and requires_grad")
_DTYPES = {torch.float32: 1, torch.float64: 2}


def _crc(tensor: torch.Tensor, dtype: torch.dtype) -> int:
    data = tensor.detach().to(dtype).contiguous().cpu().numpy().tobytes()
    return zlib.crc32(data)


def signature(hidden: torch.Tensor, weight: torch.Tensor,
              target_ids: torch.Tensor, weight_mask: torch.Tensor,
              config_text: str, bias: Optional[torch.Tensor],
              teacher: Optional[torch.Tensor],
              confidence: Optional[torch.Tensor],
              correction_inputs: Optional[torch.Tensor], top_k: int,
              return_rows: bool, gradients: bool, trainable: bool,
              correction_weight: Optional[torch.Tensor] = None
              ) -> List[float]:
    """This rank's _FIELDS for one call (its arguments checked already)."""
    if hidden.dim() != 4:
        raise ValueError("hidden: must have 4 dimensions [B, N, K, H], got "
                         f"shape {tuple(hidden.shape)}")
    if weight.dim() != 2:
        raise ValueError("lm_head_weight: must have shape [V, H] (this "
                         f"rank's rows), got {tuple(weight.shape)}")
    b, n, k, h = hidden.shape
    rank = (0 if correction_inputs is None or correction_inputs.dim() != 4
            else correction_inputs.shape[3])
    values = [0, weight.shape[0], b, n, k, h,
              _DTYPES.get(hidden.dtype, 3), top_k, return_rows, gradients,
              trainable, bias is not None, teacher is not None,
              confidence is not None, rank,
              zlib.crc32(config_text.encode()),
              _crc(target_ids, torch.int64), _crc(weight_mask, torch.float64),
              weight.shape[1], _inputs_crc(
                  (hidden, weight, bias, teacher, confidence,
                   correction_inputs, correction_weight))]
    return [float(v) for v in values]


def _inputs_crc(tensors: Sequence[Optional[torch.Tensor]]) -> int:
    """What the ranks' inputs must share beyond the fields above: dtypes,
    shapes past the first dimension (a shard's rows differ) and which
    require a gradient (the backward's sums run where one does)."""
    described = [None if t is None else
                 (str(t.dtype), tuple(t.shape[1:]), t.requires_grad)
                 for t in tensors]
    return zlib.crc32(repr(described).encode())


def agree(group: Any, rank: int, world: int,
          mine: Optional[Sequence[float]]) -> Optional[Shard]:
    """Every rank's description of the call by one all-gather, then this
    rank's shard; a ValueError on every rank alike when the ranks differ
    (other shapes, configs, targets or masks, shards that are not the
    balanced split of their sum), or when some rank refused its arguments
    (`mine` None: this rank did, and raises its own error after this)."""
    local = torch.zeros(len(_FIELDS), dtype=torch.float64)
    if mine is None:
        local[0] = 1.0
    else:
        local[:] = torch.tensor(list(mine), dtype=torch.float64)
    gathered = [torch.zeros_like(local) for _ in range(world)]
    dist.all_gather(gathered, local, group=group)
    table = [[int(v) for v in t.tolist()] for t in gathered]
    refused = [r for r, row in enumerate(table) if row[0]]
    if refused:
        if mine is None:
            return None  # This rank's own error follows.
        raise ValueError(
            "vocab_group: rank(s) " + ", ".join(map(str, refused))
            + " of the group refused their arguments (their errors name "
            "them); every rank of the group raises")
    for index, name in enumerate(_FIELDS):
        if index in (0, 1):
            continue
        values = [row[index] for row in table]
        if any(v != values[0] for v in values):
            shown = "; ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            what = ("differ" if name in (
                "config", "target_ids", "weight_mask",
                "inputs' dtypes, shapes and requires_grad") else "differs")
            raise ValueError(
                f"vocab_group: the ranks' {name} {what} ({shown}); every "
                "rank of a vocab group runs the same rows, config and call "
                "on its own shard of the weight")
    rows = [row[1] for row in table]
    vocab = sum(rows)
    if vocab < world:
        raise ValueError(
            f"vocab_group: the whole vocabulary (V = {vocab}, the sum of the "
            f"ranks' lm_head_weight rows) is smaller than the group ({world} "
            "ranks); every rank must hold at least one class")
    want = [shard_range(vocab, world, r) for r in range(world)]
    if any(stop - start != got
           for (start, stop), got in zip(want, rows)):
        raise ValueError(
            "vocab_group: the ranks' lm_head_weight rows ("
            + ", ".join(f"rank {r}: {v}" for r, v in enumerate(rows))
            + f") are not the balanced split of their sum V = {vocab} ("
            + ", ".join(str(stop - start) for start, stop in want)
            + ": contiguous shards, sizes differing by at most one, the "
            "first V % W ranks one larger; "
            "dflash.torch.distributed.shard_rows cuts them)")
    offset = want[rank][0]
    core = _core.VocabShard(offset, vocab, rank, world,
                            _all_gather_into(group, world))
    return Shard(group, rank, world, offset, rows[rank], vocab, core)


def _all_gather_into(group: Any, world: int
                     ) -> Callable[[memoryview, memoryview], None]:
    """The exchange the C++ loss calls: out (size * n float64) gets every
    rank's local (n float64) in rank order, by torch.distributed's
    list-form all_gather into views of out (no copy on this side)."""

    def all_gather(local: memoryview, out: memoryview) -> None:
        n = local.nbytes // 8
        source = torch.frombuffer(local, dtype=torch.float64)
        target = torch.frombuffer(out, dtype=torch.float64)
        dist.all_gather([target[q * n:(q + 1) * n] for q in range(world)],
                        source, group=group)

    return all_gather


def sum_over(group: Any, tensors: Sequence[Optional[torch.Tensor]]) -> None:
    """Each tensor (contiguous) replaced in place by its SUM over the group,
    in one all-reduce per dtype (the tensors packed into one buffer when
    there are several). gloo's result is the same bits on every rank."""
    by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
    for t in tensors:
        if t is not None and t.numel() > 0:
            by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        if len(same) == 1:
            dist.all_reduce(same[0], op=dist.ReduceOp.SUM, group=group)
            continue
        packed = torch.cat([t.reshape(-1) for t in same])
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
        at = 0
        for t in same:
            t.copy_(packed[at:at + t.numel()].view(t.shape))
            at += t.numel()


def local_ids(ids: torch.Tensor, shard: Shard) -> torch.Tensor:
    """Global ids as this shard's rows (int32), -1 where another rank owns
    the id (or it is -1)."""
    mine = (ids >= shard.offset) & (ids < shard.offset + shard.rows)
    return torch.where(mine, ids - shard.offset,
                       torch.full_like(ids, -1)).int()
