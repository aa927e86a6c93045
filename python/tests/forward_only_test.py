"""Forward only (issue 30, item 2): under torch.no_grad(),
torch.inference_mode() or when no input that gets a gradient requires one,
dflash_objective runs the head's forward pass alone (no gradient GEMM, no
gradient buffer) and returns the training call's values. Runs under both
torch versions (the operator with torch >= 2.4, the autograd.Function with
1.13); the operator's own checks skip, saying why, under 1.13."""

import contextlib
import unittest

import torch

import dflash
from dflash import _core
from dflash.torch import FusedHead, dflash_objective
from dflash.torch import _library

B, N, K, H, V = 2, 3, 4, 16, 40
NO_OP = (f"torch {torch.__version__} has no torch.library.custom_op "
         "(torch >= 2.4); run with DFLASH_TEST_PYTHON naming a newer torch")


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, N, K, H, generator=g)
    weight = torch.randn(V, H, generator=g) / H**0.5
    ids = torch.randint(0, V, (B, N, K), generator=g)
    mask = (torch.rand(B, N, K, generator=g) > 0.2).float()
    mask[..., 0] = 0
    return hidden, weight, ids, mask


# (name, overrides, extra inputs): losses with a teacher, confidence logits
# and a correction, in the non-fused modes too.
CASES = [
    ("dflash fused", dict(loss_type="dflash"), ()),
    ("dflash checkpoint", dict(loss_type="dflash", mode="checkpoint",
                               chunk_blocks=1), ()),
    ("dpace materialize", dict(loss_type="dpace", mode="materialize"), ()),
    ("lk lambda save", dict(loss_type="dflash", lk_loss_type="lambda",
                            mode="save", chunk_blocks=2), ()),
    ("dspark", dict(loss_type="dspark"), ("teacher", "confidence")),
    ("domino", dict(loss_type="domino", chunk_blocks=2), ("correction",)),
]


def inputs(extra, seed=0):
    g = torch.Generator().manual_seed(100 + seed)
    kw = {}
    if "teacher" in extra:
        kw["teacher_hidden"] = torch.randn(B, N, K, H, generator=g)
    if "confidence" in extra:
        kw["confidence_logits"] = torch.randn(B, N, K, generator=g)
    if "correction" in extra:
        kw["correction_inputs"] = torch.randn(B, N, K, 3, generator=g)
        kw["correction_weight"] = torch.randn(V, 3, generator=g) / 3
    return kw


def values(terms):
    """Every value a call returns, by name (tensors and numbers)."""
    d = terms.diagnostics
    out = {"loss_num": terms.loss_num, "loss_den": terms.loss_den,
           "correct_num": terms.correct_num,
           "accuracy_den": terms.accuracy_den,
           "loss_den_offset": terms.loss_den_offset,
           "position_correct": d.position_correct,
           "position_den": d.position_den,
           "target_probability_num": d.target_probability_num,
           "ce_loss_num": d.ce_loss_num, "tv_loss_num": d.tv_loss_num,
           "lk_kl_weight": d.lk_kl_weight,
           "family_terms": dict(d.family_terms)}
    for name in ("neg_log_q", "argmax", "top_k", "top_k_values",
                 "loss_weight", "target_is_candidate",
                 "target_candidate_index"):
        out[name] = getattr(d, name)
    for name, metric in d.metrics.items():
        out["metrics." + name] = metric
    for name in ("mode", "chunks", "projected_rows"):
        out["stats." + name] = d.stats[name]
    return out


