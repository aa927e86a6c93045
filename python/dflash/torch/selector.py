"""SpecForge main's DFlash2 selector terms from the head's top-k outputs.

A DFlash2 draft carries a candidate selector: a small trainable network that
re-ranks the strict unary top-k of the objective's logits. SpecForge main's
`_selector_chunk_terms` scores those candidates and returns five additive
terms (its `SelectorTerms`, flattened into `DFlashObjectiveTerms` as
selector_ce_num ... selector_covered_num); `forward` adds
`selector_loss_alpha * selector_ce_num` to the token objective's numerator.
Its metric pass (`_dflash2_selector_diagnostics`, `_dflash_greedy_diagnostics`
and the teacher terms) reduces the same quantities per block position.

Nothing here is V-wide: the head gives the top-k
(`dflash_objective(..., top_k=selector.top_k)`: `diagnostics.top_k` ids and
`diagnostics.top_k_values`, in hidden's dtype with a gradient) and the rows'
`diagnostics.loss_weight` (float64 whatever hidden's dtype: the sums below
are then float64; `.float()` it for main's float32 ones in a float32 run).
The selector network stays with the caller:

    terms = dflash_objective(hidden, weight, target_ids, weight_mask,
                             config=..., top_k=selector.top_k)
    d = terms.diagnostics
    values, states = d.top_k_values, hidden
    if selector_stop_gradient:
        values, states = values.detach(), states.detach()
    logits = selector.score_candidates(
        candidate_ids=d.top_k.clamp(min=0), unary_logits=values,
        hidden_states=states, predecessor_ids=predecessor_ids)
    sel = selector_terms(logits, d.top_k, target_ids, d.loss_weight,
                         weight_mask)
    loss_num = terms.loss_num + selector_loss_alpha * sel.ce_num

The head's top-k ids are -1 on rows without weight (clamp them before an
embedding lookup): those rows carry no selector weight, so every term is
main's, but a greedy path that walks through such a slot inside a block
picks differently from main's after it.
"""

from typing import Dict, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F


class SelectorTerms(NamedTuple):
    """SpecForge main's SelectorTerms: additive over chunks, 0-dim tensors.

    Fields:
        ce_num: sum of the selector's CE over the candidates, weighted by
            loss_weights where the target is a candidate; differentiable
            with respect to the selector's logits (and loss_weights).
        probability_num: sum of exp(-CE) times weight_mask where the target
            is a candidate; no gradient through the CE.
        correct_num: sum of loss_weights where the target is a candidate and
            the selector's argmax picks it; no gradient.
        weight_den: sum of loss_weights where the target is a candidate.
        covered_num: sum of weight_mask where the target is a candidate.
    """

    ce_num: torch.Tensor
    probability_num: torch.Tensor
    correct_num: torch.Tensor
    weight_den: torch.Tensor
    covered_num: torch.Tensor


class SelectorPositionTerms(NamedTuple):
    """Main's per-position selector metric terms ([K] each, sums over blocks):
    the DFlashMetricTerms fields selector_ce_num, selector_weight_den,
    selector_conditional_correct_num and selector_covered_den (the last is
    also its unary top-k recall numerator). No gradient."""

    ce_num: torch.Tensor
    weight_den: torch.Tensor
    conditional_correct_num: torch.Tensor
    covered_den: torch.Tensor


class SelectorGreedyTerms(NamedTuple):
    """Main's terms of the selector's greedy path (`greedy_path` over block
    slots 1..K-1): DFlashMetricTerms' selector_greedy_correct_num [K] (slot 0
    is 0), greedy_accepted_length_num (0-dim: over the blocks with a
    supervised slot, 1 + the leading run of supervised slots the path hits)
    and, given the target model's argmax, teacher_selector_greedy_agreement_num
    [K] (None without it)."""

    correct_num: torch.Tensor
    accepted_length_num: torch.Tensor
    teacher_agreement_num: Optional[torch.Tensor]


def _tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"{name}: must be a torch.Tensor, got {type(value).__name__}")
    return value


def _ids(name: str, value: object) -> torch.Tensor:
    tensor = _tensor(name, value)
    if tensor.dtype == torch.bool or tensor.is_floating_point() or (
            tensor.is_complex()):
        raise TypeError(
            f"{name}: must be an integer tensor, got {tensor.dtype}")
    return tensor


