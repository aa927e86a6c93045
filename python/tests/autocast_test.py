"""dflash_objective under torch.autocast (issue 30, item 5): the projection's
inputs are taken in the head's own dtype, cast once by the call (bfloat16
under CUDA's bfloat16 autocast, float32 under any other), and gradients
come back in the caller's dtypes. Outside autocast nothing is cast: a
bfloat16 CPU tensor stays a clear error. The CUDA case needs a GPU and
skips here, saying so."""

import unittest

import torch

from dflash.torch import FusedHead, dflash_objective
from dflash.torch import _library

B, N, K, H, V = 2, 3, 4, 16, 40


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, N, K, H, generator=g)
    weight = torch.randn(V, H, generator=g) / H**0.5
    ids = torch.randint(0, V, (B, N, K), generator=g)
    mask = torch.ones(B, N, K)
    mask[..., 0] = 0
    return x, weight, ids, mask


class CpuAutocastTest(unittest.TestCase):
    def step(self, layer, x, weight, ids, mask, *, explicit):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hidden = layer(x)  # bfloat16: autocast's matmul.
            self.assertEqual(hidden.dtype, torch.bfloat16)
            if explicit:
                # What the call does itself: float32, once.
                with torch.autocast("cpu", enabled=False):
                    terms = dflash_objective(hidden.float(), weight, ids,
                                             mask)
            else:
                terms = dflash_objective(hidden, weight, ids, mask)
        terms.loss.backward()
        return terms, {n: p.grad.clone() for n, p in layer.named_parameters()}

    def test_bfloat16_states_are_taken_in_float32(self):
        x, weight, ids, mask = batch()
        torch.manual_seed(0)
        layer = torch.nn.Linear(H, H)
        got, got_grads = self.step(layer, x, weight, ids, mask,
                                   explicit=False)
        layer.zero_grad()
        want, want_grads = self.step(layer, x, weight, ids, mask,
                                     explicit=True)
        self.assertEqual(got.loss_num.dtype, torch.float32)
        torch.testing.assert_close(got.loss, want.loss, rtol=0, atol=0)
        for name in want_grads:
            self.assertEqual(got_grads[name].dtype, torch.float32)
            torch.testing.assert_close(got_grads[name], want_grads[name],
                                       rtol=0, atol=0, msg=name)

    def test_a_bfloat16_leaf_gets_a_bfloat16_gradient(self):
        x, weight, ids, mask = batch(1)
        hidden = x.bfloat16().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            terms = dflash_objective(hidden, weight, ids, mask)
        terms.loss.backward()
        self.assertEqual(hidden.grad.dtype, torch.bfloat16)
        reference = hidden.detach().float().requires_grad_()
        want = dflash_objective(reference, weight, ids, mask)
        want.loss.backward()
        torch.testing.assert_close(terms.loss, want.loss, rtol=0, atol=0)
        torch.testing.assert_close(hidden.grad, reference.grad.bfloat16(),
                                   rtol=0, atol=0)

    def test_float64_confidence_logits_follow_the_cast_hidden(self):
        # DSpark with float64 states, teacher and confidence logits under
        # CPU autocast: the head takes float32 states and so float32
        # confidence logits (ConfidenceOf); the confidence logits'
        # gradient comes back in float64. The reference casts explicitly.
        x, weight, ids, mask = batch(3)
        g = torch.Generator().manual_seed(4)
        teacher = torch.randn(B, N, K, H, generator=g, dtype=torch.float64)
        confidence = torch.randn(B, N, K, generator=g, dtype=torch.float64)

        def run(cast):
            hidden = x.double().requires_grad_()
            conf = confidence.clone().requires_grad_()
            if cast:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    terms = dflash_objective(
                        hidden, weight.double(), ids, mask,
                        loss_type="dspark", teacher_hidden=teacher,
                        confidence_logits=conf)
            else:
                terms = dflash_objective(
                    hidden.float(), weight, ids, mask, loss_type="dspark",
                    teacher_hidden=teacher.float(),
                    confidence_logits=conf.float())
            terms.loss.backward()
            return terms, hidden.grad, conf.grad

        got, got_hidden, got_conf = run(True)
        want, want_hidden, want_conf = run(False)
        self.assertEqual(got_conf.dtype, torch.float64)
        torch.testing.assert_close(got.loss, want.loss, rtol=0, atol=0)
        torch.testing.assert_close(got_hidden, want_hidden, rtol=0, atol=0)
        torch.testing.assert_close(got_conf, want_conf, rtol=0, atol=0)

    def test_fused_head_keeps_its_frozen_float32_layout(self):
        x, weight, ids, mask = batch(2)
        linear = torch.nn.Linear(H, V)
        with torch.no_grad():
            linear.weight.copy_(weight)
        head = FusedHead(linear)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            terms = head(x.bfloat16(), ids, mask)
        # The float32 weight is not cast: its prepared layout serves.
        self.assertIsNotNone(head._prepared)
        want = head(x.bfloat16().float(), ids, mask)
        torch.testing.assert_close(terms.loss, want.loss, rtol=0, atol=0)

    def test_outside_autocast_nothing_is_cast(self):
        x, weight, ids, mask = batch(3)
        with self.assertRaisesRegex(
                ValueError, r"hidden: must be float32 or float64 \(on the "
                r"CPU\), got bfloat16"):
            dflash_objective(x.bfloat16(), weight, ids, mask)
        with torch.autocast("cpu", enabled=False):
            with self.assertRaisesRegex(ValueError, "hidden: must be"):
                dflash_objective(x.bfloat16(), weight, ids, mask)

    @unittest.skipUnless(
        _library.SUPPORTED,
        f"torch {torch.__version__} has no torch.library.custom_op "
        "(torch >= 2.4); run with DFLASH_TEST_PYTHON naming a newer torch")
    def test_a_compiled_autocast_step(self):
        x, weight, ids, mask = batch(4)
        torch.manual_seed(1)
        layer = torch.nn.Linear(H, H)

        def step(x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return dflash_objective(layer(x), weight, ids, mask).loss

        torch._dynamo.reset()
        compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
        torch.testing.assert_close(compiled(x), step(x), rtol=0, atol=0)


class CudaAutocastTest(unittest.TestCase):
    @unittest.skipUnless(torch.cuda.is_available(),
                         "needs a CUDA GPU and a CUDA build of torch (this "
                         "machine has neither): under "
                         "torch.autocast('cuda', dtype=torch.bfloat16) the "
                         "head takes bfloat16 states and weight")
    def test_bfloat16_autocast_takes_bfloat16(self):
        x, weight, ids, mask = batch(5)
        device = torch.device("cuda")
        layer = torch.nn.Linear(H, H).to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            terms = dflash_objective(layer(x.to(device)), weight.to(device),
                                     ids.to(device), mask.to(device))
        terms.loss.backward()
        want = dflash_objective(
            layer(x.to(device)).detach().bfloat16(),
            weight.to(device).bfloat16(), ids.to(device), mask.to(device))
        torch.testing.assert_close(terms.loss, want.loss, rtol=1e-3,
                                   atol=1e-3)
        self.assertEqual(layer.weight.grad.dtype, torch.float32)


if __name__ == "__main__":
    unittest.main(verbosity=2)
