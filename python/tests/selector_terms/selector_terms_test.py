"""dflash.torch.selector (selector_terms, selector_position_terms,
selector_greedy_terms) against SpecForge main's own DFlash2 selector code,
run by tools/specforge_main_goldens.py in float64
(tests/goldens/specforge_main/selector_*: main's `_selector_chunk_terms` on
its own top-k, its metric chunk terms with the target model's states),
against a naive float64 loop reference, and one test per rejected input.
The goldens' stand-in selector is written here from its definition (the
README of the goldens), and run on dflash_objective's top-k, as a
SpecForge user runs theirs.
"""

import math
import os
import unittest

import numpy as np
import torch

from dflash.torch import dflash_objective, hard_label_prefix_counts
from dflash.torch.selector import (SelectorGreedyTerms, SelectorPositionTerms,
                                   SelectorTerms, selector_greedy_terms,
                                   selector_position_terms, selector_terms)

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                    "..")
GOLDENS = os.path.join(ROOT, "tests", "goldens", "specforge_main")
# selector_terms.npy's order: main's DFlashObjectiveTerms selector fields.
SELECTOR_FIELDS = ("ce_num", "probability_num", "correct_num", "weight_den",
                   "covered_num")
# terms.npy's loss_num and loss_den (tools/specforge_main_goldens.py TERMS).
LOSS_DEN, LOSS_NUM = 2, 6


def relative(actual, expected):
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    scale = max(np.abs(expected).max(initial=0.0), 1e-300)
    return float(np.abs(actual - expected).max(initial=0.0) / scale)


def golden_cases():
    for name in sorted(os.listdir(GOLDENS)):
        if name.startswith("selector_"):
            directory = os.path.join(GOLDENS, name)
            arrays = {f[:-4]: np.load(os.path.join(directory, f))
                      for f in os.listdir(directory) if f.endswith(".npy")}
            yield name, directory, arrays


class StandIn:
    """The goldens' selector: a candidate's score is 0.7 times its unary
    logit plus its embedding row against hidden @ proj plus the
    predecessor's embedding row; the greedy path feeds each slot's pick to
    the next slot, starting from the anchor token."""

    def __init__(self, embed, proj):
        self.embed = torch.from_numpy(embed)
        self.proj = torch.from_numpy(proj)

    def score(self, candidate_ids, values, hidden, predecessor_ids):
        context = hidden @ self.proj + self.embed[predecessor_ids]
        return 0.7 * values + (self.embed[candidate_ids]
                               * context.unsqueeze(-2)).sum(-1)

    def greedy_path(self, candidate_ids, values, hidden, anchor_ids):
        previous, path = anchor_ids, []
        for slot in range(candidate_ids.shape[-2]):
            scores = self.score(candidate_ids[..., slot, :],
                                values[..., slot, :], hidden[..., slot, :],
                                previous)
            previous = candidate_ids[..., slot, :].gather(
                -1, scores.argmax(-1, keepdim=True)).squeeze(-1)
            path.append(previous)
        return torch.stack(path, dim=-1)