def _floats(name: str, value: object) -> torch.Tensor:
    tensor = _tensor(name, value)
    if not tensor.is_floating_point():
        raise TypeError(f"{name}: must be a floating-point tensor, got "
                        f"{tensor.dtype} (e.g. weight_mask.float())")
    return tensor


def _shape(name: str, tensor: torch.Tensor, shape: torch.Size,
           what: str) -> None:
    if tensor.shape != shape:
        raise ValueError(f"{name}: must have shape {tuple(shape)} ({what}), "
                         f"got {tuple(tensor.shape)}")


def _devices(tensors: Dict[str, torch.Tensor]) -> None:
    reference = next(iter(tensors.items()))
    for name, tensor in tensors.items():
        if tensor.device != reference[1].device:
            raise ValueError(f"{name}: is on {tensor.device}, "
                             f"{reference[0]} on {reference[1].device}; "
                             "all must be on one device")


def _checked(
    selector_logits: object, candidate_ids: object, target_ids: object,
    loss_weights: object, weight_mask: object,
    rows_dims: Optional[int] = None
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor]:
    logits = _floats("selector_logits", selector_logits)
    if logits.dim() < 2 or logits.shape[-1] < 1:
        raise ValueError("selector_logits: must be [..., k] with k >= 1 (one "
                         "score per candidate), got shape "
                         f"{tuple(logits.shape)}")
    candidates = _ids("candidate_ids", candidate_ids)
    _shape("candidate_ids", candidates, logits.shape, "selector_logits'")
    targets = _ids("target_ids", target_ids)
    rows = logits.shape[:-1]
    _shape("target_ids", targets, rows, "selector_logits' without k")
    if rows_dims is not None and len(rows) != rows_dims:
        raise ValueError(f"target_ids: must be [B, N, K] (per-position sums), "
                         f"got shape {tuple(rows)}")
    weights = _floats("loss_weights", loss_weights)
    _shape("loss_weights", weights, rows, "target_ids'")
    mask = _floats("weight_mask", weight_mask)
    _shape("weight_mask", mask, rows, "target_ids'")
    _devices({"selector_logits": logits, "candidate_ids": candidates,
              "target_ids": targets, "loss_weights": weights,
              "weight_mask": mask})
    return logits, candidates, targets, weights, mask


