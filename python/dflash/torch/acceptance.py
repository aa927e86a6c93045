"""SpecForge main's accepted-length metrics from the head's per-row outputs.

SpecForge's newest main reports, besides its loss, how far a greedy draft
would get: per block, the leading run of supervised slots whose prediction
is the label (`_scatter_accepted_prefix`, placed at each block's index in
the sampled-anchor order), those runs walked along each sequence's anchors
as serving walks them (`compute_walk_accepted_length_terms`), and per slot
the reached / accepted / eligible counts of `hard_label_prefix_counts`
(specforge/algorithms/common/dflash_metrics.py). It takes the predictions
from full logits; here they come from `dflash_objective(...,
return_rows=True, top_k=k)`: `diagnostics.argmax` (-1 where a row has no
weight) and `diagnostics.target_is_candidate`.

The inputs are the predicted slots only. SpecForge's DFlash drops block
slot 0 (the anchor) and supervises `weight_mask > 0.5`; its Domino drops
slot 0 (the last slot with shift_label) and supervises its unweighted mask
`> 0`; DSpark keeps every slot and supervises its eval mask. A row the head
did not weigh has argmax -1, which matches no target: pass `supervised`
true only on rows the head weighed (all three families do).
"""

from typing import NamedTuple, Optional, Tuple

import torch


class PrefixCounts(NamedTuple):
    """SpecForge main's PrefixCounts: float32 counts over the batch's
    blocks, one column per predicted slot after a leading 0 (the anchor's).

    Fields:
        reached: [3, P + 1] slots supervised with every earlier slot of the
            block accepted; rows: the unary greedy prediction, the top-k
            oracle (the target among the candidates), the selector's greedy
            path (0 without one).
        accepted: [3, P + 1] slots accepted with every earlier one, rows as
            reached.
        selector_covered: [P + 1] the selector's reached slots whose target
            is a candidate.
        selector_unary_correct: [P + 1] the selector's reached slots the
            unary argmax hits.
        eligible: [P + 1] slots supervised with every earlier slot.
    """

    reached: torch.Tensor
    accepted: torch.Tensor
    selector_covered: torch.Tensor
    selector_unary_correct: torch.Tensor
    eligible: torch.Tensor


def _tensor(name: str, value: object, dims: int) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"{name}: must be a torch.Tensor, got {type(value).__name__}")
    if value.dim() != dims:
        raise ValueError(f"{name}: must have {dims} dimensions, got shape "
                         f"{tuple(value.shape)}")
    return value


def _ids(name: str, value: object, dims: int) -> torch.Tensor:
    tensor = _tensor(name, value, dims)
    if tensor.dtype == torch.bool or tensor.is_floating_point() or (
            tensor.is_complex()):
        raise TypeError(f"{name}: must be an integer tensor, got {tensor.dtype}")
    return tensor


def _mask(name: str, value: object, dims: int) -> torch.Tensor:
    tensor = _tensor(name, value, dims)
    if tensor.dtype != torch.bool:
        raise TypeError(f"{name}: must be a bool tensor, got {tensor.dtype} "
                        "(e.g. weight_mask > 0.5)")
    return tensor


def _same(reference: str, tensor: torch.Tensor,
          others: Tuple[Tuple[str, torch.Tensor], ...]) -> None:
    for name, other in others:
        if other.shape != tensor.shape:
            raise ValueError(f"{name}: shape {tuple(other.shape)} differs from "
                             f"{reference}'s {tuple(tensor.shape)}")
        if other.device != tensor.device:
            raise ValueError(f"{name}: on {other.device}, {reference} on "
                             f"{tensor.device}")


def _run_lengths(events: torch.Tensor) -> torch.Tensor:
    """[..., P] bool -> [...] int64: the length of each leading true run."""
    return events.long().cumprod(dim=-1).sum(dim=-1)