class GoldenTest(unittest.TestCase):
    """SpecForge main's values, float64."""

    def test_selector_terms_on_mains_inputs(self):
        """What main's _selector_chunk_terms was given: its terms within
        1e-12, d(ce_num)/d(selector logits) within 1e-12."""
        names = []
        for name, _, g in golden_cases():
            names.append(name)
            with self.subTest(case=name):
                logits = torch.from_numpy(g["selector_logits"])
                logits.requires_grad_()
                terms = selector_terms(
                    logits, torch.from_numpy(g["selector_candidate_ids"]),
                    torch.from_numpy(g["target_ids"]),
                    torch.from_numpy(g["selector_loss_weights"]),
                    torch.from_numpy(g["weight_mask"]))
                self.assertIsInstance(terms, SelectorTerms)
                for field, want in zip(SELECTOR_FIELDS, g["selector_terms"]):
                    value = getattr(terms, field)
                    self.assertEqual(value.dtype, torch.float64, field)
                    self.assertEqual(value.dim(), 0, field)
                    self.assertLess(relative(value.detach(), want), 1e-12,
                                    field)
                grad, = torch.autograd.grad(terms.ce_num, logits)
                self.assertLess(relative(grad, g["selector_grad_logits"]),
                                1e-12)
        self.assertEqual(len(names), 3, names)

    def test_through_the_head(self):
        """The head's top-k (float64), the stand-in run on it, then
        selector_terms, selector_position_terms and selector_greedy_terms:
        main's selector terms, loss with selector_loss_alpha,
        d(loss)/d(hidden),
        the per-position selector metrics, the greedy path's terms and the
        teacher terms, within 1e-9 (the head's loss_weight is float64, so
        D-PACE's weights are exact too). The teacher and unary metrics
        within 1e-12."""
        for name, directory, g in golden_cases():
            with self.subTest(case=name):
                self.check_case(name, directory, g)

    def check_case(self, name, directory, g):
        alpha, stop_gradient, k = g["selector_settings"]
        k = int(k)
        target = torch.from_numpy(g["target_ids"])
        mask = torch.from_numpy(g["weight_mask"])
        hidden = torch.from_numpy(g["hidden"]).reshape(*target.shape, -1)
        teacher = torch.from_numpy(g["teacher_hidden"]).reshape(hidden.shape)
        weight = torch.from_numpy(g["weight"])
        config = os.path.join(directory, "config.textproto")
        hidden.requires_grad_()
        terms = dflash_objective(hidden, weight, target, mask, config=config,
                                 teacher_hidden=teacher, top_k=k,
                                 return_rows=True)
        d = terms.diagnostics
        weighted = mask > 0
        ids = d.top_k
        self.assertTrue(torch.equal(
            ids[weighted],
            torch.from_numpy(g["selector_candidate_ids"])[weighted]))
        self.assertLess(relative(
            d.top_k_values.detach()[weighted],
            g["selector_unary_logits"][weighted.numpy()]), 1e-12)
        tol = 1e-9
        self.assertEqual(d.loss_weight.dtype, torch.float64)
        selector = StandIn(g["selector_embed"], g["selector_proj"])
        values, states = d.top_k_values, hidden
        if stop_gradient:
            values, states = values.detach(), states.detach()
        predecessor = torch.cat([target[..., :1], target[..., :-1]], dim=-1)
        logits = selector.score(ids.clamp(min=0), values, states, predecessor)
        sel = selector_terms(logits, ids, target, d.loss_weight, mask)
        for field, want in zip(SELECTOR_FIELDS, g["selector_terms"]):
            self.assertLess(relative(getattr(sel, field).detach(), want), tol,
                            field)
        self.assertLess(
            relative(terms.loss_num.detach(), g["terms"][LOSS_NUM]), 1e-12)
        loss = (terms.loss_num + alpha * sel.ce_num) / terms.loss_den
        self.assertLess(relative(loss.detach(), g["selector_loss"][0]), tol)
        grad, = torch.autograd.grad(loss, hidden)
        self.assertLess(relative(grad.reshape(-1, grad.shape[-1]),
                                 g["selector_grad_hidden"]), tol)

        # The metric pass: main's per-position selector terms.
        position = selector_position_terms(
            logits.detach(), ids, target, d.loss_weight, mask)
        self.assertIsInstance(position, SelectorPositionTerms)
        for field, array in (("ce_num", "selector_ce_num"),
                             ("weight_den", "selector_weight_den"),
                             ("conditional_correct_num",
                              "selector_conditional_correct_num"),
                             ("covered_den", "selector_covered_den")):
            self.assertLess(relative(getattr(position, field),
                                     g["metric_" + array]), tol, field)
        # The greedy path over slots 1..K-1 of the weighted blocks, and the
        # target model's argmax from the same head call.
        with torch.no_grad():
            greedy = selector.greedy_path(
                ids[:, :, 1:].clamp(min=0), d.top_k_values[:, :, 1:],
                hidden[:, :, 1:], target[:, :, 0])
        teacher_ids = d.teacher_argmax
        # Equal on the weighted slots (the head's ids are -1 on the others;
        # the goldens have no unweighted slot before a weighted one).
        slots = mask[..., 1:] > 0
        self.assertTrue(torch.equal(
            greedy[slots], torch.from_numpy(g["selector_greedy_ids"])[slots]))
        walked = selector_greedy_terms(greedy, target, mask, teacher_ids)
        self.assertIsInstance(walked, SelectorGreedyTerms)
        for field, array in (
                ("correct_num", "selector_greedy_correct_num"),
                ("accepted_length_num", "greedy_accepted_length_num"),
                ("teacher_agreement_num",
                 "teacher_selector_greedy_agreement_num")):
            self.assertEqual(getattr(walked, field).tolist(),
                             g["metric_" + array].tolist(), field)
        counts = hard_label_prefix_counts(
            d.argmax[..., 1:], target[..., 1:], mask[..., 1:] > 0.5,
            d.target_is_candidate[..., 1:], greedy)
        for field, array in (
                ("reached", "prefix_reached_num"),
                ("accepted", "prefix_accepted_num"),
                ("selector_covered", "selector_prefix_covered_num"),
                ("selector_unary_correct",
                 "selector_prefix_unary_correct_num"),
                ("eligible", "prefix_eligible_num")):
            self.assertEqual(getattr(counts, field).tolist(),
                             g["metric_" + array].tolist(), field)

        # Item (b): main's unary and teacher metric terms against the head's
        # float64 CPU numerators (metric top-k = the selector's).
        metrics = d.metrics
        for ours, array in (
                ("teacher_acceptance_per_position",
                 "teacher_expected_acceptance_num"),
                ("teacher_agreement_per_position",
                 "teacher_unary_top1_agreement_num"),
                ("teacher_top_k_mass_per_position",
                 "teacher_unary_topk_mass_num"),
                ("teacher_expected_accepted_length_num",
                 "teacher_expected_accepted_length_num"),
                ("target_probability_per_position",
                 "hard_label_probability_num"),
                ("top_k_recall_per_position", "unary_topk_recall_num"),
                ("top_k_mass_per_position", "unary_topk_mass_num"),
                ("expected_accepted_length_num",
                 "expected_accepted_length_num"),
                ("oracle_accepted_length_num", "oracle_accepted_length_num"),
                ("block_den", "block_den")):
            self.assertLess(relative(metrics[ours], g["metric_" + array]),
                            1e-12, ours)
        # Main weighs the unary argmax's hits by the mask (0.5 counts half);
        # position_correct counts hits where the mask > 0.5 (correct_num's
        # rule), so main's is the caller's sum over the head's argmax.
        self.assertEqual(
            ((d.argmax == target).double() * mask).sum(dim=(0, 1)).tolist(),
            g["metric_unary_correct_num"].tolist())
        self.assertLess(relative(metrics["loss_weight_per_position"],
                                 g["metric_loss_weight_num"]), tol)
        self.assertLess(relative(d.position_den, g["metric_position_den"]),
                        1e-12)