def _selector_rows(
    logits: torch.Tensor, candidates: torch.Tensor, targets: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows' CE over the candidates (in at least float32, as main's
    `.float()`; float64 kept), whether the target is a candidate (float32,
    as main's), and the selector's argmax pick."""
    matches = candidates == targets.unsqueeze(-1)
    covered = matches.any(dim=-1).to(torch.float32)
    index = matches.long().argmax(dim=-1)
    k = logits.shape[-1]
    dtype = torch.promote_types(logits.dtype, torch.float32)
    ce = F.cross_entropy(logits.to(dtype).reshape(-1, k), index.reshape(-1),
                         reduction="none").reshape(targets.shape)
    with torch.no_grad():
        picked = candidates.gather(
            -1, logits.argmax(dim=-1, keepdim=True)).squeeze(-1)
    return ce, covered, picked


def selector_terms(selector_logits: torch.Tensor,
                   candidate_ids: torch.Tensor, target_ids: torch.Tensor,
                   loss_weights: torch.Tensor,
                   weight_mask: torch.Tensor) -> SelectorTerms:
    """SpecForge main's `_selector_chunk_terms` from the selector's logits.

    selector_logits: [..., k] floating, the caller's selector scores of the
        candidates (`score_candidates`), with their gradient.
    candidate_ids: [..., k] integer, the candidates (the head's top-k ids;
        -1 on rows without weight matches no target).
    target_ids: [...] integer; a target among the candidates is the CE's
        class (its first position), else the row carries no selector weight.
    loss_weights: [...] floating, the objective's row weights (the head's
        `diagnostics.loss_weight`, or SpecForge's loss_weights: the weight
        mask times the decay, or D-PACE's weights).
    weight_mask: [...] floating, the rows' weight mask.

    Returns SelectorTerms in main's dtypes: the CE in selector_logits'
    dtype, at least float32 (main rounds float64 logits to float32 there;
    here float64 stays float64), the sums in its promotion with the weights.
    """
    logits, candidates, targets, weights, mask = _checked(
        selector_logits, candidate_ids, target_ids, loss_weights, weight_mask)
    ce, covered, picked = _selector_rows(logits, candidates, targets)
    selector_weights = weights * covered
    metric_mask = mask * covered
    with torch.no_grad():
        correct_num = ((picked == targets).to(torch.float32)
                       * selector_weights).sum()
    return SelectorTerms(
        ce_num=(ce * selector_weights).sum(),
        probability_num=(torch.exp(-ce).detach() * metric_mask).sum(),
        correct_num=correct_num,
        weight_den=selector_weights.sum(),
        covered_num=metric_mask.sum())


@torch.no_grad()
def selector_position_terms(
        selector_logits: torch.Tensor, candidate_ids: torch.Tensor,
        target_ids: torch.Tensor, loss_weights: torch.Tensor,
        weight_mask: torch.Tensor) -> SelectorPositionTerms:
    """Main's teacher-forced selector metrics per block position
    (`_dflash2_selector_diagnostics` reduced by `_reduce_dflash_metric_terms`).

    The arguments are selector_terms'; target_ids is [B, N, K] and
    loss_weights are main's metric loss weights (`_dflash_metric_loss_weights`:
    the objective's, from float32 probabilities in D-PACE). Sums over B and N.
    """
    logits, candidates, targets, weights, mask = _checked(
        selector_logits, candidate_ids, target_ids, loss_weights, weight_mask,
        rows_dims=3)
    ce, covered, picked = _selector_rows(logits, candidates, targets)
    selector_weights = weights * covered
    covered_mask = mask * covered
    return SelectorPositionTerms(
        ce_num=(ce * selector_weights).sum(dim=(0, 1)),
        weight_den=selector_weights.sum(dim=(0, 1)),
        conditional_correct_num=((picked == targets).to(torch.float32)
                                 * covered_mask).sum(dim=(0, 1)),
        covered_den=covered_mask.sum(dim=(0, 1)))


@torch.no_grad()
def selector_greedy_terms(
        greedy_ids: torch.Tensor, target_ids: torch.Tensor,
        weight_mask: torch.Tensor,
        teacher_ids: Optional[torch.Tensor] = None) -> SelectorGreedyTerms:
    """Main's terms of the selector's greedy path (`_dflash_greedy_diagnostics`
    and `_dflash_teacher_terms`' selector part).

    greedy_ids: [B, N, K - 1] integer, the caller's `greedy_path` over block
        slots 1..K-1 (slot 0 is the anchor).
    target_ids: [B, N, K] integer; weight_mask: [B, N, K] floating.
    teacher_ids: [B, N, K] integer, the target model's argmax per row, or
        None: the head's `diagnostics.teacher_argmax` from the same
        `dflash_objective(..., teacher_hidden=..., return_rows=True)` call
        (-1 where unweighted), no second projection.
    """
    greedy = _ids("greedy_ids", greedy_ids)
    targets = _ids("target_ids", target_ids)
    mask = _floats("weight_mask", weight_mask)
    if targets.dim() != 3 or targets.shape[-1] < 2:
        raise ValueError("target_ids: must be [B, N, K] with K >= 2, got "
                         f"shape {tuple(targets.shape)}")
    b, n, k = targets.shape
    _shape("greedy_ids", greedy, torch.Size((b, n, k - 1)),
           "target_ids' without slot 0")
    _shape("weight_mask", mask, targets.shape, "target_ids'")
    tensors = {"greedy_ids": greedy, "target_ids": targets,
               "weight_mask": mask}
    if teacher_ids is not None:
        teacher = _ids("teacher_ids", teacher_ids)
        _shape("teacher_ids", teacher, targets.shape, "target_ids'")
        tensors["teacher_ids"] = teacher
    _devices(tensors)
    slots = mask[:, :, 1:]
    hit = greedy == targets[:, :, 1:]
    zero = slots.new_zeros(1)

    def per_position(events: torch.Tensor) -> torch.Tensor:
        return torch.cat((zero, (events.to(torch.float32) * slots).sum(
            dim=(0, 1))))

    supervised = slots > 0.5
    block_valid = supervised.any(dim=-1).to(torch.float32)
    run = (hit & supervised).to(torch.float32).cumprod(dim=-1).sum(dim=-1)
    return SelectorGreedyTerms(
        correct_num=per_position(hit),
        accepted_length_num=((1.0 + run) * block_valid).sum(),
        teacher_agreement_num=(None if teacher_ids is None else per_position(
            greedy == teacher[:, :, 1:])))
