"""dflash_objective's per-row outputs beyond the loss, against float64
references written here with plain loops over materialised logits:
domino's base argmax (and the accepted lengths SpecForge main's base head
gets from it through accepted_prefix_lengths and
walk_accepted_length_terms), and the teacher's argmax.
"""

import unittest

import torch

from dflash.torch import (accepted_prefix_lengths, dflash_objective,
                          walk_accepted_length_terms)

B, N, K, H, V, R = 2, 4, 4, 8, 29, 3


def batch(seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, N, K, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    bias = torch.randn(V, generator=g, dtype=torch.float64)
    z = torch.randn(B, N, K, R, generator=g, dtype=torch.float64)
    m = torch.randn(V, R, generator=g, dtype=torch.float64)
    ids = torch.randint(0, V, (B, N, K), generator=g)
    mask = (torch.rand(B, N, K, generator=g) > 0.2).double()
    return [t.to(dtype) if t.is_floating_point() else t
            for t in (hidden, weight, bias, z, m)] + [ids, mask]


def naive_argmax(logits_of, mask):
    """[B, N, K] ids of the largest logit (the lower id on a tie), -1
    where the row has no mask, one row at a time in float64."""
    out = torch.full((B, N, K), -1, dtype=torch.int64)
    for b in range(B):
        for n in range(N):
            for k in range(K):
                if mask[b, n, k] <= 0:
                    continue
                row = logits_of(b, n, k)
                best = 0
                for v in range(1, V):
                    if row[v] > row[best]:
                        best = v
                out[b, n, k] = best
    return out


def naive_prefix_walk(pred, target, supervised, positions):
    """Each block's leading run of supervised hits, walked along its
    sequence's anchors (SpecForge main's base-head accepted length), in
    float64 loops."""
    total, visits = 0.0, 0.0
    for b in range(pred.shape[0]):
        resume = 0
        for n in range(pred.shape[1]):
            slots = range(pred.shape[2])
            if not any(bool(supervised[b, n, p]) for p in slots):
                continue
            length = 0
            while (length < pred.shape[2] and bool(supervised[b, n, length])
                   and int(pred[b, n, length]) == int(target[b, n, length])):
                length += 1
            if positions[b, n] < resume:
                continue
            total += length + 1.0
            visits += 1.0
            resume = int(positions[b, n]) + length + 1
    return total, visits


class DominoBaseArgmaxTest(unittest.TestCase):
    def run_domino(self, dtype, domino="lambda_base: 0.3"):
        hidden, weight, bias, z, m, ids, mask = batch(3, dtype)
        terms = dflash_objective(
            hidden, weight, ids, mask, lm_head_bias=bias,
            correction_inputs=z, correction_weight=m, return_rows=True,
            config=f"loss {{ domino {{ {domino} }} }}", chunk_blocks=2)
        return terms.diagnostics, (hidden, weight, bias, z, m, ids, mask)

    def test_base_argmax_of_the_materialised_base_logits(self):
        for domino in ("lambda_base: 0.3",
                       "shift_label: true pure_draft_prefix_len: 1"):
            with self.subTest(domino=domino):
                d, (hidden, weight, bias, _, _, _, mask) = self.run_domino(
                    torch.float64, domino)
                base = hidden @ weight.T + bias
                want = naive_argmax(lambda b, n, k: base[b, n, k].tolist(),
                                    mask)
                self.assertEqual(d.base_argmax.dtype, torch.int64)
                self.assertEqual(d.base_argmax.tolist(), want.tolist())

    def test_other_families_have_none(self):
        hidden, weight, bias, _, _, ids, mask = batch(4)
        d = dflash_objective(hidden, weight, ids, mask, lm_head_bias=bias,
                             return_rows=True).diagnostics
        self.assertEqual(d.base_argmax.tolist(),
                         torch.full((B, N, K), -1).tolist())
        self.assertIsNone(dflash_objective(
            hidden, weight, ids, mask,
            lm_head_bias=bias).diagnostics.base_argmax)

    def test_base_head_accepted_lengths(self):
        d, (hidden, weight, bias, _, _, ids, mask) = self.run_domino(
            torch.float64)
        base = hidden @ weight.T + bias
        want_ids = naive_argmax(lambda b, n, k: base[b, n, k].tolist(), mask)
        # Domino predicts slots 1..K-1 and supervises mask > 0.
        supervised = mask[..., 1:] > 0
        positions = torch.arange(N).mul(K + 1).expand(B, N)
        accepted = accepted_prefix_lengths(
            d.base_argmax[..., 1:], ids[..., 1:], supervised)
        got = walk_accepted_length_terms(accepted, positions,
                                         supervised.any(-1))
        want = naive_prefix_walk(want_ids[..., 1:], ids[..., 1:], supervised,
                                 positions)
        self.assertEqual((float(got[0]), float(got[1])), want)
        self.assertGreater(want[1], 0)


class TeacherArgmaxTest(unittest.TestCase):
    def test_teacher_argmax_of_the_materialised_teacher_logits(self):
        hidden, weight, bias, _, _, ids, mask = batch(5)
        teacher = torch.randn(B, N, K, H, dtype=torch.float64,
                              generator=torch.Generator().manual_seed(6))
        confidence = torch.randn(B, N, K,
                                 generator=torch.Generator().manual_seed(7))
        logits = teacher @ weight.T + bias
        want = naive_argmax(lambda b, n, k: logits[b, n, k].tolist(), mask)
        self.assertGreater(int((want >= 0).sum()), 0)
        for name, kw in (
                ("dflash diagnostics", {}),
                ("dspark", dict(loss_type="dspark",
                                confidence_logits=confidence)),
                ("distillation", dict(
                    config="loss { distillation { divergence: FORWARD_KL "
                           "temperature: 2 } }")),
                ("softcap", dict(
                    config="head { logit_softcap: 3 } loss { dflash {} }"))):
            for mode in ("fused", "checkpoint"):
                with self.subTest(name=name, mode=mode):
                    d = dflash_objective(
                        hidden, weight, ids, mask, lm_head_bias=bias,
                        teacher_hidden=teacher, return_rows=True,
                        mode=mode, chunk_blocks=2, **kw).diagnostics
                    self.assertEqual(d.teacher_argmax.dtype, torch.int64)
                    self.assertEqual(d.teacher_argmax.tolist(),
                                     want.tolist())

    def test_without_a_teacher(self):
        hidden, weight, bias, _, _, ids, mask = batch(8)
        d = dflash_objective(hidden, weight, ids, mask, lm_head_bias=bias,
                             return_rows=True).diagnostics
        self.assertEqual(d.teacher_argmax.tolist(),
                         torch.full((B, N, K), -1).tolist())
        self.assertIsNone(dflash_objective(
            hidden, weight, ids, mask,
            lm_head_bias=bias).diagnostics.teacher_argmax)


if __name__ == "__main__":
    unittest.main()