def accepted_prefix_lengths(
        predicted_ids: torch.Tensor, target_ids: torch.Tensor,
        supervised: torch.Tensor, *,
        block_index: Optional[torch.Tensor] = None,
        total_blocks: Optional[int] = None) -> torch.Tensor:
    """Each block's strict accepted prefix: the leading run of slots that
    are supervised and whose prediction is the target (a slot that is not
    supervised ends it), as SpecForge main's `_scatter_accepted_prefix`.

    predicted_ids, target_ids: [B, N, P] integer (dflash's argmax, -1 where
        the head did not weigh a row); supervised: [B, N, P] bool.
    block_index: [1 or B, N] integer, each block's index in the sampled-
        anchor order, with total_blocks (an int) the number of blocks there:
        the lengths are placed at those indices of a [B, total_blocks]
        result, zeros elsewhere, so the results of a batch's chunks sum to
        the whole batch's. On the CPU an index outside [0, total_blocks)
        raises ValueError; on CUDA it trips torch's device assert.

    Returns float32 [B, N] (without block_index) or [B, total_blocks], on
    the inputs' device. SpecForge's function returns a 0-dim zero when it
    is given no block_index (its "metrics off"); this returns the lengths.
    """
    predicted_ids = _ids("predicted_ids", predicted_ids, 3)
    target_ids = _ids("target_ids", target_ids, 3)
    supervised = _mask("supervised", supervised, 3)
    _same("predicted_ids", predicted_ids,
          (("target_ids", target_ids), ("supervised", supervised)))
    accepted = _run_lengths((predicted_ids == target_ids) & supervised).float()
    if block_index is None:
        if total_blocks is not None:
            raise ValueError("total_blocks: given without block_index")
        return accepted
    block_index = _ids("block_index", block_index, 2)
    if total_blocks is None:
        raise ValueError("total_blocks: required with block_index")
    if isinstance(total_blocks, bool) or not isinstance(total_blocks, int):
        raise TypeError("total_blocks: must be an int, got "
                        f"{type(total_blocks).__name__}")
    batch, blocks = accepted.shape
    if block_index.shape[1] != blocks or block_index.shape[0] not in (1, batch):
        raise ValueError(f"block_index: shape {tuple(block_index.shape)}, "
                         f"expected [1 or {batch}, {blocks}]")
    if block_index.device != accepted.device:
        raise ValueError(f"block_index: on {block_index.device}, predicted_ids "
                         f"on {accepted.device}")
    if block_index.device.type == "cpu" and block_index.numel() and not (
            0 <= int(block_index.min())
            and int(block_index.max()) < total_blocks):
        raise ValueError(
            f"block_index: values in [{int(block_index.min())}, "
            f"{int(block_index.max())}], expected [0, total_blocks = "
            f"{total_blocks})")
    return accepted.new_zeros(batch, total_blocks).scatter_(
        1, block_index.long().expand(batch, blocks), accepted)


