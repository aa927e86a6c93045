"""Inputs as SpecForge hands them: chunk views of a longer batch (slices of a
[B, N, K, H] tensor along N, and of its targets, masks, teacher states,
confidence logits and correction inputs alike), transposed and expanded
masks. dflash_objective takes them without the caller copying, on both
torch paths (the torch.library operator and torch 1.13's
autograd.Function): terms and gradients equal to the same call on
contiguous copies, and to the float64 reference (reference.py); the
gradient lands in the slice of the longer tensor. What stays refused (a
non-contiguous weight) raises naming the tensor."""

import contextlib
import unittest
from unittest import mock

import torch

import reference
from dflash.torch import _library, dflash_objective

FAMILIES = {f.name: f for f in reference.FAMILIES}
B, N, K, H, V, R = 2, 3, 4, 8, 13, 3
# The chunk [A, A + N) of a batch of N_BIG blocks.
N_BIG, A = 6, 2


def paths():
    """The torch paths this torch has: the operator (torch >= 2.4) and the
    autograd.Function (every torch; forced where the operator exists)."""
    found = [("function", mock.patch.object(_library, "SUPPORTED", False))]
    if _library.SUPPORTED:
        found.insert(0, ("operator", contextlib.nullcontext()))
    return found


def big_batch(seed):
    """reference.batch's tensors for N_BIG blocks, and a correction's."""
    data = reference.batch(seed, B=B, N=N_BIG, K=K, H=H, V=V)
    g = torch.Generator().manual_seed(seed + 1)
    data["z"] = torch.randn(B, N_BIG, K, R, generator=g, dtype=torch.float64)
    data["m"] = 0.3 * torch.randn(V, R, generator=g, dtype=torch.float64)
    data["confidence"] = data["confidence"].float()
    return data


def chunk(t):
    """SpecForge's chunk view: blocks [A, A + N) along dim 1, in place."""
    return t[:, A:A + N]


class ChunkViewsTest(unittest.TestCase):

    def run_case(self, family, view, correction=False, top_k=0):
        """dflash_objective on chunk views of a longer batch (`view`) or on
        contiguous copies of them; the terms, and the gradients of the longer
        leaves (hidden, confidence, z) and of the weight."""
        f = FAMILIES[family]
        data = big_batch(3)
        hidden = data["hidden"].clone().requires_grad_()
        weight = data["weight"].clone().requires_grad_()
        confidence = data["confidence"].clone().requires_grad_()
        z = data["z"].clone().requires_grad_()
        take = chunk if view else (lambda t: chunk(t).contiguous())
        kwargs = {}
        if f.teacher:
            kwargs["teacher_hidden"] = take(data["teacher"])
        if f.confidence:
            kwargs["confidence_logits"] = take(confidence)
        if correction:
            kwargs.update(correction_inputs=take(z), correction_weight=data["m"])
        x = take(hidden)
        ids, mask = take(data["target_ids"]), take(data["weight_mask"])
        self.assertEqual(x.is_contiguous(), not view)
        self.assertEqual(ids.is_contiguous(), not view)
        terms = dflash_objective(
            x, weight, ids, mask, config=f.config_text("FUSED", 2, 2),
            top_k=top_k, **kwargs)
        objective = terms.loss
        if top_k:
            objective = objective + terms.diagnostics.top_k_values.sum()
        objective.backward()
        grads = [hidden.grad, weight.grad,
                 confidence.grad if f.confidence else None,
                 z.grad if correction else None]
        return terms, grads

    def test_chunk_views_equal_contiguous_copies_on_both_paths(self):
        cases = [("dflash", False, 3), ("dspark", False, 0),
                 ("dflash", True, 3), ("dpace", False, 0)]
        for path, context in paths():
            for family, correction, top_k in cases:
                with self.subTest(path=path, family=family,
                                  correction=correction), context:
                    got, got_grads = self.run_case(family, True, correction,
                                                   top_k)
                    want, want_grads = self.run_case(family, False,
                                                     correction, top_k)
                    for name, a, b in zip(("loss_num", "loss_den",
                                           "correct_num", "accuracy_den"),
                                          got[:4], want[:4]):
                        self.assertTrue(torch.equal(a, b), name)
                    if top_k:
                        self.assertTrue(torch.equal(
                            got.diagnostics.top_k_values,
                            want.diagnostics.top_k_values))
                    for name, a, b in zip(("hidden", "weight", "confidence",
                                           "z"), got_grads, want_grads):
                        if b is None:
                            self.assertIsNone(a, name)
                            continue
                        self.assertTrue(torch.equal(a, b), f"d/d{name}")
                    # The gradient lands in the chunk's blocks alone.
                    outside = torch.ones(N_BIG, dtype=torch.bool)
                    outside[A:A + N] = False
                    self.assertEqual(
                        float(got_grads[0][:, outside].abs().sum()), 0.0)
                    self.assertGreater(
                        float(chunk(got_grads[0]).abs().sum()), 0.0)

    def test_chunk_view_against_the_float64_reference(self):
        f = FAMILIES["dspark"]
        data = big_batch(5)
        for path, context in paths():
            with self.subTest(path=path), context:
                hidden = data["hidden"].clone().requires_grad_()
                terms = dflash_objective(
                    chunk(hidden), data["weight"], chunk(data["target_ids"]),
                    chunk(data["weight_mask"]),
                    config=f.config_text("FUSED", 2, 2),
                    teacher_hidden=chunk(data["teacher"]),
                    confidence_logits=chunk(data["confidence"]))
                (terms.loss_num / terms.loss_den).backward()
                ref_hidden = chunk(data["hidden"]).clone().requires_grad_()
                want = reference.objective(
                    f, ref_hidden, data["weight"],
                    chunk(data["target_ids"]).contiguous(),
                    chunk(data["weight_mask"]).contiguous(),
                    teacher=chunk(data["teacher"]).contiguous(),
                    confidence=chunk(data["confidence"]).double())
                (want[0] / want[1]).backward()
                for name, a, b in zip(("loss_num", "loss_den"), terms[:2],
                                      want[:2]):
                    torch.testing.assert_close(a, b.detach(), rtol=1e-12,
                                               atol=1e-12, msg=name)
                torch.testing.assert_close(chunk(hidden.grad), ref_hidden.grad,
                                           rtol=1e-10, atol=1e-12)


