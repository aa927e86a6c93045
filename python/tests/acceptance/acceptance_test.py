"""dflash.torch's accepted-length metrics (accepted_prefix_lengths,
walk_accepted_length_terms, hard_label_prefix_counts) against SpecForge
main's own functions, run by tools/specforge_main_goldens.py on the head's
batches (tests/goldens/specforge_main/acceptance_*: SpecForge took the
argmax and top-k from full float64 logits, here they come from
dflash_objective's per-row outputs), and against a naive reference written
here: plain Python loops over blocks and slots, float64 sums.
"""

import os
import random
import unittest

import numpy as np
import torch

from dflash.torch import (PrefixCounts, accepted_prefix_lengths,
                          dflash_objective, hard_label_prefix_counts,
                          walk_accepted_length_terms)

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                    "..")
GOLDENS = os.path.join(ROOT, "tests", "goldens", "specforge_main")
TOP_K = 3  # tools/specforge_main_goldens.py's ACCEPTANCE_TOP_K.
CHUNK = 2  # Its ACCEPTANCE_CHUNK: blocks a chunk of the scatter.
CORRECT_NUM = 4  # terms.npy's correct_num.


def naive_lengths(pred, target, supervised):
    """[B][N] leading run of supervised hits, block by block."""
    result = []
    for pb, tb, sb in zip(pred.tolist(), target.tolist(), supervised.tolist()):
        row = []
        for p, t, s in zip(pb, tb, sb):
            length = 0
            while length < len(p) and s[length] and p[length] == t[length]:
                length += 1
            row.append(float(length))
        result.append(row)
    return torch.tensor(result, dtype=torch.float64).reshape(pred.shape[:2])


def naive_walk(accepted, positions, valid):
    total, visits = 0.0, 0
    for counts, anchors, ok in zip(accepted.tolist(), positions.tolist(),
                                   valid.tolist()):
        next_free = 0
        for count, anchor, is_valid in zip(counts, anchors, ok):
            if not is_valid or anchor < next_free:
                continue
            total += count + 1
            visits += 1
            next_free = anchor + count + 1
    return total, float(visits)


def naive_prefix(pred, target, supervised, covered, selector):
    """Reached/accepted/eligible per slot, from each block's slots in order."""
    b, n, p = supervised.shape
    reached = [[0.0] * (p + 1) for _ in range(3)]
    accepted = [[0.0] * (p + 1) for _ in range(3)]
    sel_covered, sel_unary, eligible = ([0.0] * (p + 1) for _ in range(3))
    for i in range(b):
        for j in range(n):
            s = supervised[i, j].tolist()
            hits = [(pred[i, j] == target[i, j]).tolist(), covered[i, j].tolist(),
                    None if selector is None
                    else (selector[i, j] == target[i, j]).tolist()]
            for row, hit in enumerate(hits):
                if hit is None:
                    continue
                alive = True
                for k in range(p):
                    if alive and s[k]:
                        reached[row][k + 1] += 1
                        if row == 2:
                            sel_covered[k + 1] += covered[i, j, k].item()
                            sel_unary[k + 1] += hits[0][k]
                    alive = alive and s[k] and hit[k]
                    accepted[row][k + 1] += alive
            for k in range(p):
                if not all(s[:k + 1]):
                    break
                eligible[k + 1] += 1
    return reached, accepted, sel_covered, sel_unary, eligible


def random_case(seed, b=3, n=6, p=4, vocab=3):
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(0, vocab, (b, n, p), generator=g)
    pred = torch.where(torch.rand(b, n, p, generator=g) < 0.7, target,
                       torch.randint(0, vocab, (b, n, p), generator=g))
    supervised = torch.rand(b, n, p, generator=g) < 0.85
    supervised[torch.rand(b, n, generator=g) < 0.2] = False
    pred = torch.where(supervised, pred, torch.full_like(pred, -1))
    covered = torch.rand(b, n, p, generator=g) < 0.8
    selector = torch.where(torch.rand(b, n, p, generator=g) < 0.7, target,
                           torch.randint(0, vocab, (b, n, p), generator=g))
    gaps = torch.randint(0, 4, (b, n), generator=g)
    positions = gaps.cumsum(dim=1)
    return pred, target, supervised, covered, selector, positions