def walk_accepted_length_terms(
        accepted: torch.Tensor, anchor_positions: torch.Tensor,
        valid: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """SpecForge main's `compute_walk_accepted_length_terms`: each sequence
    walked along its anchors in order, as serving walks a text; a valid
    anchor at or past where the walk resumes is visited, counts its
    accepted length + 1 (the anchor's own token) and moves the walk to
    position + accepted + 1; anchors inside an accepted run are skipped.

    accepted: [B, N] accepted prefix lengths (accepted_prefix_lengths);
    anchor_positions: [B, N] integer, each block's anchor in the text;
    valid: [B, N] bool, the blocks with a supervised slot (e.g.
        supervised.any(-1)); invalid anchors (SpecForge leaves dropped ones
        at position 0) are not visited.

    Returns (accepted_total, visited_count): 0-dim tensors in accepted's
    dtype on its device, the walk's mean accepted length their ratio.
    The walk is sequential along each sequence: it runs on the host (one
    copy of the [B, N] inputs, which waits for the device as SpecForge's
    .tolist() does), as one loop over the N anchor slots, vectorised over
    the sequences, in float64.
    """
    accepted = _tensor("accepted", accepted, 2)
    if accepted.dtype == torch.bool or accepted.is_complex():
        raise TypeError("accepted: must be a real tensor, got "
                        f"{accepted.dtype}")
    anchor_positions = _ids("anchor_positions", anchor_positions, 2)
    valid = _mask("valid", valid, 2)
    _same("accepted", accepted,
          (("anchor_positions", anchor_positions), ("valid", valid)))
    host = torch.device("cpu")
    counts = accepted.detach().to(host, torch.float64)
    positions = anchor_positions.detach().to(host, torch.float64)
    visit = valid.detach().to(host)
    batch, blocks = counts.shape
    resume_at = counts.new_zeros(batch)
    total = counts.new_zeros(batch)
    visits = counts.new_zeros(batch)
    for n in range(blocks):
        taken = (visit[:, n] & (positions[:, n] >= resume_at)).double()
        step = counts[:, n] + 1.0
        total += taken * step
        visits += taken
        resume_at = taken * (positions[:, n] + step) + (1.0 - taken) * resume_at
    result = torch.stack((total.sum(), visits.sum())).to(accepted.device,
                                                          accepted.dtype)
    return result[0], result[1]


def hard_label_prefix_counts(
        predicted_ids: torch.Tensor, target_ids: torch.Tensor,
        supervised: torch.Tensor, target_is_candidate: torch.Tensor,
        selector_ids: Optional[torch.Tensor] = None) -> PrefixCounts:
    """SpecForge main's `hard_label_prefix_counts` (dflash_metrics.py) of
    the unary argmax, the top-k oracle and a selector's greedy path.

    predicted_ids, target_ids: [B, N, P] integer; supervised: [B, N, P]
    bool; target_is_candidate: [B, N, P] bool (dflash's
    diagnostics.target_is_candidate, with top_k = SpecForge's metric top-k);
    selector_ids: [B, N, P] integer, a DFlash2 selector's greedy path, or
    None. SpecForge takes the hits (ids == target); this takes the ids.

    Returns PrefixCounts (float32, on the inputs' device).
    """
    predicted_ids = _ids("predicted_ids", predicted_ids, 3)
    target_ids = _ids("target_ids", target_ids, 3)
    supervised = _mask("supervised", supervised, 3)
    covered = _mask("target_is_candidate", target_is_candidate, 3)
    others = [("target_ids", target_ids), ("supervised", supervised),
              ("target_is_candidate", covered)]
    if selector_ids is not None:
        selector_ids = _ids("selector_ids", selector_ids, 3)
        others.append(("selector_ids", selector_ids))
    _same("predicted_ids", predicted_ids, tuple(others))
    slot = torch.arange(supervised.shape[-1], device=supervised.device)

    def events(hit: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        # A slot is accepted inside the block's accepted run, reached when
        # supervised at the run's end or inside it.
        run = _run_lengths(hit & supervised).unsqueeze(-1)
        return supervised & (slot <= run), slot < run

    def count(slots: torch.Tensor) -> torch.Tensor:
        sums = slots.float().sum(dim=(0, 1))
        return torch.cat((sums.new_zeros(1), sums))

    unary_hit = predicted_ids == target_ids
    unary_reached, unary_accepted = events(unary_hit)
    oracle_reached, oracle_accepted = events(covered)
    if selector_ids is None:
        selector_reached = selector_accepted = torch.zeros_like(supervised)
    else:
        selector_reached, selector_accepted = events(selector_ids == target_ids)
    eligible = slot < _run_lengths(supervised).unsqueeze(-1)
    return PrefixCounts(
        reached=torch.stack((count(unary_reached), count(oracle_reached),
                             count(selector_reached))),
        accepted=torch.stack((count(unary_accepted), count(oracle_accepted),
                              count(selector_accepted))),
        selector_covered=count(selector_reached & covered),
        selector_unary_correct=count(selector_reached & unary_hit),
        eligible=count(eligible))
