#!/usr/bin/env python3
"""Makes goldens from SpecForge's newest main by running its own objective.

SpecForge main's `OnlineDFlashModel` has what specforge 0.2.0 lacks: the
sequence-balanced D-PACE denominator (PR #848, `_sequence_anchor_scale`) and
the LK compositions after the chunk reduction. This generator loads the
objective's definitions from a copy of SpecForge's
`specforge/algorithms/common/dflash_family_model.py` that the user gives
(the whole file, or a saved excerpt holding the definitions below), runs
them in float64 on seeded small batches, and writes what they compute. It
holds none of SpecForge's code.

    python3 tools/specforge_main_goldens.py \\
        --specforge-file /path/to/dflash_family_model.py \\
        --specforge-metrics-file /path/to/dflash_metrics.py \\
        --out tests/goldens/specforge_main

Main's module imports packages specforge 0.2.0 does not have
(`specforge.algorithms.common.dflash_metrics`, the flex-attention backend,
Triton), so it is not imported: the named definitions are taken from the
file's syntax tree (ast) and executed alone, with torch, torch.nn and
torch.nn.functional, as the module imports them. Of the model only the
objective's methods run, as `forward` calls them on its full batch (one
chunk: the terms are additive), then `forward`'s composition:
`_compose_token_objective`, and the loss is the numerator over the
denominator floored at the dtype's tiny. The draft has no candidate
selector. Where no target is ignored (SpecForge's diagnostics gather each
row's target probability, which fails on -100), the metric chunk terms'
`loss_weight_num` too: `_dflash_metric_loss_weights` over
`_dflash_unary_diagnostics`' probabilities (softmax in float32, as
SpecForge takes them), summed per block position. Needs torch >= 1.13 and
numpy.

Each case directory gets:

  config.textproto   the dflash ObjectiveConfig that computes the same loss
  target_ids.npy     int64 [B, N, K]; -100 where the target is ignored
  weight_mask.npy    float64 [B, N, K]
  hidden.npy         float64 [B * N * K, H]  the draft's output states
  weight.npy         float64 [V, H]  the frozen lm_head weight
  terms.npy          float64, in TERMS order
  grad_hidden.npy    float64 [B * N * K, H]  d(loss)/d(hidden)
  loss_weight.npy    float64 [K], without ignored targets: loss_weight_num

With --specforge-metrics-file (main's
specforge/algorithms/common/dflash_metrics.py) the acceptance_* cases too:
plain DFlash objective cases (the files above, five anchors a sequence,
targets mostly the head's argmax) that also hold main's walk/prefix
accepted-length metrics, as its forward computes them with block slot 0
dropped and supervised = weight_mask > 0.5: `_scatter_accepted_prefix`
chunk by chunk (ACCEPTANCE_CHUNK blocks) into sampled-anchor order and
summed, `compute_walk_accepted_length_terms` (both module-level in
dflash_family_model.py) and `hard_label_prefix_counts`, the oracle's
candidates `_dflash_unary_diagnostics`' top ACCEPTANCE_TOP_K:

  anchor_positions.npy              int64 [B, N], sorted; dropped ones at 0
  selector_ids.npy                  int64 [B, N, K - 1], a selector's path
  block_accepted.npy                float64 [B, N] (SpecForge's float32)
  walk.npy                          float64 [2]: accepted total, visits
  selector_block_accepted.npy, selector_walk.npy   the same, selector_ids'
  prefix_reached.npy, prefix_accepted.npy          float64 [3, K]
  selector_prefix_covered.npy, selector_prefix_unary_correct.npy,
  prefix_eligible.npy                              float64 [K]

and the selector_* cases: main's objective with a DFlash2 candidate selector
(SelectorStandIn below, top SELECTOR_TOP_K, an identity
transform_unary_logits) and its metric chunk terms with the target model's
states, all with main's `.float()` upcasts kept in float64 (float64_casts).
Besides the objective files above (terms.npy and grad_hidden.npy without
the selector, for the C++ goldens tests; loss_weight.npy float64-exact):

  teacher_hidden.npy          float64 [B * N * K, H], aligned to the rows
  selector_embed.npy, selector_proj.npy   the stand-in selector's tables
  selector_settings.npy       [selector_loss_alpha, selector_stop_gradient,
                              top_k]
  selector_candidate_ids.npy, selector_unary_logits.npy, selector_logits.npy,
  selector_loss_weights.npy   what _selector_chunk_terms scored and weighed
  selector_terms.npy          float64, in SELECTOR_TERMS order
  selector_grad_logits.npy    d(selector_ce_num)/d(selector logits)
  selector_loss.npy           [1] (token numerator + alpha * selector_ce_num)
                              over loss_den, as forward
  selector_grad_hidden.npy    its d/d(hidden)
  selector_greedy_ids.npy     int64 [B, N, K - 1], the metric pass's
                              greedy_path
  metric_<field>.npy          each DFlashMetricTerms field of
                              _dflash_metric_chunk_terms (float64)
"""

