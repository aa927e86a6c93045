"""The vocab-parallel head with rows="local" (the vocab group is also the
data-parallel group): each gloo rank brings its own rows (unequal B) and
its shard of the weight; each gets the terms, row outputs and gradients of
its own rows, against one process holding the whole weight and every
rank's rows concatenated (the single process's terms of each rank's slice
of them, its gradients split by rows; the ranks' weight-gradient shards
together the whole weight's). Every rank's loss is its loss_num times a
factor of its own, so the weight's gradient checks that each rank's rows
come in with their rank's factor. float64 1e-12, float32 1e-6, ids
exactly; two and three ranks; every mode; dflash, DSpark with its teacher
and confidence, Domino with its correction, distillation, a trainable
weight and bias, int32 ids and a bool mask on some ranks only. And
refusals: rows="local" on one rank only, top_k, a mismatched row tensor,
an unknown rows value, an empty micro-batch raise on every rank, as does
a MemoryError on one rank before any one of its W runs of the head.
What a call holds from forward to backward: the gradients of its own rows
(and with a frozen head and Domino's correction each run's of M's shard),
never a weight-gradient shard per run; with a vocabulary large beside the
rows, less than two weight shards in all on two and four ranks. A trainable
head's backward failing on one rank (its row buffers, each of its W runs)
raises on every rank.
"""

import os
import sys
import unittest
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ranks  # noqa: E402
import vocab_cases  # noqa: E402
from dflash.torch import FusedHead, dflash_objective  # noqa: E402
from dflash.torch import _vocab_parallel as parallel_module  # noqa: E402
from dflash.torch import objective as objective_module  # noqa: E402
from dflash.torch.distributed import shard_rows  # noqa: E402

TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-6}
N, K, H, V = 3, 4, 8, 37


def case(name: str, family: str = "dflash", **options: Any
         ) -> Dict[str, Any]:
    c = {"name": name, "family": family, "dtype": torch.float64,
         "batches": (2, 1, 3), "trainable": False, "bias": False,
         "correction": 0, "overrides": {}, "seed": 11}
    c.update(options)
    return c


def inputs(c: Dict[str, Any], world: int) -> Dict[str, Any]:
    """The whole weight (bias, correction weight) and every rank's rows,
    seeded: the same on every rank and in the single process."""
    g = torch.Generator().manual_seed(c["seed"])
    dt = c["dtype"]
    r = max(1, c["correction"])
    x: Dict[str, Any] = {
        "weight": (torch.randn(V, H, generator=g, dtype=torch.float64)
                   / 2).to(dt),
        "bias": (torch.randn(V, generator=g, dtype=torch.float64)
                 / 4).to(dt),
        "m": (torch.randn(V, r, generator=g, dtype=torch.float64)
              / 2).to(dt),
        "rows": []}
    for q in range(world):
        b = c["batches"][q]
        mask = (torch.rand(b, N, K, generator=g) > 0.2).double()
        mask[..., 0] = 0
        x["rows"].append({
            "hidden": torch.randn(b, N, K, H, generator=g,
                                  dtype=torch.float64).to(dt),
            "teacher": torch.randn(b, N, K, H, generator=g,
                                   dtype=torch.float64).to(dt),
            "confidence": torch.randn(b, N, K, generator=g,
                                      dtype=torch.float64).to(dt),
            "z": torch.randn(b, N, K, r, generator=g,
                             dtype=torch.float64).to(dt),
            "target_ids": torch.randint(0, V, (b, N, K), generator=g),
            "weight_mask": mask})
    return x


def factor(rank: int) -> float:
    # Each rank's loss is its loss_num times its own factor.
    return 0.5 + 0.75 * rank


def call(c: Dict[str, Any], rows: Dict[str, torch.Tensor],
         weight: torch.Tensor, bias: Optional[torch.Tensor],
         m: Optional[torch.Tensor], group: Optional[Any],
         confidence: Optional[torch.Tensor], z: Optional[torch.Tensor],
         hidden: torch.Tensor) -> Any:
    family = c["family"]
    extra: Dict[str, Any] = dict(c["overrides"])
    if family in vocab_cases.NEEDS_TEACHER:
        extra["teacher_hidden"] = rows["teacher"]
    if confidence is not None:
        extra["confidence_logits"] = confidence
    if z is not None:
        extra["correction_inputs"] = z
        extra["correction_weight"] = m
    if group is not None:
        extra["vocab_group"] = group
        extra["rows"] = "local"
    return dflash_objective(
        hidden, weight, rows["target_ids"], rows["weight_mask"],
        config=vocab_cases.CONFIGS[family], lm_head_bias=bias,
        return_rows=True, threads=1, **extra)


