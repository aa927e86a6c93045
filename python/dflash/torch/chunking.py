"""chunked_reduce: SpecForge's checkpointed_chunk_reduce for any Python chunk
function, with the recompute boundary decoupled from the chunk."""

from __future__ import annotations

import inspect
import operator
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch
import torch.utils.checkpoint

# torch.utils.checkpoint takes context_fn (selective checkpointing) from
# torch 2.1; before, its keyword arguments went to the function.
_HAS_CONTEXT_FN = "context_fn" in inspect.signature(
    torch.utils.checkpoint.checkpoint).parameters

# A chunk function: slices (or None) in, a tuple of additive terms out.
ChunkFunction = Callable[..., Tuple[torch.Tensor, ...]]
# torch.utils.checkpoint's context_fn: a pair of context managers.
ContextFn = Callable[[], Tuple[Any, Any]]


def _count(name: str, value: Any, least: int) -> int:
    """`value` as an int (Python or NumPy integers, not bools or floats);
    its range is checked with SpecForge's messages after."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise ValueError(f"{name}: must be an int >= {least}, got {value!r}")


def _checked_dim(dim: int, tensor: torch.Tensor) -> int:
    normalized = dim if dim >= 0 else tensor.ndim + dim
    if normalized < 0 or normalized >= tensor.ndim:
        raise ValueError(f"dim {dim} is invalid for a {tensor.ndim}D tensor")
    return normalized


def _chunk_terms(function: ChunkFunction, args: Sequence[Optional[torch.Tensor]]
                 ) -> Tuple[torch.Tensor, ...]:
    terms = function(*args)
    if not isinstance(terms, tuple) or not all(
            isinstance(term, torch.Tensor) for term in terms):
        raise TypeError("chunk function must return a tuple of tensors")
    return terms


def _segment(function: ChunkFunction, starts: Sequence[int], width: int,
             dim: int, length: int, *tensors: Optional[torch.Tensor]
             ) -> Tuple[torch.Tensor, ...]:
    """The terms of the chunks at `starts`, flattened chunk after chunk: one
    checkpointed unit, recomputed whole in backward."""
    flat: list[torch.Tensor] = []
    count: Optional[int] = None
    for start in starts:
        args = tuple(
            None if t is None else t.narrow(
                dim if dim >= 0 else t.ndim + dim, start,
                min(width, length - start))
            for t in tensors)
        terms = _chunk_terms(function, args)
        if count is not None and len(terms) != count:
            raise ValueError(
                "chunk function returned a different number of terms")
        count = len(terms)
        flat.extend(terms)
    return tuple(flat)


def chunked_reduce(function: ChunkFunction, *tensors: Optional[torch.Tensor],
                   chunk_size: int, dim: int = 0, checkpoint: bool = True,
                   segment_chunks: int = 1,
                   context_fn: Optional[ContextFn] = None
                   ) -> Tuple[torch.Tensor, ...]:
    """Sums the additive terms `function` returns over aligned slices.

    SpecForge's checkpointed_chunk_reduce, with its argument checks, order
    and messages: `chunk_size` 0 runs the whole dimension once, never
    checkpointed; a positive size walks [start, start + chunk_size) slices
    (views) of every tensor along `dim` (negative counts from the end; ranks
    may differ), the last one the remainder; None arguments pass through in
    place; terms are summed in chunk order, unweighted.

    Checkpointing happens when `checkpoint`, chunk_size > 0, gradients are
    enabled and some tensor requires grad. Then `segment_chunks` consecutive
    chunks form one torch.utils.checkpoint unit (non-reentrant): backward
    recomputes a segment whole, so the recompute boundary is independent of
    the chunk (1 is SpecForge's chunk-by-chunk). `context_fn` goes to
    torch.utils.checkpoint for selective activation checkpointing (torch >=
    2.1; see selective_checkpoint_context_fn).
    """
    chunk_size = _count("chunk_size", chunk_size, 0)
    segment_chunks = _count("segment_chunks", segment_chunks, 1)
    if chunk_size < 0:
        raise ValueError(f"chunk_size must be >= 0, got {chunk_size}")
    if segment_chunks < 1:
        raise ValueError(f"segment_chunks must be >= 1, got {segment_chunks}")
    if isinstance(dim, bool):
        raise TypeError(f"dim: must be an int, got {dim!r}")
    try:
        dim = operator.index(dim)
    except TypeError:
        raise TypeError(f"dim: must be an int, got {dim!r}") from None
    for i, tensor in enumerate(tensors):
        if tensor is not None and not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensors[{i}]: must be a torch.Tensor or None, "
                            f"got {type(tensor).__name__}")
    present = [t for t in tensors if t is not None]
    if not present:
        raise ValueError("chunked reduction requires at least one tensor")
    first = present[0]
    length = first.shape[_checked_dim(dim, first)]
    if length == 0:
        raise ValueError("chunked reduction received an empty dimension")
    for tensor in present[1:]:
        got = tensor.shape[_checked_dim(dim, tensor)]
        if got != length:
            raise ValueError(
                "chunked reduction inputs must be aligned: "
                f"expected dimension length {length}, got {got}")
    if context_fn is not None and not _HAS_CONTEXT_FN:
        raise RuntimeError(
            "context_fn needs torch.utils.checkpoint's context_fn (torch >= "
            f"2.1); this torch is {torch.__version__}")

    width = chunk_size or length
    starts = list(range(0, length, width))
    checkpointed = (checkpoint and chunk_size > 0 and torch.is_grad_enabled()
                    and any(t.requires_grad for t in present))
    group = segment_chunks if checkpointed else 1
    # Only when given: torch before 2.1 passes keywords to the function.
    options: Dict[str, Any] = (
        {} if context_fn is None else {"context_fn": context_fn})
    totals: Optional[Tuple[torch.Tensor, ...]] = None
    for first_chunk in range(0, len(starts), group):
        segment = starts[first_chunk:first_chunk + group]
        if checkpointed:
            flat = torch.utils.checkpoint.checkpoint(
                _segment, function, segment, width, dim, length, *tensors,
                use_reentrant=False, **options)
        else:
            flat = _segment(function, segment, width, dim, length, *tensors)
        count = len(flat) // len(segment)
        for i in range(len(segment)):
            terms = flat[i * count:(i + 1) * count]
            if totals is None:
                totals = terms
                continue
            if len(totals) != len(terms):
                raise ValueError(
                    "chunk function returned a different number of terms")
            totals = tuple(left + right for left, right in zip(totals, terms))
    assert totals is not None  # length > 0: one chunk at least.
    return totals
