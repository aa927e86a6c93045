"""dflash_objective and FusedHead in a training step compiled by inductor
(torch.compile's default backend), fullgraph: inductor generates the step's
own kernels around dflash's operator (an opaque extern call to it), and the
compiled step must give eager's loss and gradients.

//python:compile_test covers tracing (aot_eager), fake tensors, opcheck and
dynamic shapes; this test is the code-generating backend on the CPU. The
CUDA step needs a GPU and skips without one.
"""

import unittest

import torch

from dflash.torch import FusedHead, dflash_objective
from dflash.torch import _library

NO_OP = (f"torch {torch.__version__} has no torch.library.custom_op "
         "(torch >= 2.4); run with DFLASH_TEST_PYTHON naming a newer torch")

B, K, H, V = 2, 4, 16, 50


class Draft(torch.nn.Module):
    """A layer (inductor fuses its tanh), the fused head over a frozen
    lm_head, and dflash_objective with a trainable weight and bias."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(H, H)
        self.head = FusedHead(torch.nn.Linear(H, V), chunk_blocks=2)
        self.weight = torch.nn.Parameter(torch.randn(V, H) / H**0.5)
        self.bias = torch.nn.Parameter(torch.zeros(V))

    def forward(self, x, ids, mask):
        hidden = torch.tanh(self.layer(x)) * 3
        fused = self.head(hidden, ids, mask)
        terms = dflash_objective(hidden, self.weight, ids, mask,
                                 lm_head_bias=self.bias, loss_type="dpace",
                                 chunk_blocks=1)
        return fused.loss + 0.5 * terms.loss


def batch(n, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, n, K, H, generator=g)
    ids = torch.randint(0, V, (B, n, K), generator=g)
    mask = torch.ones(B, n, K)
    mask[..., 0] = 0
    mask[0, -1, 2:] = 0
    return x.to(device), ids.to(device), mask.to(device)


def step(run, model, inputs):
    """run (the model or its compiled form) on inputs: the loss and the
    model's gradients."""
    model.zero_grad(set_to_none=True)
    loss = run(*inputs)
    loss.backward()
    return loss.detach(), {name: p.grad.clone()
                           for name, p in model.named_parameters()
                           if p.grad is not None}


@unittest.skipUnless(_library.SUPPORTED, NO_OP)
class InductorTest(unittest.TestCase):
    def setUp(self):
        torch._dynamo.reset()

    def check(self, device):
        model = Draft().to(device)
        compiled = torch.compile(model, backend="inductor", fullgraph=True)
        for n, seed in ((3, 0), (3, 1)):
            inputs = batch(n, seed, device)
            loss, grads = step(compiled, model, inputs)
            want_loss, want_grads = step(model, model, inputs)
            # Inductor fuses the layer's tanh and sums in its own order:
            # float32 rounding, not a different objective.
            torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=0)
            self.assertEqual(sorted(grads), sorted(want_grads))
            for name, want in want_grads.items():
                torch.testing.assert_close(
                    grads[name], want, rtol=1e-5, atol=1e-6 * want.abs().max(),
                    msg=lambda m: f"{device} grad {name}: {m}")
            # The frozen lm_head inside FusedHead never gets a gradient.
            self.assertNotIn("head.lm_head.weight", grads)

    def test_cpu_step_matches_eager(self):
        self.check("cpu")

    @unittest.skipUnless(torch.cuda.is_available(),
                         "no CUDA device here: the compiled CUDA step runs "
                         "where a GPU is")
    def test_cuda_step_matches_eager(self):
        self.check("cuda")


if __name__ == "__main__":
    unittest.main(verbosity=2)