def outputs(terms: Any) -> Dict[str, torch.Tensor]:
    d = terms.diagnostics
    out = {"loss_num": terms.loss_num, "loss_den": terms.loss_den,
           "correct_num": terms.correct_num,
           "accuracy_den": terms.accuracy_den,
           "position_correct": d.position_correct,
           "position_den": d.position_den,
           "target_probability_num": d.target_probability_num,
           "ce_loss_num": d.ce_loss_num, "tv_loss_num": d.tv_loss_num}
    for name, value in d.metrics.items():
        out["metrics." + name] = value
    for name, value in d.family_terms.items():
        out["family." + name] = torch.tensor(value, dtype=torch.float64)
    for name in ("neg_log_q", "argmax", "base_argmax", "teacher_argmax",
                 "loss_weight"):
        value = getattr(d, name)
        if value is not None:
            out[name] = value
    return {name: v.detach().clone() for name, v in out.items()}


def leaves(c: Dict[str, Any], rows: Dict[str, torch.Tensor]):
    confidence = (rows["confidence"].clone().requires_grad_()
                  if c["family"] in vocab_cases.NEEDS_CONFIDENCE else None)
    z = (rows["z"].clone().requires_grad_() if c["correction"] else None)
    return confidence, z


def run_rank(c: Dict[str, Any], rank: int, world: int) -> Dict[str, Any]:
    """The case on this rank's rows and shard, rows="local"."""
    x = inputs(c, world)
    group = dist.group.WORLD
    rows = dict(x["rows"][rank])
    if c.get("mixed") and rank % 2:
        # Other id and mask dtypes than the other ranks' (same values).
        rows["target_ids"] = rows["target_ids"].int()
        rows["weight_mask"] = rows["weight_mask"].bool()
    weight = shard_rows(x["weight"], group).requires_grad_(c["trainable"])
    bias = (shard_rows(x["bias"], group).requires_grad_(c["trainable"])
            if c["bias"] else None)
    m = (shard_rows(x["m"], group).requires_grad_()
         if c["correction"] else None)
    hidden = rows["hidden"].clone().requires_grad_()
    confidence, z = leaves(c, rows)
    terms = call(c, rows, weight, bias, m, group, confidence, z, hidden)
    given = [hidden, weight, bias, m, confidence, z, rows["teacher"],
             rows["target_ids"], rows["weight_mask"]]
    held = held_bytes(terms, given)
    (factor(rank) * terms.loss_num).backward()
    out = outputs(terms)
    # Not the single process's: checked against this rank's sizes.
    out["held"] = held
    out["row_gradients"] = sum(
        nbytes(t) for t in (hidden, confidence, z) if t is not None)
    out["grad_hidden"] = hidden.grad.clone()
    if confidence is not None:
        out["grad_confidence"] = confidence.grad.clone()
    if z is not None:
        out["grad_z"] = z.grad.clone()
        out["grad_m"] = m.grad.clone()
    if c["trainable"]:
        out["grad_weight"] = weight.grad.clone()
        if bias is not None:
            out["grad_bias"] = bias.grad.clone()
    return out


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _storage(t: torch.Tensor) -> int:
    # torch 1.13 has no untyped_storage.
    if hasattr(t, "untyped_storage"):
        return t.untyped_storage().data_ptr()
    return t.storage().data_ptr()


def held_bytes(terms: Any, given: List[Optional[torch.Tensor]]) -> int:
    """The bytes autograd holds for the call between forward and backward
    beyond the caller's own tensors `given`: its saved tensors' storages
    (each once) that are none of `given`'s."""
    theirs = {_storage(t) for t in given if t is not None}
    mine: Dict[int, int] = {}
    for t in terms.loss_num.grad_fn.saved_tensors:
        if t is not None and t.numel() and _storage(t) not in theirs:
            mine[_storage(t)] = nbytes(t)
    return sum(mine.values())


