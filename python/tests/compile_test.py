"""dflash_objective and FusedHead under torch.compile (issue 30, item 1):
the dflash::objective operator (torch.library: custom_op, register_fake,
register_autograd) traced without a graph break, its fake tensors, opcheck,
and dynamic shapes.

Needs torch >= 2.4 (torch.library.custom_op); with Debian's 1.13 every test
skips, saying why, and CI runs them under torch 2.15 (DFLASH_TEST_PYTHON).
The compiled steps use the "aot_eager" backend: it traces forward and
backward through AOTAutograd (the fake kernel and the registered autograd
formula), which is what the tests are about, without inductor's code
generation (minutes on 2 cores, and nothing of dflash's).
"""

import unittest

import torch

import dflash
from dflash.torch import FusedHead, dflash_objective
from dflash.torch import _library

NO_OP = (f"torch {torch.__version__} has no torch.library.custom_op "
         "(torch >= 2.4): dflash_objective runs as an autograd.Function "
         "there; run with DFLASH_TEST_PYTHON naming a newer torch")

B, K, H, V = 2, 4, 16, 50


def batch(n, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, n, K, H, generator=g, dtype=dtype)
    ids = torch.randint(0, V, (B, n, K), generator=g)
    mask = torch.ones(B, n, K, dtype=dtype)
    mask[..., 0] = 0
    return x, ids, mask


