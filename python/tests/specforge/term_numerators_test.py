"""dflash.torch.separate_numerators: several numerators of one head call,
each differentiable.

Domino's final and base CE numerators (a low-rank correction z @ M^T on the
final logits) and DSpark's CE and L1 numerators, each against a float64
reference that materialises the logits, and against central finite
differences: gradients for incoming weights proportional to the run's
coefficients (no second head call), other positive weights (one more) and
weights of both signs (two more). Runs under any torch dflash supports.
"""

import unittest

import torch
import torch.nn.functional as F

from dflash.torch import dflash_objective, separate_numerators

B, N, K, H, V, R = 2, 2, 4, 6, 13, 3
SUFFIX_START = 1  # Domino without shift_label: the correction from k = 1.


def data():
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(B, N, K, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    z = torch.randn(B, N, K, R, generator=g, dtype=torch.float64)
    z[:, :, :SUFFIX_START] = 0
    m = torch.randn(V, R, generator=g, dtype=torch.float64)
    teacher = torch.randn(B, N, K, H, generator=g, dtype=torch.float64)
    target = torch.randint(0, V, (B, N, K), generator=g)
    mask = (torch.rand(B, N, K, generator=g) > 0.2).double()
    return hidden, weight, z, m, teacher, target, mask


class Counted:
    """A NumeratorRun that counts its calls."""

    def __init__(self, run):
        self.run, self.calls = run, 0

    def __call__(self, coefficients, inputs):
        self.calls += 1
        return self.run(coefficients, inputs)


def domino_run(weight, target, mask):
    def run(coefficients, inputs):
        hidden, z, m = inputs
        total = coefficients[0] + coefficients[1]
        config = ("loss { domino { lambda_base: %r } }"
                  % (coefficients[1] / total))
        terms = dflash_objective(hidden, weight, target, mask, config=config,
                                 correction_inputs=z, correction_weight=m)
        return (terms.loss_num * total,
                [terms.diagnostics.ce_loss_num,
                 terms.diagnostics.family_terms["base_num"]], terms)
    return run


def domino_reference(hidden, weight, z, m, target, mask):
    base = hidden @ weight.T
    keep = (torch.arange(K) >= SUFFIX_START).double().view(1, 1, K, 1)
    final = base + (z * keep) @ m.T

    def ce(logits):
        return F.cross_entropy(logits.reshape(-1, V), target.reshape(-1),
                               reduction="none").reshape(B, N, K)
    return (ce(final) * mask).sum(), (ce(base) * mask).sum()


def dspark_run(weight, teacher, target, mask):
    def run(coefficients, inputs):
        (hidden,) = inputs
        config = ("loss { dspark { ce_weight: %r l1_weight: %r "
                  "confidence_weight: 0 } }" % tuple(coefficients))
        terms = dflash_objective(hidden, weight, target, mask, config=config,
                                 teacher_hidden=teacher)
        return (terms.loss_num,
                [terms.diagnostics.ce_loss_num,
                 terms.diagnostics.family_terms["l1_loss_num"]], terms)
    return run


def dspark_reference(hidden, weight, teacher, target, mask):
    logits = hidden @ weight.T
    ce = F.cross_entropy(logits.reshape(-1, V), target.reshape(-1),
                         reduction="none").reshape(B, N, K)
    l1 = (torch.softmax(logits, -1)
          - torch.softmax(teacher @ weight.T, -1)).abs().sum(-1)
    return (ce * mask).sum(), (l1 * mask).sum()


# (incoming weights, head calls): proportional to the run's coefficients,
# other positive weights, both signs, none.
def weight_cases(coefficients):
    a, b = coefficients
    return (((3 * a, 3 * b), 1), ((a + 1, b), 2), ((1.5, -0.7), 3),
            ((0.0, -2.0), 2), ((0.0, 0.0), 1))


class SeparateNumeratorsTest(unittest.TestCase):

    def check(self, run, reference, leaves, coefficients, tolerance=1e-12):
        want_values = reference(*leaves)
        for weights, calls in weight_cases(coefficients):
            with self.subTest(weights=weights):
                inputs = [t.clone().requires_grad_() for t in leaves]
                counted = Counted(run)
                numerators, _ = separate_numerators(
                    counted, coefficients, inputs, [torch.float64] * 2)
                for got, want in zip(numerators, want_values):
                    self.assertEqual(got.dtype, torch.float64)
                    self.assertTrue(got.requires_grad)
                    torch.testing.assert_close(got, want.detach(),
                                               rtol=tolerance, atol=0)
                loss = weights[0] * numerators[0] + weights[1] * numerators[1]
                grads = torch.autograd.grad(loss, inputs)
                self.assertEqual(counted.calls, calls)
                reference_inputs = [t.clone().requires_grad_()
                                    for t in leaves]
                values = reference(*reference_inputs)
                want = torch.autograd.grad(
                    weights[0] * values[0] + weights[1] * values[1],
                    reference_inputs, allow_unused=True)
                for got, expected in zip(grads, want):
                    expected = (torch.zeros_like(got) if expected is None
                                else expected)
                    scale = max(expected.abs().max().item(), 1e-300)
                    torch.testing.assert_close(got, expected,
                                               rtol=tolerance,
                                               atol=tolerance * scale)
                self.finite_differences(run, coefficients, leaves, weights,
                                        grads)

    def finite_differences(self, run, coefficients, leaves, weights, grads):
        """A few coordinates of each input's gradient against central
        differences of the combined numerators (run without gradients)."""
        def combined(values):
            with torch.no_grad():
                numerators, _ = separate_numerators(
                    run, coefficients, values, [torch.float64] * 2)
            return float(weights[0] * numerators[0]
                         + weights[1] * numerators[1])

        step = 1e-6
        for i, leaf in enumerate(leaves):
            flat = leaf.reshape(-1)
            for j in (0, flat.numel() // 2, flat.numel() - 1):
                up = [t.clone() for t in leaves]
                down = [t.clone() for t in leaves]
                up[i].view(-1)[j] += step
                down[i].view(-1)[j] -= step
                estimate = (combined(up) - combined(down)) / (2 * step)
                self.assertAlmostEqual(grads[i].reshape(-1)[j].item(),
                                       estimate, delta=1e-5)

    def test_domino_final_and_base(self):
        hidden, weight, z, m, _, target, mask = data()
        self.check(domino_run(weight, target, mask),
                   lambda h, zz, mm: domino_reference(h, weight, zz, mm,
                                                      target, mask),
                   [hidden, z, m], [0.7, 0.3])

    def test_dspark_ce_and_l1(self):
        hidden, weight, _, _, teacher, target, mask = data()
        self.check(dspark_run(weight, teacher, target, mask),
                   lambda h: dspark_reference(h, weight, teacher, target,
                                              mask),
                   [hidden], [0.1, 0.9])

    def test_float32_gradients_within_their_rounding_are_proportional(self):
        # SpecForge's DSpark L1 numerator is float32: its incoming gradient
        # 0.9 / den rounds to float32, the CE one (float64) does not.
        hidden, weight, _, _, teacher, target, mask = data()
        run = Counted(dspark_run(weight, teacher, target, mask))
        inputs = [hidden.clone().requires_grad_()]
        (ce, l1), _ = separate_numerators(
            run, [0.1, 0.9], inputs, [torch.float64, torch.float32])
        self.assertEqual(l1.dtype, torch.float32)
        (ce * 0.1 / 48 + l1 * 0.9 / 48).backward()
        self.assertEqual(run.calls, 1)
        # Off by more than float32's rounding: recomputed.
        run.calls = 0
        inputs = [hidden.clone().requires_grad_()]
        (ce, l1), _ = separate_numerators(
            run, [0.1, 0.9], inputs, [torch.float64, torch.float32])
        (ce * 0.1 + l1 * 0.9 * (1 + 1e-5)).backward()
        self.assertEqual(run.calls, 2)

    def test_zero_coefficients(self):
        # Every coefficient 0 (SpecForge's lambda or alphas may make one):
        # the run takes the first numerator's; any gradient is recomputed.
        hidden, weight, z, m, _, target, mask = data()
        self.check(domino_run(weight, target, mask),
                   lambda h, zz, mm: domino_reference(h, weight, zz, mm,
                                                      target, mask),
                   [hidden, z, m], [0.0, 0.0])

    def test_without_gradients(self):
        hidden, weight, _, _, teacher, target, mask = data()
        run = Counted(dspark_run(weight, teacher, target, mask))
        numerators, terms = separate_numerators(
            run, [0.1, 0.9], [hidden], [torch.float64, torch.float32])
        self.assertEqual(run.calls, 1)
        self.assertFalse(any(t.requires_grad for t in numerators))
        self.assertEqual([t.dtype for t in numerators],
                         [torch.float64, torch.float32])
        self.assertIs(type(terms).__name__, "ObjectiveTerms")

    def test_bad_arguments(self):
        hidden, weight, _, _, teacher, target, mask = data()
        run = dspark_run(weight, teacher, target, mask)
        f64 = [torch.float64] * 2
        with self.assertRaisesRegex(ValueError, r"coefficients\[1\]: must "
                                    r"be finite and >= 0, got -0\.5"):
            separate_numerators(run, [0.1, -0.5], [hidden], f64)
        with self.assertRaisesRegex(ValueError, r"coefficients\[0\]: must "
                                    r"be finite and >= 0, got nan"):
            separate_numerators(run, [float("nan"), 0.5], [hidden], f64)
        with self.assertRaisesRegex(TypeError, r"coefficients\[0\]: must be "
                                    r"a float, got True"):
            separate_numerators(run, [True, 0.5], [hidden], f64)
        with self.assertRaisesRegex(ValueError, r"coefficients: 1 given for "
                                    r"2 numerators"):
            separate_numerators(run, [0.1], [hidden], f64)
        with self.assertRaisesRegex(TypeError, r"dtypes\[1\]: must be a "
                                    r"floating dtype, got torch.int64"):
            separate_numerators(run, [0.1, 0.9], [hidden],
                                [torch.float64, torch.int64])
        with self.assertRaisesRegex(ValueError, r"inputs: at least one "
                                    r"tensor is needed"):
            separate_numerators(run, [0.1, 0.9], [None], f64)
        with self.assertRaisesRegex(ValueError, r"run returned 2 numerators "
                                    r"for 3 dtypes"):
            separate_numerators(
                lambda c, inputs: (inputs[0].sum(), [1.0, 2.0], None),
                [0.1, 0.9, 0.0], [hidden], [torch.float64] * 3)


if __name__ == "__main__":
    unittest.main(verbosity=2)