def one_process(c: Dict[str, Any], world: int) -> List[Dict[str, Any]]:
    """One process, the whole weight, every rank's rows concatenated: the
    terms of each rank's slice, the gradients of the sum of the ranks'
    losses split by rows (the weight's by shard)."""
    x = inputs(c, world)
    weight = x["weight"].clone().requires_grad_(c["trainable"])
    bias = x["bias"].clone().requires_grad_(c["trainable"]) if c[
        "bias"] else None
    m = x["m"].clone().requires_grad_() if c["correction"] else None
    whole = {name: torch.cat([r[name] for r in x["rows"]])
             for name in x["rows"][0]}
    hidden = whole["hidden"].clone().requires_grad_()
    confidence, z = leaves(c, whole)
    starts = [sum(c["batches"][:q]) for q in range(world + 1)]
    results, loss = [], 0
    for q in range(world):
        at = slice(starts[q], starts[q + 1])
        rows = {name: t[at] for name, t in whole.items()}
        terms = call(c, rows, weight, bias, m, None,
                     None if confidence is None else confidence[at],
                     None if z is None else z[at], hidden[at])
        loss = loss + factor(q) * terms.loss_num
        results.append(outputs(terms))
    loss.backward()
    for q, out in enumerate(results):
        at = slice(starts[q], starts[q + 1])
        out["grad_hidden"] = hidden.grad[at]
        if confidence is not None:
            out["grad_confidence"] = confidence.grad[at]
        if z is not None:
            out["grad_z"] = z.grad[at]
        shard = slice(*vocab_cases._range(V, world, q))
        if m is not None:
            out["grad_m"] = m.grad[shard]
        if c["trainable"]:
            out["grad_weight"] = weight.grad[shard]
            if bias is not None:
                out["grad_bias"] = bias.grad[shard]
    if c["family"] == "dflash":
        # The ranks' loss_num are the split of one call on all the rows.
        total = call(c, whole, x["weight"], x["bias"] if c["bias"] else None,
                     x["m"] if c["correction"] else None, None, None,
                     whole["z"] if c["correction"] else None,
                     whole["hidden"])
        results[0]["all_rows_loss_num"] = total.loss_num.detach()
    return results


def run_cases(rank: int, world: int, cases: List[Dict[str, Any]]
              ) -> List[Any]:
    results = []
    for c in cases:
        try:
            results.append(run_rank(c, rank, world))
        except Exception as error:  # noqa: BLE001 - recorded for the parent
            results.append((type(error).__name__, str(error)))
    return results


MODES = ("materialize", "save", "checkpoint", "selective", "fused")
CASES = [
    case("dflash_trainable_bias", trainable=True, bias=True),
    case("dspark_confidence", "dspark"),
    case("domino_correction", "domino", correction=2, trainable=True),
    case("forward_kl", "forward_kl"),
    case("float32", dtype=torch.float32, trainable=True, bias=True),
    case("float32_dspark", "dspark", dtype=torch.float32),
    case("mixed_id_and_mask_dtypes", mixed=True, trainable=True),
] + [
    case("mode_" + mode, trainable=True,
         overrides={"mode": mode, "chunk_blocks": 2})
    for mode in MODES
] + [
    case("domino_mode_" + mode, "domino", correction=2,
         overrides={"mode": mode, "chunk_blocks": 2})
    for mode in MODES
]


