"""The Python side of the vocab-parallel head (dflash_objective's and
FusedHead's vocab_group=): the group checked, the ranks' agreement on one
call (one small all-gather), the exchange the C++ loss merges its row
records through (torch.distributed's list-form all_gather of float64 CPU
tensors, which Debian's torch 1.13 gloo has), and the sums over the group
(one SUM all-reduce per call of the gradient of hidden and of the
correction's inputs). With rows="local" (the vocab group is also the
data-parallel group) each rank brings its own rows: they are gathered in
rank order, the head runs once over each rank's rows, and the gradient of
each rank's hidden (and correction inputs) comes back to it by one
reduce-scatter. docs/scaling.md has the design.
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
    if backend not in ("gloo", "nccl"):
        raise ValueError(
            f"{name}: the vocab-parallel head runs over a gloo group (CPU "
            f"tensors) or an NCCL group (CUDA tensors), got a {backend} "
            "group")
    return group, rank, world


def collective_device(group: Any) -> torch.device:
    """Where `group`'s collectives take their tensors: the current CUDA
    device for NCCL (each rank sets its own: torch.cuda.set_device), else
    the CPU (gloo)."""
    if str(dist.get_backend(group)).lower() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Shard(NamedTuple):
    """One call's vocab shard, as every rank of the group agreed on it."""

    group: Any
    rank: int
    world: int
    offset: int  # This rank's first row in the whole vocabulary.
    rows: int  # This rank's rows (lm_head_weight.shape[0]).
    vocab: int  # The whole vocabulary: the sum of the ranks' rows.
    core: _core.VocabShard
    # rows="local": every rank's batch size B_q in rank order (its own rows
    # gathered to every rank); () when every rank brings the same rows.
    batches: Tuple[int, ...] = ()

    @property
    def local(self) -> bool:
        return bool(self.batches)


# The call's description every rank sends (float64, exact integers): a
# refusal flag, then the fields below. Rows may differ between ranks, and
# with rows="local" B, target_ids and weight_mask too (each rank's own rows);
# everything else must not.
_FIELDS = ("refused", "rows", "rows option", "B", "N", "K", "H", "dtype", "top_k",
           "return_rows", "gradients", "trainable", "bias", "teacher_hidden",
           "confidence_logits", "correction rank", "config", "target_ids",
           "weight_mask", "lm_head_weight's columns", "inputs' devices, "
           "dtypes, shapes and requires_grad")
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
              correction_weight: Optional[torch.Tensor] = None,
              local_rows: bool = False) -> List[float]:
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
    values = [0, weight.shape[0], local_rows, b, n, k, h,
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
    """What the ranks' inputs must share beyond the fields above: the
    device type (a CPU and a CUDA rank make other gathers), dtypes, shapes
    past the first dimension (a shard's rows differ) and which require a
    gradient (the backward's sums run where one does)."""
    described = [None if t is None else
                 (t.device.type, str(t.dtype), tuple(t.shape[1:]),
                  t.requires_grad)
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
    local = local.to(collective_device(group))
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
    # The rows option is compared first: with rows="local" the ranks' own
    # rows (their B, targets and masks) differ.
    local_rows = bool(table[0][2])
    for index, name in enumerate(_FIELDS):
        if index in (0, 1) or (local_rows and name in (
                "B", "target_ids", "weight_mask")):
            continue
        values = [row[index] for row in table]
        if any(v != values[0] for v in values):
            shown = "; ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            what = ("differ" if name in (
                "config", "target_ids", "weight_mask",
                "inputs' devices, dtypes, shapes and requires_grad")
                    else "differs")
            raise ValueError(
                f"vocab_group: the ranks' {name} {what} ({shown}); every "
                "rank of a vocab group runs the same "
                + ("call (on its own rows: rows='local')" if local_rows
                   else "rows, config and call")
                + " on its own shard of the weight (rows='shared' or "
                "'local' alike on every rank)")
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
    batches = tuple(row[3] for row in table) if local_rows else ()
    return Shard(group, rank, world, offset, rows[rank], vocab, core,
                 batches)


def _all_gather_into(group: Any, world: int
                     ) -> Callable[[memoryview, memoryview], None]:
    """The exchange the C++ loss calls: out (size * n float64) gets every
    rank's local (n float64) in rank order, by torch.distributed's
    list-form all_gather: into views of out (no copy on this side) where
    the group's backend takes CPU tensors (gloo); through a buffer on the
    current CUDA device where it takes device tensors alone (NCCL, whose
    ranks each set theirs: torch.cuda.set_device)."""
    # Decided once per call, not per gather.
    device = collective_device(group)

    def all_gather(local: memoryview, out: memoryview) -> None:
        n = local.nbytes // 8
        source = torch.frombuffer(local, dtype=torch.float64)
        target = torch.frombuffer(out, dtype=torch.float64)
        if device.type == "cpu":
            dist.all_gather([target[q * n:(q + 1) * n] for q in range(world)],
                            source, group=group)
            return
        sent = source.to(device)
        parts = [torch.empty_like(sent) for _ in range(world)]
        dist.all_gather(parts, sent, group=group)
        target.copy_(torch.cat(parts).cpu())

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