class MaskViewsTest(unittest.TestCase):

    def call(self, mask, ids):
        data = reference.batch(7, B=B, N=N, K=K, H=H, V=V)
        hidden = data["hidden"].clone().requires_grad_()
        terms = dflash_objective(hidden, data["weight"], ids, mask,
                                 config=FAMILIES["dflash"].config_text(
                                     "FUSED", 2, 2), return_rows=True)
        terms.loss.backward()
        return terms, hidden.grad

    def test_transposed_and_expanded_masks_and_targets(self):
        data = reference.batch(7, B=B, N=N, K=K, H=H, V=V)
        ids = data["target_ids"]
        per_position = torch.tensor([0.0, 1.0, 1.0 / 3.0, 0.5],
                                    dtype=torch.float64)
        masks = {
            # A mask stored [N, B, K] and seen as [B, N, K].
            "transposed": data["weight_mask"].double().transpose(0, 1)
            .contiguous().transpose(0, 1),
            # One weight per position, broadcast (stride 0) over B and N.
            "expanded": per_position.expand(B, N, K),
            "bool slice": torch.ones(B, N + 2, K, dtype=torch.bool)[:, 1:-1],
        }
        stored_ids = ids.transpose(0, 1).contiguous().transpose(0, 1)
        for path, context in paths():
            for name, mask in masks.items():
                with self.subTest(path=path, mask=name), context:
                    self.assertFalse(mask.is_contiguous())
                    got, got_grad = self.call(mask, stored_ids)
                    want, want_grad = self.call(mask.contiguous(), ids)
                    for a, b in zip(got[:4], want[:4]):
                        self.assertTrue(torch.equal(a, b))
                    self.assertTrue(torch.equal(got.diagnostics.loss_weight,
                                                want.diagnostics.loss_weight))
                    self.assertTrue(torch.equal(got_grad, want_grad))


class RefusedViewsTest(unittest.TestCase):

    def test_non_contiguous_weights_name_the_tensor(self):
        data = reference.batch(9, B=B, N=N, K=K, H=H, V=V)
        weight_t = data["weight"].t().contiguous().t()  # Column-major.
        z = torch.zeros(B, N, K, R, dtype=torch.float64)
        m = torch.zeros(R, V, dtype=torch.float64).t()
        cases = {
            "lm_head_weight": dict(lm_head_weight=weight_t),
            "correction_weight": dict(correction_inputs=z,
                                      correction_weight=m),
        }
        for path, context in paths():
            for name, kwargs in cases.items():
                with self.subTest(path=path, tensor=name), context:
                    args = dict(hidden=data["hidden"],
                                lm_head_weight=data["weight"],
                                target_ids=data["target_ids"],
                                weight_mask=data["weight_mask"])
                    args.update(kwargs)
                    with self.assertRaisesRegex(
                            ValueError,
                            f"^{name}: must be contiguous .*got strides"):
                        dflash_objective(**args)


if __name__ == "__main__":
    unittest.main()
