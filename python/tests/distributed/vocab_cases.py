"""What the vocab-parallel head tests share: cases (a loss family, a dtype,
a vocabulary, the call's options), their inputs (the same on every rank),
one call on this rank's shard of the weight (or on the whole weight, the
single-process reference), and the comparison: every term, per-row output
and gradient against the single-process call (float64 1e-12 relative,
float32 1e-6; ids exactly), every rank's terms, row outputs and summed
gradients the same bits as rank 0's, the ranks' weight-gradient shards
together the whole weight's gradient.
"""

import unittest
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

import ranks
from dflash.torch import dflash_objective
from dflash.torch.distributed import shard_rows, vocab_shard_range

TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-6}

# Loss families by config text (SpecForge's and dflash's), Domino apart.
FAMILIES = {
    "dflash": "loss { dflash { gamma: 7 } }",
    "label_smoothing": ("loss { dflash { gamma: 7 } cross_entropy { "
                        "label_smoothing: 0.1 z_loss_scale: 0.01 } }"),
    "dpace": "loss { dpace { alpha: 0.5 } }",
    "dpace_cumulative": ("loss { dpace { variant: "
                         "CUMULATIVE_CONFIDENCE_ONLY } }"),
    "dpace_continuation": ("loss { dpace { variant: CONTINUATION_VALUE_ONLY "
                           "denominator: SEQUENCE_BALANCED } }"),
    "lk_alpha": "loss { dflash { gamma: 7 lk { type: ALPHA } } }",
    "lk_tv": "loss { dflash { gamma: 7 lk { type: TV } } }",
    "lk_lambda": "loss { lk_lambda { gamma: 7 kl_decay: 0.9 } }",
    "tv": "loss { tv { gamma: 7 } }",
    "dspark": "loss { dspark { gamma: 3 } }",
    "dpard": ("loss { dspark { gamma: 3 objective: DPARD ce_weight: 0 "
              "l1_weight: 0 } }"),
    "forward_kl": "loss { distillation { temperature: 1.5 } }",
    "reverse_kl": "loss { distillation { divergence: REVERSE_KL } }",
    "jsd": "loss { distillation { divergence: JSD beta: 0.3 } }",
}
# Domino, with and without its label shift: families that read a
# correction apart from the logits (a case gives it "correction" > 0), and
# take no top-k.
SPLIT_FAMILIES = {
    "domino": ("loss { domino { lambda_base: 0.3 pure_draft_prefix_len: 1 "
               "gamma: 4 } }"),
    "domino_shift": ("loss { domino { lambda_base: 0.3 shift_label: true } "
                     "}"),
}
CONFIGS = {**FAMILIES, **SPLIT_FAMILIES}
NEEDS_TEACHER = {"dspark", "dpard", "forward_kl", "reverse_kl", "jsd"}
NEEDS_CONFIDENCE = {"dspark", "dpard"}


def case(name: str, family: str = "dflash", **options: Any
         ) -> Dict[str, Any]:
    """A case: `family`'s config and these options (defaults below)."""
    c = {"name": name, "family": family, "dtype": torch.float64, "V": 37,
         "H": 8, "B": 2, "N": 3, "K": 4, "top_k": 0, "return_rows": True,
         "trainable": False, "bias": False, "correction": 0,
         "teacher_diagnostics": False, "ties": False, "targets": "any",
         "masked_chunk": False, "overrides": {}, "seed": 7}
    c.update(options)
    return c