def naive_selector(logits, candidates, targets, weights, mask):
    """Row by row in Python floats: the five terms, the per-position terms
    ([K] for [B, N, K] rows) and d(ce_num)/d(logits)."""
    flat = logits.reshape(-1, logits.shape[-1]).tolist()
    cands = candidates.reshape(-1, candidates.shape[-1]).tolist()
    tgts, ws, ms = (t.reshape(-1).tolist() for t in (targets, weights, mask))
    k_slots = targets.shape[-1]
    totals = [0.0] * 5
    positions = [[0.0] * k_slots for _ in range(4)]
    grad = []
    for r, (row, cand, t, w, m) in enumerate(zip(flat, cands, tgts, ws, ms)):
        slot = r % k_slots
        index = cand.index(t) if t in cand else 0
        covered = 1.0 if t in cand else 0.0
        top = max(row)
        log_sum = top + math.log(sum(math.exp(x - top) for x in row))
        ce = log_sum - row[index]
        pick = cand[max(range(len(row)), key=lambda j: (row[j], -j))]
        hit = 1.0 if pick == t else 0.0
        for i, value in enumerate(
                (ce * w * covered, math.exp(-ce) * m * covered,
                 hit * w * covered, w * covered, m * covered)):
            totals[i] += value
        for i, value in enumerate((ce * w * covered, w * covered,
                                   hit * m * covered, m * covered)):
            positions[i][slot] += value
        grad.append([w * covered * (math.exp(x - log_sum) - (j == index))
                     for j, x in enumerate(row)])
    return totals, positions, torch.tensor(grad, dtype=torch.float64).reshape(
        logits.shape)