class Draft(torch.nn.Module):
    """A small draft step: a layer, then the fused head over a frozen
    lm_head, and dflash_objective with a trainable bias and top-k values."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.layer = torch.nn.Linear(H, H)
        self.head = FusedHead(torch.nn.Linear(H, V), chunk_blocks=2)
        self.weight = torch.nn.Parameter(torch.randn(V, H) / H**0.5)
        self.bias = torch.nn.Parameter(torch.zeros(V))

    def forward(self, x, ids, mask):
        hidden = torch.tanh(self.layer(x))
        fused = self.head(hidden, ids, mask)
        terms = dflash_objective(hidden, self.weight, ids, mask,
                                 lm_head_bias=self.bias, top_k=3,
                                 loss_type="dpace", chunk_blocks=1)
        return (fused.loss + terms.loss
                + 0.1 * terms.diagnostics.top_k_values.sum()), terms


def gradients(model):
    return {name: p.grad.clone() for name, p in model.named_parameters()
            if p.grad is not None}


@unittest.skipUnless(_library.SUPPORTED, NO_OP)
class CompileTest(unittest.TestCase):
    def setUp(self):
        torch._dynamo.reset()

    def test_a_compiled_step_matches_eager(self):
        # fullgraph=True: any graph break is an error.
        model = Draft()
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        x, ids, mask = batch(3)
        loss, terms = compiled(x, ids, mask)
        loss.backward()
        got = gradients(model)
        model.zero_grad()
        want_loss, want_terms = model(x, ids, mask)
        want_loss.backward()
        want = gradients(model)
        torch.testing.assert_close(loss, want_loss, rtol=0, atol=0)
        self.assertEqual(sorted(got), sorted(want))
        self.assertEqual(sorted(got), ["bias", "layer.bias", "layer.weight",
                                       "weight"])
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-6,
                                       atol=1e-7, msg=name)
        # The terms and the report leave the graph too: the report read
        # after it (the run's times are not compared).
        for a, b in zip(terms[:4], want_terms[:4]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        d, w = terms.diagnostics, want_terms.diagnostics
        timed = ("forward_seconds", "backward_seconds")
        self.assertEqual({k: v for k, v in d.stats.items() if k not in timed},
                         {k: v for k, v in w.stats.items() if k not in timed})
        self.assertEqual(dict(d.family_terms), w.family_terms)
        self.assertEqual(sorted(d.metrics), sorted(w.metrics))
        for name in w.metrics:
            torch.testing.assert_close(d.metrics[name], w.metrics[name])
        self.assertEqual(terms.loss_den_offset, 0.0)
        # Under compile lk_kl_weight is a tensor, NaN where there is none.
        self.assertTrue(torch.isnan(d.lk_kl_weight))
        self.assertIsNone(w.lk_kl_weight)

    def test_explain_finds_no_graph_break(self):
        model = Draft()
        x, ids, mask = batch(2)
        explained = torch._dynamo.explain(model)(x, ids, mask)
        self.assertEqual(explained.graph_break_count, 0,
                         explained.break_reasons)
        self.assertEqual(explained.graph_count, 1)

    def test_domino_offset_and_lk_weight_are_known_in_the_graph(self):
        # loss_den_offset is a constant of the trace (the config's), and
        # `loss` uses it inside the graph.
        x, ids, mask = batch(2)
        hidden = x.requires_grad_()
        weight = torch.randn(V, H)
        z = torch.randn(B, 2, K, 3, requires_grad=True)
        m = torch.randn(V, 3, requires_grad=True)

        def step(hidden, kind):
            extra = ({"correction_inputs": z, "correction_weight": m}
                     if kind == "domino" else {"lk_loss_type": "lambda"})
            return dflash_objective(hidden, weight, ids, mask,
                                    loss_type=kind, **extra)

        for kind in ("domino", "dflash"):
            torch._dynamo.reset()
            got = torch.compile(step, backend="aot_eager",
                                fullgraph=True)(hidden, kind)
            want = step(hidden, kind)
            self.assertEqual(got.loss_den_offset, want.loss_den_offset)
            torch.testing.assert_close(got.loss, want.loss)
            if want.diagnostics.lk_kl_weight is not None:
                self.assertAlmostEqual(got.diagnostics.lk_kl_weight.item(),
                                       want.diagnostics.lk_kl_weight)
        self.assertEqual(step(hidden, "domino").loss_den_offset, 1e-6)
        self.assertIsNotNone(step(hidden, "dflash").diagnostics
                             .lk_kl_weight)

    def test_varying_blocks_do_not_recompile_each_step(self):
        from torch._dynamo.testing import CompileCounterWithBackend
        model = Draft()
        counter = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(model, backend=counter, fullgraph=True)
        for n in (2, 3, 4, 5, 6):
            x, ids, mask = batch(n, seed=n)
            loss, _ = compiled(x, ids, mask)
            loss.backward()
            want, _ = model(x, ids, mask)
            torch.testing.assert_close(loss, want)
        # The first shape compiles statically, the second marks the blocks
        # dimension dynamic; no step after that compiles again.
        self.assertLessEqual(counter.frame_count, 2)
        # Marked dynamic from the start: one graph for every block count.
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(model, backend=counter, fullgraph=True)
        for n in (2, 3, 4, 5):
            x, ids, mask = batch(n, seed=n)
            for t in (x, ids, mask):
                torch._dynamo.mark_dynamic(t, 1)
            compiled(x, ids, mask)[0].backward()
        self.assertEqual(counter.frame_count, 1)

    def test_a_bad_input_raises_through_the_compiled_graph(self):
        model = Draft()
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        x, ids, mask = batch(2)
        compiled(x, ids, mask)
        ids = ids.clone()
        ids[1, 0, 2] = V + 3
        with self.assertRaisesRegex(ValueError,
                                    r"target_ids\[1, 0, 2\]: must lie in"):
            compiled(x, ids, mask)

    def test_an_explicit_prepared_projection_under_compile(self):
        weight = torch.randn(V, H)
        x, ids, mask = batch(2)
        x.requires_grad_()
        prepared = dflash.PreparedProjection(weight)

        def step(hidden):
            return dflash_objective(hidden, weight, ids, mask,
                                    prepared_projection=prepared).loss

        compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
        got = compiled(x)
        (grad,) = torch.autograd.grad(got, x)
        want = dflash_objective(x, weight, ids, mask).loss
        (want_grad,) = torch.autograd.grad(want, x)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(grad, want_grad)


def op_inputs(n=2, dtype=torch.float32, *, bias=False, train=False,
              top_k=0, return_rows=False, loss="dflash", correction=0,
              view=False):
    """Arguments of torch.ops.dflash.objective, as dflash_objective makes
    them; with `view`, hidden, its targets and mask are chunk views (blocks
    [1, n + 1) of a batch of n + 2)."""
    x, ids, mask = batch(n, seed=7, dtype=dtype)
    if view:
        x, ids, mask = [torch.cat([t[:, :1], t, t[:, :1]], dim=1)[:, 1:n + 1]
                        for t in (x, ids, mask)]
    weight = torch.randn(V, H, dtype=dtype)
    b = torch.randn(V, dtype=dtype) if bias else None
    if train:
        weight.requires_grad_()
        if b is not None:
            b.requires_grad_()
    x.requires_grad_()
    confidence = (torch.randn(B, n, K, requires_grad=True)
                  if loss == "dspark" else None)
    teacher = (torch.randn(B, n, K, H, dtype=dtype) if loss == "dspark"
               else None)
    z = m = None
    if correction:
        z = torch.randn(B, n, K, correction, dtype=dtype, requires_grad=True)
        m = torch.randn(V, correction, dtype=dtype, requires_grad=True)
    text = dflash.objective_config(
        None, loss_type=loss, chunk_blocks=1).text
    return (x, weight, ids, mask, b, teacher, confidence, z, m, text, top_k,
            return_rows, train, True, 0)


CASES = {
    "plain": {},
    "rows_top_k_bias": dict(bias=True, train=True, top_k=3,
                            return_rows=True),
    "float64": dict(dtype=torch.float64),
    # Top-k values in hidden's dtype.
    "float64_top_k": dict(dtype=torch.float64, bias=True, train=True,
                          top_k=3),
    "chunk_views": dict(view=True, bias=True, train=True, top_k=3),
    "correction_top_k": dict(correction=2, bias=True, train=True, top_k=3),
    "dspark_confidence": dict(loss="dspark"),
    "correction": dict(correction=3),
}


@unittest.skipUnless(_library.SUPPORTED, NO_OP)
class OperatorTest(unittest.TestCase):
    def test_fake_tensors_give_every_output(self):
        from torch._subclasses.fake_tensor import FakeTensorMode
        op = torch.ops.dflash.objective.default
        for name, case in CASES.items():
            args = op_inputs(**case)
            real = op(*args)
            with FakeTensorMode(allow_non_fake_inputs=False) as mode:
                fake_args = [mode.from_tensor(a) if isinstance(
                    a, torch.Tensor) else a for a in args]
                fake = op(*fake_args)
            self.assertEqual(len(fake), len(_library.OUTPUTS))
            for out, r, f in zip(_library.OUTPUTS, real, fake):
                where = f"{name}: {out}"
                self.assertEqual(f.shape, r.shape, where)
                self.assertEqual(f.dtype, r.dtype, where)
                self.assertEqual(f.device, r.device, where)
            # The outputs a call asks for are not empty.
            at = _library.OUTPUTS.index
            self.assertEqual(real[at("grad_hidden")].shape, args[0].shape)
            if case.get("top_k"):
                self.assertEqual(real[at("top_k")].shape, (B, 2, K, 3))
                self.assertEqual(real[at("grad_weight")].shape, (V, H))
                self.assertEqual(real[at("grad_bias")].shape, (V,))
            if case.get("loss") == "dspark":
                self.assertEqual(real[at("grad_confidence")].shape,
                                 (B, 2, K))
            if case.get("correction"):
                self.assertEqual(real[at("grad_correction_weight")].shape,
                                 (V, case["correction"]))

    def test_a_stale_prepared_handle_is_an_error(self):
        # A graph keeps a PreparedProjection's handle; once the projection
        # is gone the call says so.
        args = list(op_inputs())
        args[-1] = 12345
        with self.assertRaisesRegex(ValueError, "prepared_projection: the "
                                    "PreparedProjection .* no longer exists"):
            torch.ops.dflash.objective(*args)

    def test_opcheck(self):
        op = torch.ops.dflash.objective.default
        for name, case in CASES.items():
            with self.subTest(name):
                torch.library.opcheck(op, op_inputs(**case))

    def test_opcheck_top_k_value_backward(self):
        for name in ("rows_top_k_bias", "float64_top_k", "correction_top_k"):
            with self.subTest(name):
                args = op_inputs(**CASES[name])
                outputs = torch.ops.dflash.objective(*args)
                at = _library.OUTPUTS.index
                x, weight, bias, z, m = (args[0], args[1], args[4], args[7],
                                         args[8])
                ids, values = outputs[at("top_k")], outputs[at("top_k_values")]
                self.assertEqual(values.dtype, x.dtype)
                correction = (() if z is None
                              else (z.detach(), m.detach()))
                torch.library.opcheck(
                    torch.ops.dflash.top_k_value_backward.default,
                    (x.detach(), weight.detach(), bias.detach(), ids,
                     values.detach(), torch.randn_like(values), args[9],
                     True) + correction)

    def test_the_autograd_path_gives_the_same_values(self):
        # The operator and torch 1.13's autograd.Function run the same head.
        from dflash.torch.objective import _Objective, _RunInfo
        x, ids, mask = batch(3)
        weight = torch.randn(V, H)
        hidden = x.clone().requires_grad_()
        terms = dflash_objective(hidden, weight, ids, mask, top_k=2)
        terms.loss.backward()
        other = x.clone().requires_grad_()
        results = _Objective.apply(
            dflash.objective_config(None), 2, False, True, _RunInfo(), other,
            weight, None, None, None, ids, mask, None, None, None)
        (results[0] / results[1]).backward()
        torch.testing.assert_close(terms.loss_num, results[0], rtol=0, atol=0)
        torch.testing.assert_close(hidden.grad, other.grad, rtol=0, atol=0)


class SkipsSayWhyTest(unittest.TestCase):
    def test_which_path_runs(self):
        # Printed, so a log shows which path this torch took.
        print(f"torch {torch.__version__}: dflash_objective runs as",
              "torch.ops.dflash.objective" if _library.SUPPORTED
              else "an autograd.Function (" + NO_OP + ")")
        self.assertEqual(_library.SUPPORTED,
                         hasattr(torch.library, "custom_op"))


if __name__ == "__main__":
    unittest.main(verbosity=2)