class ForwardOnlyTest(unittest.TestCase):
    def assert_same(self, got, want, where):
        self.assertEqual(sorted(got), sorted(want))
        for name in want:
            a, b = got[name], want[name]
            if isinstance(b, torch.Tensor):
                self.assertFalse(a.requires_grad, f"{where}: {name}")
                torch.testing.assert_close(a, b.detach(), rtol=0, atol=0,
                                           msg=f"{where}: {name}")
            else:
                self.assertEqual(a, b, f"{where}: {name}")

    def test_no_grad_inference_mode_and_nothing_requiring_grad(self):
        hidden, weight, ids, mask = batch()
        for name, overrides, extra in CASES:
            kw = inputs(extra)
            # Domino reports its own telemetry, no top-k.
            top_k = 0 if name == "domino" else 3
            train_hidden = hidden.clone().requires_grad_()
            train_kw = {k: v.clone().requires_grad_()
                        if k in ("confidence_logits", "correction_inputs",
                                 "correction_weight") else v
                        for k, v in kw.items()}
            train = dflash_objective(train_hidden, weight, ids, mask,
                                     return_rows=True, top_k=top_k,
                                     **train_kw,
                                     **overrides)
            train.loss.backward()  # A training call, whole.
            want = values(train)
            passes = train.diagnostics.stats["gemm_passes"]
            for how, context, x in (
                    ("no_grad", torch.no_grad, train_hidden),
                    ("inference_mode", torch.inference_mode, train_hidden),
                    ("nothing requires grad", contextlib.nullcontext,
                     hidden)):
                where = f"{name}, {how}"
                call_kw = train_kw if x is train_hidden else kw
                with context():
                    terms = dflash_objective(x, weight, ids, mask,
                                             return_rows=True, top_k=top_k,
                                             **call_kw, **overrides)
                self.assert_same(values(terms), want, where)
                self.assertIsNone(terms.loss_num.grad_fn, where)
                stats = terms.diagnostics.stats
                # The forward projections alone (the teacher's too for
                # dspark): at least one pass fewer, nothing recomputed.
                self.assertLessEqual(stats["gemm_passes"], passes - 1, where)
                self.assertEqual(stats["segment_recomputes"], 0, where)

    def test_one_projection_for_dflash(self):
        hidden, weight, ids, mask = batch(1)
        x = hidden.clone().requires_grad_()
        train = dflash_objective(x, weight, ids, mask)
        with torch.no_grad():
            evaluation = dflash_objective(x, weight, ids, mask)
        self.assertEqual(train.diagnostics.stats["gemm_passes"], 2.0)
        self.assertEqual(evaluation.diagnostics.stats["gemm_passes"], 1.0)
        # No gradient buffers: the head's own peak is below the training
        # call's, which holds the hidden-state gradient's chunk buffer.
        self.assertLess(evaluation.diagnostics.stats["peak_bytes"],
                        train.diagnostics.stats["peak_bytes"])

    def test_fused_head_in_eval(self):
        hidden, weight, ids, mask = batch(2)
        linear = torch.nn.Linear(H, V)
        with torch.no_grad():
            linear.weight.copy_(weight)
        head = FusedHead(linear)
        x = hidden.clone().requires_grad_()
        train = head(x, ids, mask)
        with torch.no_grad():
            evaluation = head(x, ids, mask)
        torch.testing.assert_close(evaluation.loss, train.loss.detach(),
                                   rtol=0, atol=0)
        self.assertEqual(evaluation.diagnostics.stats["gemm_passes"], 1.0)

    def test_a_trainable_weight_under_no_grad_is_not_trained(self):
        hidden, weight, ids, mask = batch(3)
        weight = weight.clone().requires_grad_()
        with torch.no_grad():
            terms = dflash_objective(hidden, weight, ids, mask)
        self.assertEqual(terms.diagnostics.stats["gemm_passes"], 1.0)
        self.assertIsNone(weight.grad)

    def test_the_binding_refuses_gradient_work_in_a_forward_only_run(self):
        # Rejected inputs of the forward-only call, each a clear error.
        hidden, weight, ids, mask = batch(4)
        config = dflash.objective_config(None)
        common = dict(
            config=config, hidden=hidden, weight=weight, target_ids=ids,
            weight_mask=mask, bias=None, teacher_hidden=None,
            confidence_logits=None, grad_weight=None, grad_bias=None,
            grad_confidence=None, neg_log_q=None, argmax=None, top_k=None,
            top_k_values=None, loss_weight=None, correction_inputs=None,
            correction_weight=None, grad_correction_inputs=None,
            grad_correction_weight=None, prepared=None, cuda_stream=0,
            forward_only=True)
        result = _core.run_objective(grad_hidden=None, trainable=False,
                                     **common)
        self.assertGreater(result["loss_den"], 0)
        with self.assertRaisesRegex(
                ValueError, r"grad_hidden: not expected \(a forward-only run "
                r"computes none\), got a tensor"):
            _core.run_objective(grad_hidden=torch.empty_like(hidden),
                                trainable=False, **common)
        with self.assertRaisesRegex(
                ValueError, "trainable: a forward-only run computes no "
                "gradient"):
            _core.run_objective(grad_hidden=None, trainable=True, **common)
        common["forward_only"] = False
        with self.assertRaisesRegex(
                ValueError, r"grad_hidden: required \(for every run that "
                r"trains\), got None"):
            _core.run_objective(grad_hidden=None, trainable=False, **common)

    @unittest.skipUnless(_library.SUPPORTED, NO_OP)
    def test_the_operator_returns_no_gradient_buffers(self):
        hidden, weight, ids, mask = batch(5)
        text = dflash.objective_config(None).text
        args = (hidden, weight, ids, mask, None, None, None, None, None, text,
                0, False, False)
        with torch.no_grad():
            eval_out = torch.ops.dflash.objective(*args, False, 0)
        train_out = torch.ops.dflash.objective(*args, True, 0)
        at = _library.OUTPUTS.index
        self.assertEqual(eval_out[at("grad_hidden")].shape, (0,))
        self.assertEqual(train_out[at("grad_hidden")].shape, hidden.shape)
        for name in _library.OUTPUTS[:at("info")]:
            torch.testing.assert_close(eval_out[at(name)],
                                       train_out[at(name)], rtol=0, atol=0)
        # A graph over a forward-only run cannot give gradients: said so.
        x = hidden.clone().requires_grad_()
        outputs = torch.ops.dflash.objective(
            x, *args[1:], False, 0)
        with self.assertRaisesRegex(RuntimeError, "ran forward only"):
            outputs[0].backward()

    @unittest.skipUnless(_library.SUPPORTED, NO_OP)
    def test_a_compiled_evaluation_step(self):
        hidden, weight, ids, mask = batch(6)
        layer = torch.nn.Linear(H, H)

        def step(x):
            return dflash_objective(torch.tanh(layer(x)), weight, ids,
                                    mask).loss

        torch._dynamo.reset()
        compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
        with torch.no_grad():
            got = compiled(hidden)
            want = step(hidden)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        self.assertFalse(got.requires_grad)


if __name__ == "__main__":
    unittest.main(verbosity=2)
