"""The DFlash2 selector's inputs from dflash_objective: the strict top-k of
the loss's logits as ids and differentiable values (in hidden's dtype,
float64 exact), whether and where the target is among them, and the rows'
loss weights; against plain torch on materialised logits (float64), in
every mode, frozen and trainable, on both torch paths (the torch.library
operator and the autograd.Function)."""

import contextlib
import unittest
from unittest import mock

import torch

from dflash.torch import _library, dflash_objective

B, N, K, H, V, TOP_K = 2, 3, 4, 8, 37, 5


def paths():
    """The torch paths this torch has: the operator (torch >= 2.4) and the
    autograd.Function (every torch; forced where the operator exists)."""
    found = [("function", mock.patch.object(_library, "SUPPORTED", False))]
    if _library.SUPPORTED:
        found.insert(0, ("operator", contextlib.nullcontext()))
    return found


@contextlib.contextmanager
def counting_values_backward():
    """Counts the top-k values' backward runs in [0] (both torch paths run
    objective._top_k_value_backward)."""
    from dflash.torch import objective
    calls = [0]
    original = objective._top_k_value_backward

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    with mock.patch.object(objective, "_top_k_value_backward", counted):
        yield calls


def batch(seed):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, N, K, H, generator=gen, dtype=torch.float64)
    weight = torch.randn(V, H, generator=gen, dtype=torch.float64) * 0.5
    bias = torch.randn(V, generator=gen, dtype=torch.float64) * 0.1
    target_ids = torch.randint(0, V, (B, N, K), generator=gen)
    weight_mask = (torch.rand(B, N, K, generator=gen) > 0.25).double()
    weight_mask[:, :, 0] = 0
    # Some targets among the top-k: plant them as the row's argmax.
    logits = hidden @ weight.T + bias
    target_ids[0, 0] = logits[0, 0].argmax(-1)
    return hidden, weight, bias, target_ids, weight_mask


def reference(hidden, weight, bias, target_ids, weight_mask, cap, probe):
    """SpecForge's computation on materialised logits: dflash CE with
    gamma 7, top-k of the transformed logits, a probe objective on them."""
    logits = hidden @ weight.T + bias
    z = cap * torch.tanh(logits / cap)
    nlq = torch.nn.functional.cross_entropy(
        z.reshape(-1, V), target_ids.reshape(-1), reduction="none"
    ).reshape(B, N, K)
    k = torch.arange(K, dtype=torch.float64)
    w = weight_mask * torch.exp(-(k - 1).clamp(min=0) / 7.0)
    loss = (nlq * w).sum() / w.sum()
    values, ids = z.topk(TOP_K, dim=-1)
    supervised = (weight_mask > 0).unsqueeze(-1)
    objective = loss + (values * probe * supervised).sum()
    return objective, ids, values, w