class LocalRowsTest(unittest.TestCase):
    def check(self, world: int) -> None:
        got = ranks.run_ranks(run_cases, world, CASES, timeout=300)
        for index, c in enumerate(CASES):
            with self.subTest(world=world, case=c["name"]):
                self._check_case(c, [r[index] for r in got], world)

    def _check_case(self, c, got, world):
        for rank, result in enumerate(got):
            if isinstance(result, tuple):
                self.fail(f"rank {rank} raised {result[0]}: {result[1]}")
            # Held from forward to backward: the gradients of this rank's
            # rows, and with a frozen head each of the W runs' gradient of
            # this rank's shard of M, never a shard of the weight's
            # gradient per run.
            held, allowed = result.pop("held"), result.pop("row_gradients")
            if not c["trainable"] and c["correction"]:
                start, stop = vocab_cases._range(V, world, rank)
                allowed += world * (stop - start) * c["correction"] * (
                    torch.finfo(c["dtype"]).bits // 8)
            self.assertLessEqual(held, allowed, f"rank {rank} held bytes")
        want = one_process(c, world)
        tolerance = TOLERANCE[c["dtype"]]
        total = want[0].pop("all_rows_loss_num", None)
        if total is not None:
            split = sum(float(r["loss_num"]) for r in got)
            self.assertLess(abs(split - float(total)) / abs(float(total)),
                            tolerance)
        for rank in range(world):
            self.assertEqual(sorted(got[rank]), sorted(want[rank]))
            for name, value in want[rank].items():
                mine = got[rank][name]
                self.assertEqual(mine.shape, value.shape, name)
                if not value.is_floating_point():
                    self.assertTrue(torch.equal(mine, value),
                                    f"rank {rank} {name}")
                    continue
                self.assertEqual(mine.dtype, value.dtype, name)
                self.assertLess(ranks.relative_error(mine, value),
                                tolerance, f"rank {rank} {name}")

    def test_two_ranks(self):
        self.check(2)

    def test_three_ranks(self):
        self.check(3)


# A vocabulary large beside the rows (a rank's rows 12 to 36 x H floats,
# its shard about V / W x H): what the call holds until backward is to stay
# below two shards however many ranks.
BIG_V = 4099


def big_inputs(world: int) -> Dict[str, Any]:
    g = torch.Generator().manual_seed(21)
    x: Dict[str, Any] = {
        "weight": torch.randn(BIG_V, H, generator=g) / 2,
        "bias": torch.randn(BIG_V, generator=g) / 4, "rows": []}
    for q in range(world):
        b = 1 + q % 3
        x["rows"].append({
            "hidden": torch.randn(b, N, K, H, generator=g),
            "target_ids": torch.randint(0, BIG_V, (b, N, K), generator=g),
            "weight_mask": (torch.rand(b, N, K, generator=g) > 0.2).double()})
    return x


def big_call(rows: Dict[str, torch.Tensor], hidden: torch.Tensor,
             weight: torch.Tensor, bias: torch.Tensor,
             group: Optional[Any]) -> Any:
    extra: Dict[str, Any] = {}
    if group is not None:
        extra = {"vocab_group": group, "rows": "local"}
    return dflash_objective(hidden, weight, rows["target_ids"],
                            rows["weight_mask"], lm_head_bias=bias,
                            config=vocab_cases.CONFIGS["dflash"], threads=1,
                            **extra)


def held_rank(rank: int, world: int) -> Dict[str, Any]:
    """A trainable float32 weight and bias on BIG_V: the bytes of every
    tensor autograd saved for the call (each storage once, the caller's
    hidden, shards and rows among them) and of those beyond the caller's,
    then the gradients of factor(rank) x loss_num."""
    group = dist.group.WORLD
    x = big_inputs(world)
    rows = x["rows"][rank]
    weight = shard_rows(x["weight"], group).requires_grad_()
    bias = shard_rows(x["bias"], group).requires_grad_()
    hidden = rows["hidden"].clone().requires_grad_()
    terms = big_call(rows, hidden, weight, bias, group)
    saved = {_storage(t): nbytes(t)
             for t in terms.loss_num.grad_fn.saved_tensors
             if t is not None and t.numel()}
    held = held_bytes(terms, [hidden, weight, bias, rows["target_ids"],
                              rows["weight_mask"]])
    (factor(rank) * terms.loss_num).backward()
    return {"saved": sum(saved.values()), "held": held,
            "shard": nbytes(weight), "hidden": nbytes(hidden),
            "grad_weight": weight.grad, "grad_bias": bias.grad,
            "grad_hidden": hidden.grad}


class HeldMemoryTest(unittest.TestCase):
    """A trainable head holds no weight-sized gradient from forward to
    backward (its weight side is made in backward): every tensor saved
    for the call, the caller's shards and rows included, comes to less
    than two of this rank's weight-gradient shards (the runs' W shards
    kept from forward came to W + 1 and more), and beyond the caller's
    tensors only the gradient of its hidden is held. Its gradients are the
    single process's (float32 1e-6)."""

    def check(self, world: int) -> None:
        got = ranks.run_ranks(held_rank, world, timeout=240)
        x = big_inputs(world)
        weight = x["weight"].clone().requires_grad_()
        bias = x["bias"].clone().requires_grad_()
        hiddens = [r["hidden"].clone().requires_grad_() for r in x["rows"]]
        loss = sum(factor(q) * big_call(rows, h, weight, bias, None).loss_num
                   for q, (rows, h) in enumerate(zip(x["rows"], hiddens)))
        loss.backward()
        for rank, result in enumerate(got):
            with self.subTest(world=world, rank=rank):
                self.assertLess(result["saved"], 2 * result["shard"])
                self.assertLessEqual(result["held"], result["hidden"])
                shard = slice(*vocab_cases._range(BIG_V, world, rank))
                for name, want in (("grad_weight", weight.grad[shard]),
                                   ("grad_bias", bias.grad[shard]),
                                   ("grad_hidden", hiddens[rank].grad)):
                    self.assertLess(
                        ranks.relative_error(result[name], want), 1e-6, name)

    def test_two_ranks(self):
        self.check(2)

    def test_four_ranks(self):
        self.check(4)


def backward_refusals(rank: int, world: int) -> List[str]:
    """A trainable call whose backward fails on rank 1 alone: its mask
    edited in place after forward (torch's error unpacking it), a
    MemoryError for its row buffers (both before the backward's status
    gather), then for the buffers of each of its W runs of the head in
    turn. Every rank's backward raises; then a good call and backward
    run."""
    group = dist.group.WORLD
    x = big_inputs(world)
    rows = x["rows"][rank]
    weight = shard_rows(x["weight"], group).requires_grad_()
    out = []
    for where in ["edited", "rows"] + [f"run {q}" for q in range(world)]:
        mask = rows["weight_mask"].clone()
        terms = big_call(dict(rows, weight_mask=mask), rows["hidden"],
                         weight, None, group)
        if rank == 1 and where == "edited":
            mask.mul_(1)
        real_rows, real_empty = parallel_module.rows_to_send, \
            objective_module._empty
        made = []

        def no_row_memory(*args, **kwargs):
            raise MemoryError("rows: injected")

        def no_run_memory(name, *args, **kwargs):
            if name == "the gradient of hidden":
                made.append(1)
                if f"run {len(made) - 1}" == where:
                    raise MemoryError(f"{name}: injected")
            return real_empty(name, *args, **kwargs)

        if rank == 1 and where == "rows":
            parallel_module.rows_to_send = no_row_memory
        elif rank == 1:
            objective_module._empty = no_run_memory
        try:
            terms.loss_num.backward()
            out.append(f"{where}: no error")
        except (MemoryError, RuntimeError, ValueError) as error:
            out.append(f"{where}: {type(error).__name__}: {error}")
        finally:
            parallel_module.rows_to_send = real_rows
            objective_module._empty = real_empty
    weight.grad = None
    big_call(rows, rows["hidden"], weight, None, group).loss_num.backward()
    out.append(f"after: {float(weight.grad.abs().sum())}")
    return out


class BackwardRefusalTest(unittest.TestCase):
    def test_every_rank_raises(self):
        got = ranks.run_ranks(backward_refusals, 3, timeout=120)
        for rank, lines in enumerate(got):
            with self.subTest(rank=rank, where="edited"):
                # torch's RuntimeError on rank 1, a ValueError naming it on
                # the others.
                self.assertIn(
                    "RuntimeError: one of the variables needed" if rank == 1
                    else "ValueError: vocab_shard: process 1 of 3 failed: "
                    "INVALID_ARGUMENT", lines[0])
            for line, where in zip(lines[1:], ["rows", "run 0", "run 1",
                                               "run 2"]):
                with self.subTest(rank=rank, where=where):
                    self.assertTrue(line.startswith(
                        f"{where}: MemoryError: "), line)
                    self.assertIn(
                        "injected" if rank == 1 else
                        "process 1 of 3 failed: RESOURCE_EXHAUSTED", line)
            self.assertTrue(lines[-1].startswith("after: "), lines[-1])
            self.assertGreater(float(lines[-1].split()[-1]), 0)


def forward_and_domino_refusals(rank: int, world: int) -> List[str]:
    """Two failures on rank 1 alone, each an error on every rank, then a
    good call and backward: a MemoryError for forward's reduce-scatter
    buffers (after the W runs); a frozen Domino head whose correction
    weight M trains, backward failing on rank 1 (its correction inputs
    edited in place after forward) before the factors' gather."""
    group = dist.group.WORLD
    x = big_inputs(world)
    rows = x["rows"][rank]
    weight = shard_rows(x["weight"], group)
    out = []
    real_pack = parallel_module.pack_rows

    def no_pack_memory(*args: Any, **kwargs: Any) -> Any:
        raise MemoryError("pack: injected")

    if rank == 1:
        parallel_module.pack_rows = no_pack_memory
    try:
        big_call(rows, rows["hidden"], weight, None, group)
        out.append("pack: no error")
    except (MemoryError, ValueError) as error:
        out.append(f"pack: {type(error).__name__}: {error}")
    finally:
        parallel_module.pack_rows = real_pack
    g = torch.Generator().manual_seed(31)
    m = shard_rows(torch.randn(BIG_V, 2, generator=g), group).requires_grad_()
    z = torch.randn(rows["hidden"].shape[:3] + (2,),
                    generator=torch.Generator().manual_seed(32 + rank))
    terms = dflash_objective(
        rows["hidden"], weight, rows["target_ids"], rows["weight_mask"],
        config=vocab_cases.CONFIGS["domino"], correction_inputs=z,
        correction_weight=m, threads=1, vocab_group=group, rows="local")
    if rank == 1:
        z.mul_(1)
    try:
        terms.loss_num.backward()
        out.append("domino: no error")
    except (RuntimeError, ValueError) as error:
        out.append(f"domino: {type(error).__name__}: {error}")
    good = shard_rows(x["weight"], group).requires_grad_()
    big_call(rows, rows["hidden"], good, None, group).loss_num.backward()
    out.append(f"after: {float(good.grad.abs().sum())}")
    return out


class ForwardAndDominoRefusalTest(unittest.TestCase):
    def test_every_rank_raises(self):
        got = ranks.run_ranks(forward_and_domino_refusals, 3, timeout=120)
        for rank, lines in enumerate(got):
            with self.subTest(rank=rank, where="pack"):
                self.assertTrue(lines[0].startswith("pack: MemoryError: "),
                                lines[0])
                self.assertIn("injected" if rank == 1 else
                              "process 1 of 3 failed: RESOURCE_EXHAUSTED",
                              lines[0])
            with self.subTest(rank=rank, where="domino"):
                self.assertIn(
                    "domino: RuntimeError: one of the variables needed"
                    if rank == 1 else "domino: ValueError: vocab_shard: "
                    "process 1 of 3 failed: INVALID_ARGUMENT", lines[1])
            self.assertTrue(lines[2].startswith("after: "), lines[2])
            self.assertGreater(float(lines[2].split()[-1]), 0)


def refusals(rank: int, world: int) -> List[str]:
    """Each refused call on this rank: its exception's type and message.
    After them a good call, which every rank completes."""
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(5 + rank)
    b = 1 + rank
    hidden = torch.randn(b, N, K, H, generator=g, dtype=torch.float64)
    targets = torch.randint(0, V, (b, N, K), generator=g)
    mask = torch.ones(b, N, K, dtype=torch.float64)
    weight = shard_rows(torch.randn(V, H, generator=torch.Generator()
                                    .manual_seed(3), dtype=torch.float64),
                        group)
    calls = {
        # rows="local" on rank 1 only.
        "one_rank_local": lambda: dflash_objective(
            hidden, weight, targets, mask, vocab_group=group,
            rows="local" if rank == 1 else "shared"),
        "top_k": lambda: dflash_objective(
            hidden, weight, targets, mask, vocab_group=group,
            rows="local", top_k=2 if rank == 0 else 0),
        "targets_shape": lambda: dflash_objective(
            hidden, weight, targets[:, :, :2] if rank == 1 else targets,
            mask, vocab_group=group, rows="local"),
        "unknown_rows": lambda: dflash_objective(
            hidden, weight, targets, mask, vocab_group=group,
            rows="mine" if rank == 0 else "local"),
        "empty_rows": lambda: dflash_objective(
            hidden[:0] if rank == 1 else hidden, weight,
            targets[:0] if rank == 1 else targets,
            mask[:0] if rank == 1 else mask, vocab_group=group,
            rows="local"),
    }
    out = []
    for name, fn in calls.items():
        try:
            fn()
            out.append(f"{name}: no error")
        except (ValueError, TypeError) as error:
            out.append(f"{name}: {type(error).__name__}: {error}")
    for run in range(world):
        # A MemoryError allocating one run's buffers on rank 1 alone.
        real_empty = objective_module._empty
        made = []

        def no_memory(name, *args, **kwargs):
            if name == "the gradient of hidden":
                made.append(1)
                if len(made) == run + 1:
                    raise MemoryError(f"{name}: injected")
            return real_empty(name, *args, **kwargs)

        if rank == 1:
            objective_module._empty = no_memory
        try:
            dflash_objective(hidden.clone().requires_grad_(), weight,
                             targets, mask, vocab_group=group, rows="local")
            out.append(f"no_memory_{run}: no error")
        except (MemoryError, RuntimeError) as error:
            out.append(f"no_memory_{run}: {type(error).__name__}: {error}")
        finally:
            objective_module._empty = real_empty
    head = FusedHead(torch.nn.Linear(H, weight.shape[0], bias=False,
                                     dtype=torch.float64),
                     vocab_group=group, rows="local")
    with torch.no_grad():
        head.lm_head.weight.copy_(weight)
    terms = head(hidden, targets, mask)
    out.append(f"after: {float(terms.loss_den)}")
    return out


class RefusalTest(unittest.TestCase):
    def test_every_rank_raises(self):
        got = ranks.run_ranks(refusals, 3, timeout=120)
        expected = {
            "one_rank_local": "rows option differs",
            "top_k": "rank(s) 0 of the group refused",
            "targets_shape": "rank(s) 1 of the group refused",
            "unknown_rows": "rank(s) 0 of the group refused",
            "empty_rows": "rank(s) 1 of the group refused",
        }
        own = {("top_k", 0): "top_k: rows='local' does not return top-k",
               ("targets_shape", 1): "target_ids: with rows='local' must",
               ("unknown_rows", 0): "rows: must be 'shared' or 'local'",
               ("empty_rows", 1): "hidden: rows='local' needs at least"}
        for rank, lines in enumerate(got):
            for run in range(3):
                line = lines[len(expected) + run]
                with self.subTest(rank=rank, no_memory_at_run=run):
                    # The others name rank 1 and its error's kind.
                    self.assertTrue(line.startswith(
                        f"no_memory_{run}: MemoryError: "), line)
                    self.assertIn(
                        "injected" if rank == 1 else
                        "process 1 of 3 failed: RESOURCE_EXHAUSTED", line)
            for line, (name, message) in zip(lines, expected.items()):
                with self.subTest(rank=rank, call=name):
                    self.assertTrue(line.startswith(name + ": ValueError"),
                                    line)
                    self.assertIn(own.get((name, rank), message), line)
            # The next call runs on every rank: the loss_den of its own
            # rows (every mask weight 1, position 0 excluded by gamma).
            self.assertTrue(lines[-1].startswith("after: "), lines[-1])
            self.assertGreater(float(lines[-1].split()[-1]), 0)

    def test_rows_without_group(self):
        with self.assertRaisesRegex(ValueError, "rows: must be 'shared'"):
            dflash_objective(torch.zeros(1, 1, 1, 2), torch.zeros(3, 2),
                             torch.zeros(1, 1, 1, dtype=torch.long),
                             torch.ones(1, 1, 1), rows="local")
        with self.assertRaisesRegex(ValueError, "rows: 'local' needs"):
            FusedHead(torch.nn.Linear(2, 3), rows="local")
        with self.assertRaisesRegex(ValueError, "rows: must be 'shared' or"):
            FusedHead(torch.nn.Linear(2, 3), rows=1)


if __name__ == "__main__":
    unittest.main(verbosity=2)