def random_case(seed, b=2, n=3, k_slots=4, k=5, vocab=9, covered=0.6):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, n, k_slots, k, generator=gen, dtype=torch.float64)
    candidates = torch.stack([torch.randperm(vocab, generator=gen)[:k]
                              for _ in range(b * n * k_slots)]).reshape(
                                  b, n, k_slots, k)
    pick = torch.randint(0, k, (b, n, k_slots), generator=gen)
    targets = candidates.gather(-1, pick.unsqueeze(-1)).squeeze(-1)
    outside = torch.rand(b, n, k_slots, generator=gen) > covered
    # A target outside every candidate set of the batch.
    targets = torch.where(outside, torch.full_like(targets, vocab), targets)
    mask = (torch.rand(b, n, k_slots, generator=gen) > 0.2).double()
    mask[..., 0] = 0
    mask[0, 0, 1] = 0.5
    weights = mask * torch.rand(b, n, k_slots, generator=gen,
                                dtype=torch.float64)
    return logits, candidates, targets, weights, mask


class ReferenceTest(unittest.TestCase):
    """Against the naive float64 loop: random batches and edge cases."""

    def check(self, logits, candidates, targets, weights, mask):
        leaf = logits.clone().requires_grad_()
        terms = selector_terms(leaf, candidates, targets, weights, mask)
        totals, positions, grad = naive_selector(logits, candidates, targets,
                                                 weights, mask)
        for field, want in zip(SELECTOR_FIELDS, totals):
            value = getattr(terms, field)
            self.assertEqual(value.dtype, torch.float64, field)
            self.assertLess(abs(float(value.detach()) - want),
                            1e-12 * max(abs(want), 1.0), field)
        if terms.ce_num.requires_grad:
            actual, = torch.autograd.grad(terms.ce_num, leaf)
        else:
            actual = torch.zeros_like(logits)
        self.assertLess(float((actual - grad).abs().max()), 1e-12)
        position = selector_position_terms(logits, candidates, targets,
                                           weights, mask)
        for field, want in zip(SelectorPositionTerms._fields, positions):
            want = torch.tensor(want, dtype=torch.float64)
            error = (getattr(position, field) - want).abs().max()
            self.assertLess(float(error), 1e-12, field)

    def test_random_batches(self):
        for seed in range(12):
            with self.subTest(seed=seed):
                self.check(*random_case(seed, k=1 + seed % 6))

    def test_no_candidate_covers_the_target(self):
        logits, candidates, targets, weights, mask = random_case(3, covered=0)
        self.check(logits, candidates, targets, weights, mask)
        terms = selector_terms(logits.requires_grad_(), candidates, targets,
                               weights, mask)
        self.assertEqual([float(v.detach()) for v in terms], [0.0] * 5)
        grad, = torch.autograd.grad(terms.ce_num, logits)
        self.assertEqual(float(grad.abs().max()), 0.0)

    def test_all_masked(self):
        logits, candidates, targets, weights, mask = random_case(4)
        self.check(logits, candidates, targets, weights * 0, mask * 0)
        terms = selector_terms(logits, candidates, targets, weights * 0,
                               mask * 0)
        self.assertEqual([float(v) for v in terms], [0.0] * 5)

    def test_heads_unweighted_rows(self):
        """The head's -1 ids on unweighted rows match no target, and the
        row's CE is computed (main's is too) but weighs nothing."""
        logits, candidates, targets, weights, mask = random_case(5)
        mask[1, 2] = 0
        weights[1, 2] = 0
        candidates[1, 2] = -1
        self.check(logits, candidates, targets, weights, mask)

    def test_ties_pick_the_first_candidate(self):
        logits, candidates, targets, weights, mask = random_case(6)
        logits[...] = 1.0  # Every score tied: main's argmax takes slot 0.
        self.check(logits, candidates, targets, weights, mask)

    def test_dtypes(self):
        """Float32 logits and weights stay float32 (main's CE is float32);
        bfloat16 logits take their CE in float32, as main's `.float()`."""
        logits, candidates, targets, weights, mask = random_case(7)
        terms = selector_terms(logits.float(), candidates, targets,
                               weights.float(), mask.float())
        self.assertEqual({t.dtype for t in terms}, {torch.float32})
        want = selector_terms(logits, candidates, targets, weights, mask)
        for got, expected in zip(terms, want):
            self.assertLess(abs(float(got) - float(expected)),
                            1e-5 * max(abs(float(expected)), 1.0))
        half = selector_terms(logits.bfloat16(), candidates, targets,
                              weights.float(), mask.float())
        self.assertEqual(half.ce_num.dtype, torch.float32)
        mixed = selector_terms(logits.float(), candidates, targets, weights,
                               mask)
        self.assertEqual(mixed.ce_num.dtype, torch.float64)

    def test_greedy_terms(self):
        """Against a loop: per-slot hits and teacher agreement times the
        mask, and 1 + the leading supervised run over valid blocks."""
        gen = torch.Generator().manual_seed(8)
        b, n, k_slots, vocab = 3, 4, 5, 3
        targets = torch.randint(0, vocab, (b, n, k_slots), generator=gen)
        greedy = torch.randint(0, vocab, (b, n, k_slots - 1), generator=gen)
        teacher = torch.randint(0, vocab, (b, n, k_slots), generator=gen)
        mask = (torch.rand(b, n, k_slots, generator=gen) > 0.2).double()
        mask[0, 1, 2] = 0.5
        mask[2] = 0
        correct, agree, length = [0.0] * k_slots, [0.0] * k_slots, 0.0
        for bi in range(b):
            for ni in range(n):
                run, alive, valid = 0, True, False
                for s in range(1, k_slots):
                    m = float(mask[bi, ni, s])
                    hit = int(greedy[bi, ni, s - 1]) == int(targets[bi, ni, s])
                    correct[s] += m * hit
                    agree[s] += m * (int(greedy[bi, ni, s - 1])
                                     == int(teacher[bi, ni, s]))
                    valid |= m > 0.5
                    alive = alive and m > 0.5 and hit
                    run += alive
                length += (1 + run) if valid else 0
        terms = selector_greedy_terms(greedy, targets, mask, teacher)
        self.assertEqual(terms.correct_num.tolist(), correct)
        self.assertEqual(terms.teacher_agreement_num.tolist(), agree)
        self.assertEqual(float(terms.accepted_length_num), length)
        self.assertEqual(terms.accepted_length_num.dtype, torch.float32)
        self.assertIsNone(selector_greedy_terms(greedy, targets, mask)
                          .teacher_agreement_num)