def golden_cases():
    for name in sorted(os.listdir(GOLDENS)):
        if name.startswith("acceptance_"):
            directory = os.path.join(GOLDENS, name)
            arrays = {f[:-4]: np.load(os.path.join(directory, f))
                      for f in os.listdir(directory) if f.endswith(".npy")}
            yield name, directory, arrays


class GoldenTest(unittest.TestCase):
    """SpecForge main's values, from dflash's argmax and top-k."""

    def test_goldens(self):
        names = []
        for name, directory, g in golden_cases():
            names.append(name)
            with self.subTest(case=name):
                target = torch.from_numpy(g["target_ids"])
                mask = torch.from_numpy(g["weight_mask"])
                hidden = torch.from_numpy(g["hidden"]).reshape(
                    *target.shape, -1)
                terms = dflash_objective(
                    hidden, torch.from_numpy(g["weight"]), target, mask,
                    config=os.path.join(directory, "config.textproto"),
                    return_rows=True, top_k=TOP_K)
                d = terms.diagnostics
                self.assertEqual(float(terms.correct_num),
                                 g["terms"][CORRECT_NUM])
                pred, slots = d.argmax[..., 1:], target[..., 1:]
                supervised = mask[..., 1:] > 0.5
                n = target.shape[1]
                index = torch.arange(n).unsqueeze(0)
                selector = torch.from_numpy(g["selector_ids"])
                for prefix, ids in (("", pred), ("selector_", selector)):
                    # Chunk by chunk into sampled-anchor order, as main.
                    accepted = sum(
                        accepted_prefix_lengths(
                            ids[:, c:c + CHUNK], slots[:, c:c + CHUNK],
                            supervised[:, c:c + CHUNK],
                            block_index=index[:, c:c + CHUNK], total_blocks=n)
                        for c in range(0, n, CHUNK))
                    self.assertEqual(accepted.dtype, torch.float32)
                    self.assertEqual(accepted.tolist(),
                                     g[prefix + "block_accepted"].tolist())
                    self.assertEqual(
                        accepted_prefix_lengths(ids, slots, supervised).tolist(),
                        g[prefix + "block_accepted"].tolist())
                    walk = walk_accepted_length_terms(
                        accepted, torch.from_numpy(g["anchor_positions"]),
                        supervised.any(dim=-1))
                    self.assertEqual([float(v) for v in walk],
                                     g[prefix + "walk"].tolist())
                counts = hard_label_prefix_counts(
                    pred, slots, supervised, d.target_is_candidate[..., 1:],
                    selector)
                for field, array in (
                        ("reached", "prefix_reached"),
                        ("accepted", "prefix_accepted"),
                        ("selector_covered", "selector_prefix_covered"),
                        ("selector_unary_correct",
                         "selector_prefix_unary_correct"),
                        ("eligible", "prefix_eligible")):
                    value = getattr(counts, field)
                    self.assertEqual(value.dtype, torch.float32)
                    self.assertEqual(value.tolist(), g[array].tolist(), field)
        self.assertEqual(len(names), 3, names)


