"""dflash_objective with a low-rank logit correction against SpecForge's own
OnlineDSparkModel and OnlineDominoModel, through autograd: the goldens in
tests/goldens/specforge_dspark and specforge_domino (made by
tools/specforge_dspark_goldens.py from SpecForge's code) hold a token batch,
anchors, the draft's states, the frozen lm_head, the correction's inputs z
and weight M, and SpecForge's terms, loss and gradients. A caller's module
makes z; here z and M are leaves, so autograd hands back exactly d/dz and
d/dM. Then a vanilla Markov head (an embedding table, z = W1[prev]) trains
through z against a float64 reference that materialises the logits.
"""

import os
import unittest

import numpy as np
import torch
import torch.nn.functional as F

from dflash.torch import dflash_objective

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
DSPARK = os.path.join(ROOT, "tests", "goldens", "specforge_dspark")
DOMINO = os.path.join(ROOT, "tests", "goldens", "specforge_domino")

# terms.npy orders (tools/specforge_dspark_goldens.py).
DSPARK_LOSS, DSPARK_ACCURACY = 13, 14
(FINAL_NUM, BASE_NUM, LOSS_DEN, CORRECT, BASE_CORRECT, ACC_DEN, ACCEPT,
 BASE_ACCEPT, ACCEPT_DEN, DOMINO_LOSS, DOMINO_ACCURACY) = range(11)


def load(directory):
    arrays = {name[:-4]: np.load(os.path.join(directory, name))
              for name in os.listdir(directory) if name.endswith(".npy")}
    with open(os.path.join(directory, "config.textproto")) as f:
        arrays["config"] = f.read()
    return arrays


def cases(root):
    for name in sorted(os.listdir(root)):
        if os.path.isdir(os.path.join(root, name)):
            yield name, load(os.path.join(root, name))


def labels(g, block_size, offset, contiguous, skip_anchor):
    """The rows' targets and weight masks from their definitions: slot k
    predicts token anchor + offset + k; the mask is keep x in range x loss
    mask, cut at the first zero for DSpark (contiguous), without slot 0 for
    Domino without shift_label (skip_anchor)."""
    input_ids = torch.from_numpy(g["input_ids"])
    loss_mask = torch.from_numpy(g["loss_mask"]).double()
    anchors = torch.from_numpy(g["anchors"])
    keep = torch.from_numpy(g["keep"]).double()
    seq_len = input_ids.shape[1]
    index = anchors.unsqueeze(-1) + offset + torch.arange(block_size)
    in_range = (index < seq_len).double()
    index = index.clamp(max=seq_len - 1)
    rows = torch.arange(input_ids.shape[0]).view(-1, 1, 1)
    mask = keep.unsqueeze(-1) * in_range * loss_mask[rows, index]
    if contiguous:
        mask = mask.cumprod(-1)
    if skip_anchor:
        mask = mask * (torch.arange(block_size) > 0).double()
    return input_ids[rows, index], mask


def leaf(array, shape=None):
    t = torch.from_numpy(array).clone()
    if shape is not None:
        t = t.reshape(shape)
    return t.requires_grad_(True)