class RejectionTest(unittest.TestCase):
    """One test per rejected input: the error names the argument."""

    def setUp(self):
        self.args = list(random_case(9))

    def rejects(self, index, value, error, words):
        args = list(self.args)
        args[index] = value
        with self.assertRaises(error) as raised:
            selector_terms(*args)
        for word in words:
            self.assertIn(word, str(raised.exception))

    def test_logits_not_a_tensor(self):
        self.rejects(0, self.args[0].tolist(), TypeError,
                     ("selector_logits", "torch.Tensor"))

    def test_integer_logits(self):
        self.rejects(0, self.args[0].long(), TypeError,
                     ("selector_logits", "floating"))

    def test_logits_without_candidates_axis(self):
        self.rejects(0, self.args[0][0, 0, 0], ValueError,
                     ("selector_logits", "k >= 1"))

    def test_logits_with_no_candidates(self):
        self.rejects(0, self.args[0][..., :0], ValueError,
                     ("selector_logits", "k >= 1"))

    def test_float_candidate_ids(self):
        self.rejects(1, self.args[1].double(), TypeError,
                     ("candidate_ids", "integer"))

    def test_candidate_ids_shape(self):
        self.rejects(1, self.args[1][..., :2], ValueError,
                     ("candidate_ids", "shape"))

    def test_bool_target_ids(self):
        self.rejects(2, self.args[2] > 0, TypeError, ("target_ids", "integer"))

    def test_target_ids_shape(self):
        self.rejects(2, self.args[2][:, :1], ValueError,
                     ("target_ids", "shape"))

    def test_bool_loss_weights(self):
        self.rejects(3, self.args[3] > 0, TypeError,
                     ("loss_weights", "floating"))

    def test_loss_weights_shape(self):
        self.rejects(3, self.args[3][0], ValueError, ("loss_weights", "shape"))

    def test_bool_weight_mask(self):
        self.rejects(4, self.args[4] > 0, TypeError,
                     ("weight_mask", "floating", "weight_mask.float()"))

    def test_weight_mask_shape(self):
        self.rejects(4, self.args[4].unsqueeze(0), ValueError,
                     ("weight_mask", "shape"))

    def test_devices_differ(self):
        self.rejects(4, self.args[4].to("meta"), ValueError,
                     ("weight_mask", "meta", "one device"))

    def test_position_terms_need_blocks(self):
        args = [a.reshape(-1, *a.shape[3:]) for a in self.args]
        with self.assertRaises(ValueError) as raised:
            selector_position_terms(*args)
        self.assertIn("[B, N, K]", str(raised.exception))

    def test_greedy_ids_shape(self):
        targets, mask = self.args[2], self.args[4]
        with self.assertRaises(ValueError) as raised:
            selector_greedy_terms(targets, targets, mask)
        self.assertIn("greedy_ids", str(raised.exception))

    def test_greedy_float_ids(self):
        targets, mask = self.args[2], self.args[4]
        with self.assertRaises(TypeError) as raised:
            selector_greedy_terms(targets[..., 1:].double(), targets, mask)
        self.assertIn("greedy_ids", str(raised.exception))

    def test_greedy_targets_without_predicted_slots(self):
        targets, mask = self.args[2][..., :1], self.args[4][..., :1]
        with self.assertRaises(ValueError) as raised:
            selector_greedy_terms(targets[..., :0], targets, mask)
        self.assertIn("K >= 2", str(raised.exception))

    def test_greedy_teacher_ids_shape(self):
        targets, mask = self.args[2], self.args[4]
        with self.assertRaises(ValueError) as raised:
            selector_greedy_terms(targets[..., 1:], targets, mask,
                                  targets[..., 1:])
        self.assertIn("teacher_ids", str(raised.exception))

    def test_greedy_bool_mask(self):
        targets, mask = self.args[2], self.args[4]
        with self.assertRaises(TypeError) as raised:
            selector_greedy_terms(targets[..., 1:], targets, mask > 0)
        self.assertIn("weight_mask", str(raised.exception))


if __name__ == "__main__":
    unittest.main()