class RowsToSend(NamedTuple):
    """One row tensor's all_gather, its buffers made (rows_to_send)."""
    tensor: Optional[torch.Tensor]
    padded: Optional[torch.Tensor]
    gathered: List[torch.Tensor]


def rows_to_send(shard: Shard, tensor: Optional[torch.Tensor],
                 wire: Optional[torch.dtype] = None) -> RowsToSend:
    """rows="local": the buffers of exchange_rows for `tensor` (its own rows
    along dimension 0, the other dimensions agreed): it in `wire` (default:
    its dtype, which the agreement compared) padded to the largest B
    (ranks' B may differ), and one such buffer per rank to gather into.
    Targets travel as int64 and masks as float64, whose dtypes the ranks
    need not share (exact for any allowed one)."""
    if tensor is None:
        return RowsToSend(None, None, [])
    sent = tensor.detach().to(wire or tensor.dtype)
    padded = sent.new_zeros((max(shard.batches),) + tuple(sent.shape[1:]))
    padded[:sent.shape[0]] = sent
    return RowsToSend(tensor, padded,
                      [torch.empty_like(padded) for _ in range(shard.world)])


def exchange_rows(shard: Shard, send: RowsToSend
                  ) -> List[Optional[torch.Tensor]]:
    """Every rank's rows of `send` in rank order, by one list-form
    all_gather; this rank's entry is its tensor itself. None for every rank
    where the tensor is None (agreed)."""
    if send.tensor is None or send.padded is None:
        return [None] * shard.world
    dist.all_gather(send.gathered, send.padded, group=shard.group)
    return [send.tensor if q == shard.rank else got[:b]
            for q, (got, b) in enumerate(zip(send.gathered, shard.batches))]


class PackedRows(NamedTuple):
    """reduce_scatter_rows' buffers, made before any collective."""

    mine: List[Optional[torch.Tensor]]
    padded: List[torch.Tensor]  # Each rank's parts packed, one length.
    out: Optional[torch.Tensor]


def pack_rows(shard: Shard, parts: Sequence[Sequence[Optional[torch.Tensor]]]
              ) -> PackedRows:
    """rows="local": parts[q] holds this rank's (its vocabulary's) part of
    the gradients of rank q's row tensors (hidden's, the correction
    inputs'; one dtype), packed and padded to one length for
    reduce_scatter_rows. Only allocates: a MemoryError here is refused
    where the others wait (the caller's status gather)."""
    mine = list(parts[shard.rank])
    if all(t is None for t in mine):
        return PackedRows(mine, [], None)
    # The same tensors are present in every rank's parts (agreed).
    packed = [torch.cat([t.reshape(-1) for t in parts[q] if t is not None])
              for q in range(shard.world)]
    length = max(p.numel() for p in packed)
    padded = [torch.nn.functional.pad(p, (0, length - p.numel()))
              for p in packed]
    return PackedRows(mine, padded, padded[0].new_empty(length))


def reduce_scatter_rows(shard: Shard, rows: PackedRows
                        ) -> List[Optional[torch.Tensor]]:
    """rows="local": this rank's own tensors of pack_rows' parts summed
    over the group. One reduce_scatter of the packed parts; where gloo has
    none (torch 1.13) one SUM all_reduce of them all, this rank's slice
    kept."""
    mine, padded, out = rows
    if out is None:
        return mine
    length = out.numel()
    present = [i for i, t in enumerate(mine) if t is not None]
    try:
        dist.reduce_scatter(out, padded, op=dist.ReduceOp.SUM,
                            group=shard.group)
    except RuntimeError as error:
        if "does not support reduce_scatter" not in str(error):
            raise
        whole = torch.cat(padded)
        dist.all_reduce(whole, op=dist.ReduceOp.SUM, group=shard.group)
        out = whole[shard.rank * length:(shard.rank + 1) * length]
    result: List[Optional[torch.Tensor]] = list(mine)
    at = 0
    for i in present:
        t = mine[i]
        assert t is not None
        result[i] = out[at:at + t.numel()].view(t.shape).clone()
        at += t.numel()
    return result


def gather_scales(shard: Shard, scale: float) -> List[float]:
    """rows="local", backward: every rank's factor on its own rows'
    gradients (d loss / d loss_num times the head's denominator), in rank
    order, by one list-form all_gather."""
    local = torch.tensor([scale], dtype=torch.float64)
    gathered = [torch.zeros_like(local) for _ in range(shard.world)]
    dist.all_gather(gathered, local, group=shard.group)
    return [float(t) for t in gathered]