class CorrectionGoldensTest(unittest.TestCase):

    def run_case(self, g, offset, contiguous, skip_anchor):
        b, n = g["anchors"].shape
        h = g["hidden"].shape[1]
        k = g["hidden"].shape[0] // (b * n)
        hidden = leaf(g["hidden"], (b, n, k, h))
        weight = torch.from_numpy(g["weight"])
        target_ids, weight_mask = labels(g, k, offset, contiguous,
                                         skip_anchor)
        kwargs = {}
        if "correction_inputs" in g:
            r = g["correction_inputs"].shape[1]
            kwargs["correction_inputs"] = leaf(g["correction_inputs"],
                                               (b, n, k, r))
            kwargs["correction_weight"] = leaf(g["correction_weight"])
        if "teacher_hidden" in g:
            kwargs["teacher_hidden"] = torch.from_numpy(
                g["teacher_hidden"]).reshape(b, n, k, h)
        if "confidence_logits" in g:
            # float64, as the golden's: the float64 head reads them so.
            kwargs["confidence_logits"] = leaf(g["confidence_logits"],
                                               (b, n, k))
        terms = dflash_objective(hidden, weight, target_ids, weight_mask,
                                 config=g["config"], **kwargs)
        terms.loss.backward()
        return terms, hidden, kwargs

    def check_gradients(self, g, hidden, kwargs, rtol):
        torch.testing.assert_close(
            hidden.grad.reshape(-1, hidden.shape[-1]),
            torch.from_numpy(g["grad_hidden"]), rtol=rtol, atol=rtol)
        if "correction_inputs" in kwargs:
            z = kwargs["correction_inputs"]
            torch.testing.assert_close(
                z.grad.reshape(-1, z.shape[-1]),
                torch.from_numpy(g["grad_correction_inputs"]), rtol=rtol,
                atol=rtol)
            torch.testing.assert_close(
                kwargs["correction_weight"].grad,
                torch.from_numpy(g["grad_correction_weight"]), rtol=rtol,
                atol=rtol)
        if "confidence_logits" in kwargs:
            confidence = kwargs["confidence_logits"].grad
            self.assertEqual(confidence.dtype, torch.float64)
            torch.testing.assert_close(
                confidence.reshape(-1),
                torch.from_numpy(g["grad_confidence_logits"]), rtol=rtol,
                atol=rtol)

    def test_dspark(self):
        found = 0
        for name, g in cases(DSPARK):
            with self.subTest(case=name):
                found += 1
                terms, hidden, kwargs = self.run_case(g, 1, True, False)
                # SpecForge's float32 decay (gamma) is the one rounding
                # left; float64 confidence logits are read as they are.
                rtol = 3e-7 if "gamma" in g["config"] else 1e-12
                self.assertAlmostEqual(
                    float(terms.loss), g["terms"][DSPARK_LOSS],
                    delta=rtol * abs(g["terms"][DSPARK_LOSS]))
                self.assertAlmostEqual(float(terms.correct_num),
                                       g["terms"][4], delta=0)
                self.check_gradients(g, hidden, kwargs, rtol)
        self.assertGreaterEqual(found, 6)

    def test_domino(self):
        found = 0
        for name, g in cases(DOMINO):
            with self.subTest(case=name):
                found += 1
                shift = "shift_label: true" in g["config"]
                terms, hidden, kwargs = self.run_case(
                    g, 1 if shift else 0, False, not shift)
                t = g["terms"]
                rtol = 3e-7 if "gamma" in g["config"] else 1e-12
                self.assertAlmostEqual(float(terms.loss), t[DOMINO_LOSS],
                                       delta=rtol * abs(t[DOMINO_LOSS]))
                self.assertAlmostEqual(float(terms.diagnostics.ce_loss_num),
                                       t[FINAL_NUM],
                                       delta=rtol * abs(t[FINAL_NUM]))
                family = terms.diagnostics.family_terms
                self.assertAlmostEqual(family["base_num"], t[BASE_NUM],
                                       delta=rtol * abs(t[BASE_NUM]))
                for key, at in (("base_correct_num", BASE_CORRECT),
                                ("accept_num", ACCEPT),
                                ("base_accept_num", BASE_ACCEPT),
                                ("accept_den", ACCEPT_DEN)):
                    self.assertEqual(family[key], t[at], key)
                self.check_gradients(g, hidden, kwargs, rtol)
        self.assertGreaterEqual(found, 4)


class MarkovHeadTest(unittest.TestCase):
    """A vanilla Markov head, z = W1[prev], trained through the head's
    correction: its table's gradient (through z) and M's match a float64
    reference that materialises base + z @ M^T."""

    def test_markov_table_gradient_matches_materialised_logits(self):
        g = torch.Generator().manual_seed(5)
        b, n, k, h, v, r = 2, 3, 4, 8, 29, 3
        hidden = torch.randn(b, n, k, h, generator=g, dtype=torch.float64)
        weight = torch.randn(v, h, generator=g, dtype=torch.float64)
        table = torch.randn(v, r, generator=g, dtype=torch.float64)
        m = torch.randn(v, r, generator=g, dtype=torch.float64)
        prev = torch.randint(0, v, (b, n, k), generator=g)
        target = torch.randint(0, v, (b, n, k), generator=g)
        mask = (torch.rand(b, n, k, generator=g) > 0.2).double()
        config = ("loss { dspark { ce_weight: 1 l1_weight: 0 "
                  "confidence_weight: 0 } } chunking { blocks_per_chunk: 2 }")

        def run(use_dflash):
            w1 = table.clone().requires_grad_(True)
            w2 = m.clone().requires_grad_(True)
            z = F.embedding(prev, w1)
            if use_dflash:
                loss = dflash_objective(hidden, weight, target, mask,
                                        config=config, correction_inputs=z,
                                        correction_weight=w2).loss
            else:
                logits = hidden @ weight.T + z @ w2.T
                ce = F.cross_entropy(logits.reshape(-1, v), target.reshape(-1),
                                     reduction="none").reshape(b, n, k)
                loss = (ce * mask).sum() / mask.sum()
            loss.backward()
            return loss.detach(), w1.grad, w2.grad

        got, want = run(True), run(False)
        for a, e, what in zip(got, want, ("loss", "d/dW1", "d/dM")):
            torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-14,
                                       msg=what)


if __name__ == "__main__":
    unittest.main()