class ReferenceTest(unittest.TestCase):
    """Against the naive reference: random batches and edge cases."""

    def check(self, pred, target, supervised, covered, selector, positions,
              valid=None):
        accepted = accepted_prefix_lengths(pred, target, supervised)
        expected = naive_lengths(pred, target, supervised)
        self.assertEqual(accepted.tolist(), expected.tolist())
        valid = supervised.any(dim=-1) if valid is None else valid
        for dtype in (torch.float32, torch.float64):
            total, visits = walk_accepted_length_terms(
                accepted.to(dtype), positions, valid)
            self.assertEqual((total.dtype, visits.dtype), (dtype, dtype))
            self.assertEqual((total.shape, visits.shape),
                             (torch.Size([]), torch.Size([])))
            self.assertEqual((float(total), float(visits)),
                             naive_walk(expected, positions, valid))
        for sel in (selector, None):
            counts = hard_label_prefix_counts(pred, target, supervised,
                                              covered, sel)
            self.assertIsInstance(counts, PrefixCounts)
            reached, acc, sel_cov, sel_unary, eligible = naive_prefix(
                pred, target, supervised, covered, sel)
            self.assertEqual(counts.reached.tolist(), reached)
            self.assertEqual(counts.accepted.tolist(), acc)
            self.assertEqual(counts.selector_covered.tolist(), sel_cov)
            self.assertEqual(counts.selector_unary_correct.tolist(), sel_unary)
            self.assertEqual(counts.eligible.tolist(), eligible)

    def test_random_batches(self):
        for seed in range(40):
            with self.subTest(seed=seed):
                rng = random.Random(seed)
                self.check(*random_case(seed, b=rng.randint(1, 4),
                                        n=rng.randint(1, 7),
                                        p=rng.randint(1, 5)))

    def test_no_valid_blocks(self):
        pred, target, _, covered, selector, positions = random_case(1)
        supervised = torch.zeros_like(covered)
        self.check(pred, target, supervised, covered, selector, positions)
        total, visits = walk_accepted_length_terms(
            torch.zeros(3, 6), positions, supervised.any(dim=-1))
        self.assertEqual((float(total), float(visits)), (0.0, 0.0))

    def test_all_blocks_valid(self):
        pred, target, _, covered, selector, positions = random_case(2)
        supervised = torch.ones_like(covered)
        positions = torch.arange(6).repeat(3, 1) * 10  # No overlaps.
        self.check(pred, target, supervised, covered, selector, positions)
        accepted = accepted_prefix_lengths(target, target, supervised)
        total, visits = walk_accepted_length_terms(accepted, positions,
                                                   supervised.any(dim=-1))
        self.assertEqual((float(total), float(visits)), (18 * 5.0, 18.0))

    def test_anchors_inside_an_accepted_walk(self):
        # Worked by hand: anchors 0, 2, 3, 7, 9 accepting 1, 3, 0, 1, 3.
        # 0 takes 2 tokens (resume at 2); 2 takes 4 (resume at 6); 3 lies
        # inside that run; 7 takes 2 (resume at 9); 9 takes 4.
        total, visits = walk_accepted_length_terms(
            torch.tensor([[1.0, 3, 0, 1, 3]]), torch.tensor([[0, 2, 3, 7, 9]]),
            torch.ones(1, 5, dtype=torch.bool))
        self.assertEqual((float(total), float(visits)), (12.0, 4.0))
        # An invalid anchor is not visited and does not move the walk.
        total, visits = walk_accepted_length_terms(
            torch.tensor([[5.0, 3, 0, 1, 3]]), torch.tensor([[0, 2, 3, 7, 9]]),
            torch.tensor([[False, True, True, True, True]]))
        self.assertEqual((float(total), float(visits)), (10.0, 3.0))

    def test_one_anchor(self):
        # A sequence with one kept anchor; the dropped ones sit at 0 (as
        # SpecForge leaves them) and are not visited.
        total, visits = walk_accepted_length_terms(
            torch.tensor([[2.0, 7, 7], [0, 0, 0]]),
            torch.tensor([[4, 0, 0], [3, 0, 0]]),
            torch.tensor([[True, False, False], [True, False, False]]))
        self.assertEqual((float(total), float(visits)), (4.0, 2.0))

    def test_unweighted_rows_argmax_minus_one(self):
        # dflash's argmax is -1 where the head did not weigh a row; off the
        # supervised rows the prediction does not matter.
        pred, target, supervised, covered, selector, positions = random_case(3)
        other = torch.where(supervised, pred, target)
        for f in (lambda p: accepted_prefix_lengths(p, target, supervised),
                  lambda p: hard_label_prefix_counts(
                      p, target, supervised, covered, selector).reached):
            self.assertEqual(f(pred).tolist(), f(other).tolist())

    def test_scatter_order_and_batch_broadcast(self):
        target = torch.tensor([[[1, 2], [3, 4]], [[1, 2], [3, 4]]])
        supervised = torch.tensor([[[True, True], [True, False]],
                                   [[False, True], [True, True]]])
        for index in (torch.tensor([[4, 1]]), torch.tensor([[4, 1], [4, 1]])):
            out = accepted_prefix_lengths(target, target, supervised,
                                          block_index=index, total_blocks=6)
            self.assertEqual(out.tolist(), [[0, 1, 0, 0, 2, 0],
                                            [0, 2, 0, 0, 0, 0]])