class SelectorInputsTest(unittest.TestCase):

    def test_top_k_ids_values_and_their_gradients(self):
        cap = 6.0
        cases = [(path, context, mode, trainable)
                 for path, context in paths()
                 for mode in ("fused", "checkpoint", "materialize")
                 for trainable in (False, True)]
        for path, context, mode, trainable in cases:
            with self.subTest(path=path, mode=mode,
                              trainable=trainable), context:
                hidden, weight, bias, target_ids, weight_mask = batch(3)
                probe = torch.randn(B, N, K, TOP_K, dtype=torch.float64,
                                    generator=torch.Generator()
                                    .manual_seed(5))
                leaves = [t.clone().requires_grad_(i == 0 or trainable)
                          for i, t in enumerate((hidden, weight, bias))]
                config = (f"head {{ logit_softcap: {cap} }} "
                          "loss { dflash { gamma: 7 } }")
                terms = dflash_objective(
                    leaves[0], leaves[1], target_ids, weight_mask,
                    lm_head_bias=leaves[2], config=config, mode=mode,
                    chunk_blocks=2, top_k=TOP_K)
                rows = terms.diagnostics
                self.assertEqual(rows.top_k_values.dtype, torch.float64)
                supervised = (weight_mask > 0).unsqueeze(-1)
                (terms.loss + (rows.top_k_values * probe
                               * supervised).sum()).backward()

                ref_leaves = [t.clone().requires_grad_(i == 0 or trainable)
                              for i, t in enumerate((hidden, weight, bias))]
                objective, ids, values, w = reference(
                    *ref_leaves, target_ids, weight_mask, cap, probe)
                objective.backward()
                mask = weight_mask > 0
                self.assertTrue(torch.equal(rows.top_k[mask], ids[mask]))
                self.assertTrue(bool((rows.top_k[~mask] == -1).all()))
                self.assertTrue(bool((rows.top_k_values[~mask] == 0).all()))
                # float64 values, and their gradients, exact.
                torch.testing.assert_close(
                    rows.top_k_values[mask], values[mask].detach(),
                    rtol=1e-12, atol=1e-12)
                matches = ids.eq(target_ids.unsqueeze(-1))
                self.assertTrue(torch.equal(
                    rows.target_is_candidate[mask], matches.any(-1)[mask]))
                self.assertTrue(bool(rows.target_is_candidate[0, 0, 1:]
                                     .all()))
                self.assertTrue(torch.equal(
                    rows.target_candidate_index[mask],
                    matches.long().argmax(-1)[mask]))
                # float64 row outputs (ChunkLossOutputs::loss_weight).
                self.assertEqual(rows.loss_weight.dtype, torch.float64)
                torch.testing.assert_close(rows.loss_weight, w,
                                           rtol=1e-12, atol=1e-12)
                for name, got, want in zip(
                        ("hidden", "weight", "bias"), leaves, ref_leaves):
                    if want.grad is None:
                        self.assertIsNone(got.grad, name)
                        continue
                    torch.testing.assert_close(
                        got.grad, want.grad, rtol=1e-9, atol=1e-12,
                        msg=lambda m, name=name: f"d/d{name}: {m}")

    def test_values_with_a_correction_in_float64(self):
        # The values hold the correction's z . M[id]: their gradient reaches
        # z and M as well as the hidden states and the head, beside the
        # loss's own (dflash, gamma 7: the default config).
        hidden, weight, bias, target_ids, weight_mask = batch(6)
        gen = torch.Generator().manual_seed(8)
        z = torch.randn(B, N, K, 2, generator=gen, dtype=torch.float64)
        m = 0.5 * torch.randn(V, 2, generator=gen, dtype=torch.float64)
        probe = torch.randn(B, N, K, TOP_K, generator=gen,
                            dtype=torch.float64)
        names = ("hidden", "weight", "bias", "z", "m")
        for path, context in paths():
            for with_loss in (False, True):
                with self.subTest(path=path, loss=with_loss), context:
                    leaves = [t.clone().requires_grad_()
                              for t in (hidden, weight, bias, z, m)]
                    terms = dflash_objective(
                        leaves[0], leaves[1], target_ids, weight_mask,
                        lm_head_bias=leaves[2], correction_inputs=leaves[3],
                        correction_weight=leaves[4], top_k=TOP_K)
                    rows = terms.diagnostics
                    supervised = (weight_mask > 0).unsqueeze(-1)
                    objective = (rows.top_k_values * probe * supervised).sum()
                    if with_loss:
                        objective = objective + terms.loss
                    objective.backward()
                    ref = [t.clone().requires_grad_()
                           for t in (hidden, weight, bias, z, m)]
                    logits = ref[0] @ ref[1].T + ref[2] + ref[3] @ ref[4].T
                    mask = weight_mask > 0
                    values, ids = logits.topk(TOP_K, dim=-1)
                    self.assertTrue(torch.equal(rows.top_k[mask], ids[mask]))
                    torch.testing.assert_close(rows.top_k_values[mask],
                                               values[mask].detach(),
                                               rtol=1e-12, atol=1e-12)
                    want = (values * probe * supervised).sum()
                    if with_loss:
                        nlq = torch.nn.functional.cross_entropy(
                            logits.reshape(-1, V), target_ids.reshape(-1),
                            reduction="none").reshape(B, N, K)
                        k = torch.arange(K, dtype=torch.float64)
                        w = weight_mask * torch.exp(
                            -(k - 1).clamp(min=0) / 7.0)
                        want = want + (nlq * w).sum() / w.sum()
                    want.backward()
                    for name, got, wanted in zip(names, leaves, ref):
                        torch.testing.assert_close(
                            got.grad, wanted.grad, rtol=1e-9, atol=1e-12,
                            msg=lambda msg, name=name: f"d/d{name}: {msg}")

    def test_values_in_float32_stay_float32(self):
        hidden, weight, _, target_ids, weight_mask = batch(4)
        for path, context in paths():
            with self.subTest(path=path), context:
                x = hidden.float().requires_grad_()
                terms = dflash_objective(x, weight.float(), target_ids,
                                         weight_mask, top_k=TOP_K)
                values = terms.diagnostics.top_k_values
                self.assertEqual(values.dtype, torch.float32)
                values.sum().backward()
                self.assertEqual(x.grad.dtype, torch.float32)
                logits = hidden @ weight.T
                mask = weight_mask > 0
                torch.testing.assert_close(
                    values[mask].double(),
                    logits.topk(TOP_K, dim=-1).values[mask],
                    rtol=1e-5, atol=1e-5)

    def test_unused_values_skip_their_backward(self):
        # A loss without the top-k values runs no values backward and gets
        # the gradient of a call without top_k; values alone get theirs
        # (as with a loss_num weighed 0).
        hidden, weight, bias, target_ids, weight_mask = batch(6)
        for path, context in paths():
            with self.subTest(path=path), context:
                def grads(top_k, use):
                    leaves = [t.clone().requires_grad_()
                              for t in (hidden, weight, bias)]
                    with counting_values_backward() as calls:
                        terms = dflash_objective(
                            leaves[0], leaves[1], target_ids, weight_mask,
                            lm_head_bias=leaves[2], top_k=top_k)
                        use(terms).backward()
                    return [t.grad for t in leaves], calls[0]

                def loss(terms):
                    return terms.loss_num

                def values(terms):
                    return terms.diagnostics.top_k_values.sum()

                def zero_loss_and_values(terms):
                    return 0 * terms.loss_num + values(terms)

                got, calls = grads(TOP_K, loss)
                self.assertEqual(calls, 0)
                want, _ = grads(0, loss)
                for g, w in zip(got, want):
                    torch.testing.assert_close(g, w, rtol=0, atol=0)
                got, calls = grads(TOP_K, values)
                self.assertEqual(calls, 1)
                want, _ = grads(TOP_K, zero_loss_and_values)
                for g, w in zip(got, want):
                    torch.testing.assert_close(g, w, rtol=1e-15, atol=0)

    def test_bad_top_k_backward_inputs_raise(self):
        hidden, weight, _, target_ids, weight_mask = batch(4)
        hidden.requires_grad_(True)
        terms = dflash_objective(hidden, weight, target_ids, weight_mask,
                                 top_k=TOP_K)
        # A gradient of the wrong shape is autograd's error, before ours.
        with self.assertRaises(RuntimeError):
            terms.diagnostics.top_k_values.backward(torch.ones(3))


if __name__ == "__main__":
    unittest.main()