def inputs(c: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    """The case's tensors, the same on every rank (seeded)."""
    g = torch.Generator().manual_seed(c["seed"])
    dt, V, H = c["dtype"], c["V"], c["H"]
    b, n, k = c["B"], c["N"], c["K"]
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) / 2
    if c["ties"]:
        # Rows equal across every shard boundary (and a run of four around
        # the middle): equal logits, so argmax and top-k break ties to the
        # lower id across the ranks.
        for cut in range(1, V):
            if cut % 3 == 0:
                weight[cut] = weight[cut - 1]
        weight[V // 2:V // 2 + 4] = weight[V // 2]
    x = {
        "hidden": torch.randn(b, n, k, H, generator=g, dtype=torch.float64),
        "weight": weight,
        "bias": torch.randn(V, generator=g, dtype=torch.float64) / 4,
        "teacher": torch.randn(b, n, k, H, generator=g, dtype=torch.float64),
        "confidence": torch.randn(b, n, k, generator=g),
        "z": torch.randn(b, n, k, max(1, c["correction"]), generator=g,
                         dtype=torch.float64),
        "m": torch.randn(V, max(1, c["correction"]), generator=g,
                         dtype=torch.float64) / 2,
        "values_grad": torch.randn(b, n, k, max(1, c["top_k"]),
                                   generator=g, dtype=torch.float64),
    }
    if c["targets"] == "last_shard":
        # Every target among the last few ids (one shard's).
        targets = V - 1 - torch.randint(0, 3, (b, n, k), generator=g)
    else:
        targets = torch.randint(0, V, (b, n, k), generator=g)
    mask = (torch.rand(b, n, k, generator=g) > 0.2).double()
    mask[..., 0] = 0
    if c["masked_chunk"]:
        mask[0] = 0  # With chunk_blocks = N, the first chunk is all masked.
    x["target_ids"] = targets
    x["weight_mask"] = mask
    for name in ("hidden", "weight", "bias", "teacher", "z", "m"):
        x[name] = x[name].to(dt)
    return x


def run(c: Dict[str, Any], group: Optional[Any]) -> Dict[str, torch.Tensor]:
    """The case on this rank's shard (group) or the whole weight (None):
    the terms, row outputs and gradients of loss_num plus the top-k values
    weighed by values_grad, as a flat dict of tensors."""
    x = inputs(c)
    weight, bias, m = x["weight"], x["bias"], x["m"]
    if group is not None:
        weight, bias, m = (shard_rows(t, group) for t in (weight, bias, m))
    hidden = x["hidden"].clone().requires_grad_()
    weight = weight.clone().requires_grad_(c["trainable"])
    bias = bias.clone().requires_grad_(c["trainable"]) if c["bias"] else None
    extra: Dict[str, Any] = dict(c["overrides"])
    family = c["family"]
    if family in NEEDS_TEACHER or c["teacher_diagnostics"]:
        extra["teacher_hidden"] = x["teacher"]
    confidence = None
    if family in NEEDS_CONFIDENCE:
        confidence = x["confidence"].clone().requires_grad_()
        extra["confidence_logits"] = confidence
    z = None
    if c["correction"]:
        z = x["z"].clone().requires_grad_()
        m = m.clone().requires_grad_()
        extra["correction_inputs"] = z
        extra["correction_weight"] = m
    terms = dflash_objective(
        hidden, weight, x["target_ids"], x["weight_mask"],
        config=CONFIGS[family], lm_head_bias=bias,
        return_rows=c["return_rows"], top_k=c["top_k"], threads=1,
        vocab_group=group, **extra)
    d = terms.diagnostics
    loss = terms.loss_num
    if c["top_k"]:
        loss = loss + (d.top_k_values * x["values_grad"].to(
            d.top_k_values.dtype)).sum()
    loss.backward()
    out: Dict[str, torch.Tensor] = {
        "loss_num": terms.loss_num, "loss_den": terms.loss_den,
        "correct_num": terms.correct_num,
        "accuracy_den": terms.accuracy_den,
        "position_correct": d.position_correct,
        "position_den": d.position_den,
        "target_probability_num": d.target_probability_num,
        "ce_loss_num": d.ce_loss_num, "tv_loss_num": d.tv_loss_num,
        "grad_hidden": hidden.grad,
    }
    for name, value in d.metrics.items():
        out["metrics." + name] = value
    for name, value in d.family_terms.items():
        out["family." + name] = torch.tensor(value, dtype=torch.float64)
    for name in ("neg_log_q", "argmax", "base_argmax", "teacher_argmax",
                 "top_k", "top_k_values", "target_is_candidate",
                 "target_candidate_index", "loss_weight"):
        value = getattr(d, name)
        if value is not None:
            out[name] = value
    if confidence is not None:
        out["grad_confidence"] = confidence.grad
    if c["trainable"]:
        out["grad_weight"] = weight.grad
        if bias is not None:
            out["grad_bias"] = bias.grad
    if z is not None:
        out["grad_z"] = z.grad
        out["grad_m"] = m.grad
    return {name: value.detach().clone() for name, value in out.items()}


def run_cases(rank: int, world: int, cases: List[Dict[str, Any]]
              ) -> List[Any]:
    """Each case on this rank's shard over the default group: its results,
    or its exception as (type name, message)."""
    results = []
    for c in cases:
        try:
            results.append(run(c, dist.group.WORLD))
        except Exception as error:  # noqa: BLE001 - recorded for the parent
            results.append((type(error).__name__, str(error)))
    return results


# What stays on this rank's shard (the rest is whole on every rank).
SHARDED = ("grad_weight", "grad_bias", "grad_m")
IDS = ("argmax", "base_argmax", "teacher_argmax", "top_k",
       "target_is_candidate", "target_candidate_index")


class VocabTestCase(unittest.TestCase):
    def check_case(self, c: Dict[str, Any], got: List[Any]) -> None:
        """Every rank's results of case `c` against one process."""
        with self.subTest(case=c["name"]):
            self._check_case(c, got)

    def _check_case(self, c: Dict[str, Any], got: List[Any]) -> None:
        for rank, result in enumerate(got):
            if isinstance(result, tuple):
                self.fail(f"{c['name']}: rank {rank} raised {result[0]}: "
                          f"{result[1]}")
        want = run(c, None)
        world = len(got)
        first = got[0]
        self.assertEqual(sorted(first), sorted(want), c["name"])
        for name, value in want.items():
            with self.subTest(case=c["name"], output=name):
                if name in SHARDED:
                    pieces = [r[name] for r in got]
                    for rank, piece in enumerate(pieces):
                        start, stop = _range(value.shape[0], world, rank)
                        self.assertEqual(piece.shape[0], stop - start)
                    whole = torch.cat(pieces)
                else:
                    for rank in range(1, world):
                        # The same bits on every rank.
                        self.assertTrue(torch.equal(got[rank][name],
                                                    first[name]),
                                        f"rank {rank} differs from rank 0")
                    whole = first[name]
                self.assertEqual(whole.shape, value.shape)
                if name in IDS or not value.is_floating_point():
                    self.assertTrue(torch.equal(whole, value),
                                    f"{whole} != {value}")
                    continue
                self.assertEqual(whole.dtype, value.dtype)
                tolerance = TOLERANCE[
                    torch.float64 if value.dtype == torch.float64
                    and c["dtype"] == torch.float64 else torch.float32]
                self.assertLess(ranks.relative_error(whole, value),
                                tolerance)


def _range(vocab: int, world: int, rank: int):
    base, extra = divmod(vocab, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


__all__ = ["FAMILIES", "SPLIT_FAMILIES", "VocabTestCase", "case", "inputs", "run",
           "run_cases", "vocab_shard_range"]