class BadInputTest(unittest.TestCase):

    def setUp(self):
        self.ids = torch.zeros(2, 3, 4, dtype=torch.long)
        self.mask = torch.ones(2, 3, 4, dtype=torch.bool)

    def assert_raises(self, error, name, f, *args, **kwargs):
        with self.assertRaises(error) as raised:
            f(*args, **kwargs)
        self.assertIn(name, str(raised.exception))

    def test_accepted_prefix_lengths(self):
        ids, mask = self.ids, self.mask
        f = accepted_prefix_lengths
        self.assert_raises(TypeError, "predicted_ids", f, [0], ids, mask)
        self.assert_raises(TypeError, "predicted_ids", f, ids.float(), ids,
                           mask)
        self.assert_raises(TypeError, "target_ids", f, ids, mask, mask)
        self.assert_raises(TypeError, "supervised", f, ids, ids, mask.float())
        self.assert_raises(ValueError, "target_ids", f, ids, ids[:, :2], mask)
        self.assert_raises(ValueError, "supervised", f, ids, ids, mask[0])
        self.assert_raises(ValueError, "predicted_ids", f, ids[0], ids[0],
                           mask[0])
        index = torch.arange(3).unsqueeze(0)
        self.assert_raises(ValueError, "total_blocks", f, ids, ids, mask,
                           block_index=index)
        self.assert_raises(ValueError, "total_blocks", f, ids, ids, mask,
                           total_blocks=3)
        self.assert_raises(TypeError, "total_blocks", f, ids, ids, mask,
                           block_index=index, total_blocks=3.0)
        self.assert_raises(TypeError, "block_index", f, ids, ids, mask,
                           block_index=index.float(), total_blocks=3)
        self.assert_raises(ValueError, "block_index", f, ids, ids, mask,
                           block_index=index[:, :2], total_blocks=3)
        self.assert_raises(ValueError, "block_index", f, ids, ids, mask,
                           block_index=index.repeat(3, 1), total_blocks=3)
        self.assert_raises(ValueError, "block_index", f, ids, ids, mask,
                           block_index=index + 1, total_blocks=3)
        self.assert_raises(ValueError, "block_index", f, ids, ids, mask,
                           block_index=index - 1, total_blocks=3)

    def test_walk_accepted_length_terms(self):
        accepted = torch.zeros(2, 3)
        positions = torch.zeros(2, 3, dtype=torch.long)
        valid = torch.ones(2, 3, dtype=torch.bool)
        f = walk_accepted_length_terms
        self.assert_raises(TypeError, "accepted", f, None, positions, valid)
        self.assert_raises(TypeError, "accepted", f, valid, positions, valid)
        self.assert_raises(TypeError, "anchor_positions", f, accepted,
                           accepted, valid)
        self.assert_raises(TypeError, "valid", f, accepted, positions,
                           accepted)
        self.assert_raises(ValueError, "anchor_positions", f, accepted,
                           positions[:, :2], valid)
        self.assert_raises(ValueError, "valid", f, accepted, positions,
                           valid[:1])
        self.assert_raises(ValueError, "accepted", f, accepted[0],
                           positions[0], valid[0])

    def test_hard_label_prefix_counts(self):
        ids, mask = self.ids, self.mask
        f = hard_label_prefix_counts
        self.assert_raises(TypeError, "target_is_candidate", f, ids, ids, mask,
                           ids)
        self.assert_raises(TypeError, "selector_ids", f, ids, ids, mask, mask,
                           mask)
        self.assert_raises(ValueError, "selector_ids", f, ids, ids, mask, mask,
                           ids[:, :1])
        self.assert_raises(ValueError, "target_is_candidate", f, ids, ids,
                           mask, mask[:1])
        self.assert_raises(TypeError, "supervised", f, ids, ids, ids, mask)


if __name__ == "__main__":
    unittest.main()