import argparse
import ast
import contextlib
import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

# The definitions taken from SpecForge's file.
MODULE_NAMES = ("_VALID_LOSS_TYPES", "_DPACE_LOSS_TYPES", "SelectorTerms",
                "DFlashObjectiveTerms", "_DFlashUnaryDiagnostics")
METHODS = ("_dpace_weight", "_sequence_anchor_scale",
           "_dflash_objective_chunk_terms", "_lk_kl_weight",
           "_compose_token_objective", "_dflash_unary_diagnostics",
           "_dflash_metric_loss_weights")

TERMS = ("ce_loss_num", "tv_loss_num", "loss_den", "target_probability_num",
         "correct_num", "accuracy_den", "loss_num", "loss")

B, N, K, H, V = 3, 3, 4, 6, 11
IGNORED = ((0, 0, 2), (0, 2, 3), (1, 0, 1), (2, 1, 1))
COUNT = "cross_entropy { ignored_target_weight: COUNT }"

# name: (SpecForge's loss_type, lk_loss_type, dpace_alpha, kl_scale,
# kl_decay, ignored targets, seed, dflash's loss config).
CASES = {
    "dpace_balanced": (
        "dpace", None, 0.3, 1.0, 1.0, False, 1,
        "dpace { alpha: 0.3 denominator: SEQUENCE_BALANCED }"),
    "dpace_cumulative_balanced_lk_tv": (
        "dpace-cumulative-confidence-only", "tv", 0.6, 1.0, 1.0, False, 2,
        "dpace { alpha: 0.6 variant: CUMULATIVE_CONFIDENCE_ONLY lk { type: TV "
        "} denominator: SEQUENCE_BALANCED }"),
    "dpace_continuation_balanced_lk_lambda": (
        "dpace-continuation-value-only", "lambda", 0.4, 0.8, 2.0, False, 3,
        "dpace { alpha: 0.4 variant: CONTINUATION_VALUE_ONLY lk { type: "
        "LAMBDA kl_scale: 0.8 kl_decay: 2 } denominator: SEQUENCE_BALANCED }"),
    "dpace_balanced_ignored": (
        "dpace", None, 0.5, 1.0, 1.0, True, 4,
        "dpace { alpha: 0.5 denominator: SEQUENCE_BALANCED } " + COUNT),
    "dpace_continuation_balanced_ignored_lk_alpha": (
        "dpace-continuation-value-only", "alpha", 0.2, 1.0, 1.0, True, 5,
        "dpace { alpha: 0.2 variant: CONTINUATION_VALUE_ONLY lk { type: ALPHA "
        "} denominator: SEQUENCE_BALANCED } " + COUNT),
    "dflash_ignored": (
        "dflash", None, 0.5, 1.0, 1.0, True, 6, "dflash {} " + COUNT),
    "dflash_ignored_lk_lambda": (
        "dflash", "lambda", 0.5, 1.2, 0.5, True, 7,
        "dflash { lk { type: LAMBDA kl_scale: 1.2 kl_decay: 0.5 } } " + COUNT),
    "dflash_ignored_lk_tv": (
        "dflash", "tv", 0.5, 1.0, 1.0, True, 8,
        "dflash { lk { type: TV } } " + COUNT),
}


def parse(path):
    """The syntax tree of the file at `path`; parsed once, every definition
    taken from the file comes from it."""
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read(), filename=path)


def load_objective(tree, path, module_names=MODULE_NAMES,
                   method_names=METHODS, globals_=None):
    """SpecForge's objective definitions from `tree` (parse(path)), executed
    alone: a class OnlineDFlashModel(nn.Module) holding `method_names`, and
    `module_names`; `globals_` adds names they read (main's metric
    functions)."""
    found, methods = {}, {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "OnlineDFlashModel":
            for item in node.body:
                if (isinstance(item, ast.FunctionDef)
                        and item.name in method_names):
                    methods[item.name] = item
        elif (isinstance(node, (ast.ClassDef, ast.FunctionDef))
              and node.name in module_names):
            found[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name) and target.id in module_names:
                    found[target.id] = node
    missing = [n for n in module_names if n not in found] + [
        m for m in method_names if m not in methods]
    if missing:
        raise SystemExit(f"{path}: no definition of {', '.join(missing)}; "
                         "give SpecForge main's dflash_family_model.py")
    model = ast.ClassDef(
        name="OnlineDFlashModel",
        bases=[ast.Attribute(value=ast.Name(id="nn", ctx=ast.Load()),
                             attr="Module", ctx=ast.Load())],
        keywords=[], body=[methods[m] for m in method_names],
        decorator_list=[])
    module = ast.Module(body=[found[n] for n in module_names] + [model],
                        type_ignores=[])
    ast.fix_missing_locations(module)
    from typing import Dict, NamedTuple, Optional, Tuple
    namespace = {"torch": torch, "nn": nn, "F": F, "Dict": Dict,
                 "NamedTuple": NamedTuple, "Optional": Optional,
                 "Tuple": Tuple, "__name__": "specforge_main_objective",
                 **(globals_ or {})}
    exec(compile(module, path, "exec"), namespace)  # noqa: S102
    return namespace["OnlineDFlashModel"]


def batch(seed, ignored):
    """Three sequences of three blocks: the first with three weighted
    blocks (one fractional weight), the second with one, the third with
    none; slot 0 (the anchor) unweighted."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, N, K, H, generator=g, dtype=torch.float64)
    weight = 0.9 * torch.randn(V, H, generator=g, dtype=torch.float64)
    target_ids = torch.randint(0, V, (B, N, K), generator=g)
    weight_mask = torch.ones(B, N, K, dtype=torch.float64)
    weight_mask[..., 0] = 0
    weight_mask[0, 1, 2] = 0.5
    weight_mask[1, 1:] = 0
    weight_mask[2] = 0
    weight_mask[1, 0, 3] = 0
    if ignored:
        for b, n, k in IGNORED:
            target_ids[b, n, k] = -100
    return hidden, weight, target_ids, weight_mask


# The walk/prefix accepted-length metrics: module-level definitions of
# main's dflash_family_model.py and of its dflash_metrics.py.
WALK_NAMES = ("_scatter_accepted_prefix", "compute_walk_accepted_length_terms")
PREFIX_NAMES = ("PrefixCounts", "_prefix_events", "hard_label_prefix_counts")
ACCEPTANCE_TOP_K = 3  # _dflash_unary_diagnostics' top_k: the oracle's set.
ACCEPTANCE_CHUNK = 2  # Blocks a chunk, scattered as main's metric chunks are.
PLAIN = ("dflash", None, 0.5, 1.0, 1.0, False)
# name: (seed, anchor positions [B][N], kept blocks [B][N]). Sorted anchors,
# a dropped one at position 0 as _sample_anchor_positions leaves it; walks
# that overlap the next anchors; a sequence with one anchor or none.
ACCEPTANCE_CASES = {
    "acceptance_walk_overlap": (
        21, ((0, 2, 3, 7, 9), (1, 4, 6, 0, 0), (5, 0, 0, 0, 0)),
        ((1, 1, 1, 1, 1), (1, 1, 1, 0, 0), (1, 0, 0, 0, 0))),
    "acceptance_walk_sparse": (
        22, ((0, 1, 2, 10, 14), (3, 8, 0, 0, 0), (0, 0, 0, 0, 0)),
        ((1, 1, 1, 1, 1), (1, 1, 0, 0, 0), (0, 0, 0, 0, 0))),
    "acceptance_all_valid": (
        23, ((0, 3, 6, 9, 12), (2, 3, 4, 5, 6), (0, 5, 10, 15, 20)),
        ((1, 1, 1, 1, 1), (1, 1, 1, 1, 1), (1, 1, 1, 1, 1))),
}


def load_definitions(tree, path, names):
    """The module-level definitions `names` of `tree` (parse(path)),
    executed alone."""
    found = {node.name: node for node in tree.body
             if isinstance(node, (ast.ClassDef, ast.FunctionDef))
             and node.name in names}
    missing = [n for n in names if n not in found]
    if missing:
        raise SystemExit(f"{path}: no definition of {', '.join(missing)}")
    module = ast.Module(body=[found[n] for n in names], type_ignores=[])
    ast.fix_missing_locations(module)
    from typing import NamedTuple, Optional, Tuple
    namespace = {"torch": torch, "F": F, "NamedTuple": NamedTuple,
                 "Optional": Optional, "Tuple": Tuple,
                 "__name__": "specforge_main_metrics"}
    exec(compile(module, path, "exec"), namespace)  # noqa: S102
    return {n: namespace[n] for n in names}


def acceptance_batch(seed, kept):
    """Targets that are mostly the head's argmax (long accepted prefixes)
    with misses, holes and weights of 0.5 (weighted, not supervised) in
    the kept blocks; the dropped blocks unweighted; slot 0 unweighted. A
    selector's greedy ids, mostly the target."""
    g = torch.Generator().manual_seed(seed)
    kept = torch.tensor(kept, dtype=torch.bool)
    b, n = kept.shape
    hidden = torch.randn(b, n, K, H, generator=g, dtype=torch.float64)
    weight = 0.9 * torch.randn(V, H, generator=g, dtype=torch.float64)
    logits = hidden @ weight.T
    top = logits.topk(ACCEPTANCE_TOP_K + 1, dim=-1).values
    gap = (top[..., :-1] - top[..., 1:]).min()
    if gap < 1e-4:  # A near tie would make the head's argmax a coin toss.
        raise SystemExit(f"seed {seed}: logits {gap:.2g} apart; change it")
    predicted = logits.argmax(dim=-1)
    miss = torch.rand(b, n, K, generator=g) < 0.3
    other = (predicted + torch.randint(1, V, (b, n, K), generator=g)) % V
    target_ids = torch.where(miss, other, predicted)
    weight_mask = kept.unsqueeze(-1).expand(b, n, K).double().clone()
    weight_mask[..., 0] = 0
    u = torch.rand(b, n, K, generator=g)
    weight_mask[u < 0.1] = 0
    weight_mask[(u >= 0.1) & (u < 0.18)] *= 0.5
    slots = target_ids[..., 1:]
    selector_ids = torch.where(
        torch.rand(b, n, K - 1, generator=g) < 0.75, slots,
        (slots + torch.randint(1, V, slots.shape, generator=g)) % V)
    return (hidden, weight, target_ids, weight_mask), selector_ids


def run_acceptance(model_class, walk, case):
    """The objective's goldens on an acceptance batch, and main's walk and
    prefix metrics as forward computes them (block slot 0 dropped,
    supervised = weight_mask > 0.5, the accepted prefixes scattered chunk by
    chunk into sampled-anchor order and summed)."""
    seed, positions, kept = case
    tensors, selector_ids = acceptance_batch(seed, kept)
    hidden, weight, target_ids, weight_mask = tensors
    arrays = run(model_class, PLAIN + (seed, "dflash {}"), tensors)
    model = new_model(model_class, PLAIN, weight)
    anchor_positions = torch.tensor(positions)
    n = anchor_positions.shape[1]
    with torch.no_grad():
        unary = model._dflash_unary_diagnostics(hidden, target_ids,
                                                top_k=ACCEPTANCE_TOP_K)
    slots = target_ids[..., 1:]
    predicted = unary.predicted_ids[..., 1:]
    supervised = weight_mask[..., 1:] > 0.5
    block_index = torch.arange(n).unsqueeze(0)

    def scattered(ids):
        return sum(
            walk["_scatter_accepted_prefix"](
                ids[:, c:c + ACCEPTANCE_CHUNK], slots[:, c:c + ACCEPTANCE_CHUNK],
                supervised[:, c:c + ACCEPTANCE_CHUNK],
                block_index[:, c:c + ACCEPTANCE_CHUNK], n)
            for c in range(0, n, ACCEPTANCE_CHUNK))

    block_valid = supervised.any(dim=-1)
    counts = walk["hard_label_prefix_counts"](
        predicted == slots, unary.target_is_candidate[..., 1:],
        selector_ids == slots, supervised)
    for name, ids in (("", predicted), ("selector_", selector_ids)):
        accepted = scattered(ids)
        arrays[name + "block_accepted"] = accepted.double().numpy()
        arrays[name + "walk"] = np.array([
            float(v) for v in walk["compute_walk_accepted_length_terms"](
                accepted, anchor_positions, block_valid)])
    arrays.update({
        "anchor_positions": anchor_positions.numpy().astype(np.int64),
        "selector_ids": selector_ids.numpy().astype(np.int64),
        "prefix_reached": counts.reached.double().numpy(),
        "prefix_accepted": counts.accepted.double().numpy(),
        "selector_prefix_covered": counts.selector_covered.double().numpy(),
        "selector_prefix_unary_correct":
            counts.selector_unary_correct.double().numpy(),
        "prefix_eligible": counts.eligible.double().numpy(),
    })
    return arrays


def new_model(model_class, case, weight):
    """A bare OnlineDFlashModel of `case` over the frozen head `weight`."""
    loss_type, lk, alpha, kl_scale, kl_decay = case[:5]
    model = model_class.__new__(model_class)
    nn.Module.__init__(model)
    head = nn.Linear(H, V, bias=False).double()
    head.weight = nn.Parameter(weight.clone(), requires_grad=False)
    model.lm_head = head
    model.draft_model = nn.Module()  # No candidate selector.
    model._selector_objective_enabled = False
    model.block_size = K
    model.loss_type = loss_type
    model.loss_decay_gamma = None
    model.dpace_alpha = alpha
    model.lk_loss_type = lk
    model.kl_scale = kl_scale
    model.kl_decay = kl_decay
    return model


def run(model_class, case, tensors=None):
    """The objective's goldens of `case`, on batch(seed, ignored) or on
    `tensors` (hidden, weight, target_ids, weight_mask)."""
    loss_type, lk, alpha, kl_scale, kl_decay, ignored, seed, _ = case
    hidden, weight, target_ids, weight_mask = (
        batch(seed, ignored) if tensors is None else tensors)
    model = new_model(model_class, case, weight)
    states = hidden.clone().requires_grad_()
    scale = (model._sequence_anchor_scale(weight_mask)
             if loss_type != "dflash" else None)
    predecessor_ids = torch.cat([target_ids[:, :, :1], target_ids[:, :, :-1]],
                                dim=-1)
    terms = model._dflash_objective_chunk_terms(
        states, target_ids, weight_mask, predecessor_ids, scale)
    loss_num = model._compose_token_objective(
        terms.ce_loss_num, terms.tv_loss_num, terms.target_probability_num,
        terms.accuracy_den)
    den = terms.loss_den
    loss = loss_num / den.clamp_min(torch.finfo(den.dtype).tiny)
    grad, = torch.autograd.grad(loss, states)
    values = [terms.ce_loss_num, terms.tv_loss_num, den,
              terms.target_probability_num, terms.correct_num,
              terms.accuracy_den, loss_num, loss]
    arrays = {}
    if not ignored:
        with torch.no_grad():
            unary = model._dflash_unary_diagnostics(hidden, target_ids,
                                                    top_k=1)
            weights = model._dflash_metric_loss_weights(
                unary.hard_label_probability, weight_mask, scale)
        arrays["loss_weight"] = weights.sum(dim=(0, 1)).double().numpy()
    return {
        **arrays,
        "target_ids": target_ids.numpy().astype(np.int64),
        "weight_mask": weight_mask.numpy(),
        "hidden": hidden.reshape(-1, hidden.shape[-1]).numpy(),
        "weight": weight.numpy(),
        "terms": np.array([float(v.detach()) for v in values]),
        "grad_hidden": grad.reshape(-1, hidden.shape[-1]).numpy(),
    }


# The DFlash2 selector and teacher metric cases: main's objective with a
# candidate selector (_selector_chunk_terms) and its metric chunk terms
# (_dflash_metric_chunk_terms: unary, selector, greedy and teacher families).
SELECTOR_MODULE_NAMES = MODULE_NAMES + (
    "DFlashMetricTerms", "_expected_accepted_length_num",
    "_DFlashSelectorDiagnostics", "_DFlashGreedyDiagnostics",
    "_DFlashTeacherTerms")
SELECTOR_METHODS = METHODS + (
    "_selector_chunk_terms", "_metric_top_k", "_dflash_metric_chunk_terms",
    "_dflash2_selector_diagnostics", "_dflash_greedy_diagnostics",
    "_dflash_teacher_terms", "_reduce_dflash_metric_terms")
SELECTOR_TOP_K = 4
# The selector's fields of DFlashObjectiveTerms, in selector_terms.npy.
SELECTOR_TERMS = ("selector_ce_num", "selector_probability_num",
                  "selector_correct_num", "selector_weight_den",
                  "selector_covered_num")
# name: (loss_type, lk_loss_type, dpace_alpha, kl_scale, kl_decay, seed,
# selector_loss_alpha, selector_stop_gradient, dflash's loss config).
SELECTOR_CASES = {
    "selector_dflash": (
        "dflash", None, 0.5, 1.0, 1.0, 31, 0.5, False, "dflash {}"),
    "selector_dflash_lk_tv": (
        "dflash", "tv", 0.5, 1.0, 1.0, 32, 2.0, False,
        "dflash { lk { type: TV } }"),
    "selector_dpace_lk_lambda_stop_gradient": (
        "dpace", "lambda", 0.3, 0.8, 2.0, 33, 1.0, True,
        "dpace { alpha: 0.3 lk { type: LAMBDA kl_scale: 0.8 kl_decay: 2 } "
        "denominator: SEQUENCE_BALANCED }"),
}


@contextlib.contextmanager
def float64_casts():
    """Main's `.float()` upcasts (the selector's CE, the diagnostics'
    softmaxes) leave float64 tensors in float64, so its terms are float64
    exact; bool and integer tensors still become float32."""
    original = torch.Tensor.float

    def float_keeping_float64(self, *args, **kwargs):
        if self.dtype == torch.float64:
            return self
        return original(self, *args, **kwargs)

    torch.Tensor.float = float_keeping_float64
    try:
        yield
    finally:
        torch.Tensor.float = original


class SelectorStandIn(nn.Module):
    """A fixed tiny DFlash2 candidate selector (dflash's stand-in, not
    SpecForge's network): a candidate's score is 0.7 times its unary logit
    plus its embedding against the projected hidden state and the
    predecessor's embedding; greedy_path feeds each slot's pick to the next
    slot. The goldens hold its tables (selector_embed.npy,
    selector_proj.npy); //python/tests/selector_terms runs it on dflash's
    top-k. `calls` records each score_candidates call's tensors, `paths`
    each greedy path."""

    top_k = SELECTOR_TOP_K

    def __init__(self, embed, proj):
        super().__init__()
        # Trainable, as a selector is: its CE has a gradient even when
        # selector_stop_gradient detaches its inputs.
        self.embed = nn.Parameter(torch.as_tensor(embed))
        self.proj = nn.Parameter(torch.as_tensor(proj))
        self.calls = []
        self.paths = []

    def score_candidates(self, candidate_ids, unary_logits, hidden_states,
                         predecessor_ids):
        context = hidden_states @ self.proj + self.embed[predecessor_ids]
        scores = 0.7 * unary_logits + (
            self.embed[candidate_ids] * context.unsqueeze(-2)).sum(-1)
        self.calls.append((candidate_ids, unary_logits, scores))
        return scores

    def greedy_path(self, candidate_ids, unary_logits, hidden_states,
                    anchor_token_ids):
        previous, path = anchor_token_ids, []
        for slot in range(candidate_ids.shape[1]):
            scores = self.score_candidates(
                candidate_ids[:, slot], unary_logits[:, slot],
                hidden_states[:, slot], previous)
            previous = candidate_ids[:, slot].gather(
                -1, scores.argmax(-1, keepdim=True)).squeeze(-1)
            path.append(previous)
        self.paths.append(torch.stack(path, dim=1))
        return self.paths[-1]


def selector_batch(seed):
    """batch()'s weights (a sequence with three weighted blocks, one with
    one, one with none; a fractional weight) with targets that are the
    argmax, another of the top SELECTOR_TOP_K or outside it, and the
    target model's states near the draft's (its argmax agrees sometimes)."""
    hidden, weight, _, weight_mask = batch(seed, False)
    g = torch.Generator().manual_seed(seed + 100)
    logits = hidden @ weight.T
    top = logits.topk(SELECTOR_TOP_K + 1, dim=-1)
    gap = (top.values[..., :-1] - top.values[..., 1:]).min()
    if gap < 1e-4:  # A near tie would make the top-k a coin toss.
        raise SystemExit(f"seed {seed}: logits {gap:.2g} apart; change it")
    pick = torch.randint(0, SELECTOR_TOP_K, hidden.shape[:3], generator=g)
    u = torch.rand(hidden.shape[:3], generator=g)
    pick[u < 0.4] = 0
    target_ids = top.indices[..., :SELECTOR_TOP_K].gather(
        -1, pick.unsqueeze(-1)).squeeze(-1)
    outside = top.indices[..., SELECTOR_TOP_K]
    target_ids = torch.where(u > 0.8, outside, target_ids)
    teacher = hidden + 0.6 * torch.randn(hidden.shape, generator=g,
                                         dtype=torch.float64)
    rng = np.random.default_rng(seed)
    embed = rng.standard_normal((V, 3)) * 0.5
    proj = rng.standard_normal((H, 3)) * 0.5
    return (hidden, weight, target_ids, weight_mask), teacher, embed, proj


def run_selector(model_class, case):
    """Main's objective with the stand-in selector (its token terms and
    d(token loss)/d(hidden) as the other cases hold them, for the C++
    goldens tests), the selector's terms, what _selector_chunk_terms was
    given and d(selector_ce_num)/d(its logits), d(token loss + alpha *
    selector_ce_num over loss_den)/d(hidden), and the metric chunk terms
    with the target model's states (metric_<field>.npy)."""
    (loss_type, lk, alpha, kl_scale, kl_decay, seed, selector_alpha,
     stop_gradient, _) = case
    tensors, teacher, embed, proj = selector_batch(seed)
    hidden, weight, target_ids, weight_mask = tensors
    model = new_model(model_class, case, weight)
    selector = SelectorStandIn(embed, proj)
    draft = nn.Module()
    draft.candidate_selector = selector
    draft.transform_unary_logits = lambda logits: logits
    model.draft_model = draft
    model.embed_tokens = nn.Embedding(V, 1)
    model._selector_objective_enabled = True
    model.selector_stop_gradient = stop_gradient
    model.metric_top_k = 16
    given = {}
    chunk_terms = model._selector_chunk_terms

    def recording(**kwargs):
        given.update(kwargs)
        return chunk_terms(**kwargs)

    model._selector_chunk_terms = recording
    states = hidden.clone().requires_grad_()
    with float64_casts():
        scale = (model._sequence_anchor_scale(weight_mask)
                 if loss_type != "dflash" else None)
        predecessor_ids = torch.cat(
            [target_ids[:, :, :1], target_ids[:, :, :-1]], dim=-1)
        terms = model._dflash_objective_chunk_terms(
            states, target_ids, weight_mask, predecessor_ids, scale)
        candidate_ids, unary_logits, selector_logits = selector.calls[0]
        loss_num = model._compose_token_objective(
            terms.ce_loss_num, terms.tv_loss_num,
            terms.target_probability_num, terms.accuracy_den)
        den = terms.loss_den
        floor = torch.finfo(den.dtype).tiny
        loss = loss_num / den.clamp_min(floor)
        total = (loss_num + selector_alpha * terms.selector_ce_num) / (
            den.clamp_min(floor))
        grad, = torch.autograd.grad(loss, states, retain_graph=True)
        grad_logits, = torch.autograd.grad(terms.selector_ce_num,
                                           selector_logits, retain_graph=True)
        grad_total, = torch.autograd.grad(total, states)
        selector.calls.clear()
        with torch.no_grad():
            metrics = model._dflash_metric_chunk_terms(
                hidden, target_ids, weight_mask, predecessor_ids, teacher,
                scale, torch.arange(N).unsqueeze(0), total_blocks=N)
    values = [terms.ce_loss_num, terms.tv_loss_num, den,
              terms.target_probability_num, terms.correct_num,
              terms.accuracy_den, loss_num, loss]
    arrays = {
        "target_ids": target_ids.numpy().astype(np.int64),
        "weight_mask": weight_mask.numpy(),
        "hidden": hidden.reshape(-1, H).numpy(),
        "weight": weight.numpy(),
        "terms": np.array([float(v.detach()) for v in values]),
        "grad_hidden": grad.reshape(-1, H).numpy(),
        "loss_weight": metrics.loss_weight_num.double().numpy(),
        "teacher_hidden": teacher.reshape(-1, H).numpy(),
        "selector_embed": embed,
        "selector_proj": proj,
        "selector_settings": np.array(
            [selector_alpha, float(stop_gradient), SELECTOR_TOP_K]),
        "selector_candidate_ids": candidate_ids.numpy().astype(np.int64),
        "selector_unary_logits": unary_logits.detach().numpy(),
        "selector_logits": selector_logits.detach().numpy(),
        "selector_loss_weights": given["loss_weights"].detach().numpy(),
        "selector_terms": np.array(
            [float(getattr(terms, name).detach()) for name in SELECTOR_TERMS]),
        "selector_grad_logits": grad_logits.numpy(),
        "selector_loss": np.array([float(total.detach())]),
        "selector_grad_hidden": grad_total.reshape(-1, H).numpy(),
        "selector_greedy_ids": selector.paths[0].reshape(
            B, N, K - 1).numpy().astype(np.int64),
    }
    for field, value in metrics._asdict().items():
        arrays["metric_" + field] = value.double().numpy()
    return arrays


def write_case(directory, arrays, comment, num_anchors, loss,
               metric_top_k=None):
    os.makedirs(directory, exist_ok=True)
    for array, value in arrays.items():
        np.save(os.path.join(directory, array + ".npy"), value)
    with open(os.path.join(directory, "config.textproto"), "w") as f:
        f.write(f"# {comment}\n"
                f"layout {{ block_size: {K} num_anchors: {num_anchors} }}\n"
                f"head {{ vocab_size: {V} hidden_size: {H} dtype: FLOAT64"
                + (f" metric_top_k: {metric_top_k}" if metric_top_k else "")
                + " }\n"
                f"loss {{ {loss} }}\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--specforge-file", required=True,
                        help="SpecForge main's dflash_family_model.py")
    parser.add_argument("--specforge-metrics-file",
                        help="SpecForge main's dflash_metrics.py; with it, "
                        "the acceptance cases too")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    tree = parse(args.specforge_file)
    model_class = load_objective(tree, args.specforge_file)
    for name, case in CASES.items():
        loss_type, lk, alpha, kl_scale, kl_decay, ignored, _, loss = case
        write_case(
            os.path.join(args.out, name), run(model_class, case),
            f"SpecForge main OnlineDFlashModel(loss_type={loss_type!r}, "
            f"lk_loss_type={lk!r}, dpace_alpha={alpha}, kl_scale="
            f"{kl_scale}, kl_decay={kl_decay}); ignored targets: {ignored}",
            N, loss)
    if args.specforge_metrics_file:
        walk = load_definitions(tree, args.specforge_file, WALK_NAMES)
        walk.update(load_definitions(parse(args.specforge_metrics_file),
                                     args.specforge_metrics_file,
                                     PREFIX_NAMES))
        for name, case in ACCEPTANCE_CASES.items():
            write_case(
                os.path.join(args.out, name),
                run_acceptance(model_class, walk, case),
                "SpecForge main OnlineDFlashModel(loss_type='dflash'): its "
                "walk/prefix accepted-length metrics (acceptance case)",
                len(case[1][0]), "dflash {}")
        selector_class = load_objective(
            tree, args.specforge_file, SELECTOR_MODULE_NAMES,
            SELECTOR_METHODS, globals_=walk)
        for name, case in SELECTOR_CASES.items():
            write_case(
                os.path.join(args.out, name),
                run_selector(selector_class, case),
                f"SpecForge main OnlineDFlashModel(loss_type={case[0]!r}, "
                f"lk_loss_type={case[1]!r}, dpace_alpha={case[2]}, kl_scale="
                f"{case[3]}, kl_decay={case[4]}, selector_loss_alpha="
                f"{case[6]}, selector_stop_gradient={case[7]}) with a "
                f"DFlash2 candidate selector (top {SELECTOR_TOP_K})",
                N, case[8], SELECTOR_TOP_K)


if __name__ == "__main__":
    main()
