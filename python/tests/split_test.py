"""Split forward and backward (issue 30, item 3): in the non-FUSED modes a
training call's forward keeps its state (SplitHeadRun) and autograd's
backward makes the gradients, so that between the passes no gradient-sized
tensor is held. Loss and gradients equal the FUSED mode's single call and
the float64 reference (reference.py); a retained graph gives the same
gradients twice; an upstream gradient scales them; the state's saved bytes
are what its mode keeps; a forked child cannot run its parent's backward.
Runs under both torch versions (the autograd.Function with 1.13, the
dflash::objective operator with torch >= 2.4, whose opcheck skips, saying
why, under 1.13)."""

import gc
import os
import unittest

import torch

import dflash
import reference
from dflash.torch import _library, dflash_objective
from dflash.torch import objective as objective_module

B, N, K, H, V = 2, 3, 4, 16, 40
# The override names of the modes that split (and SAVE_CHUNKS's "save").
SPLIT_MODES = ["materialize", "save", "checkpoint", "selective"]
NO_OP = (f"torch {torch.__version__} has no torch.library.custom_op "
         "(torch >= 2.4); run with DFLASH_TEST_PYTHON naming a newer torch")

# (name, overrides, extra inputs, trainable).
CASES = [
    ("dflash", dict(loss_type="dflash"), (), True),
    ("dspark confidence", dict(loss_type="dspark"),
     ("teacher", "confidence"), False),
    ("domino correction", dict(loss_type="domino"), ("correction",), False),
    # Frozen: LK lambda's batch-level weight trains no head.
    ("lk lambda", dict(loss_type="dflash", lk_loss_type="lambda"), (),
     False),
]


def batch(dtype, extra, seed=0):
    g = torch.Generator().manual_seed(seed)
    data = {
        "hidden": torch.randn(B, N, K, H, generator=g, dtype=torch.float64),
        "weight": torch.randn(V, H, generator=g, dtype=torch.float64) / 4,
        "ids": torch.randint(0, V, (B, N, K), generator=g),
        "mask": (torch.rand(B, N, K, generator=g) > 0.2).double(),
    }
    data["mask"][..., 0] = 0
    if "teacher" in extra:
        data["teacher_hidden"] = torch.randn(B, N, K, H, generator=g,
                                             dtype=torch.float64)
    if "confidence" in extra:
        data["confidence_logits"] = torch.randn(B, N, K, generator=g,
                                                dtype=torch.float64)
    if "correction" in extra:
        data["correction_inputs"] = torch.randn(B, N, K, 3, generator=g,
                                                dtype=torch.float64)
        data["correction_weight"] = torch.randn(V, 3, generator=g,
                                                dtype=torch.float64) / 3
    return {k: v.to(dtype) if v.is_floating_point() and k != "mask" else v
            for k, v in data.items()}


def run(data, mode, trainable, upstream=1.0, retain=False, **overrides):
    """Loss and every gradient of one call (leaves made from `data`)."""
    leaves = {"hidden": data["hidden"].clone().requires_grad_()}
    leaves["weight"] = data["weight"].clone().requires_grad_(trainable)
    kw = {}
    for name in ("confidence_logits", "correction_inputs",
                 "correction_weight"):
        if name in data:
            kw[name] = leaves[name] = data[name].clone().requires_grad_()
    if "teacher_hidden" in data:
        kw["teacher_hidden"] = data["teacher_hidden"]
    if not trainable and data["weight"].dtype == torch.float32:
        # Without one such a head lays out its own weight and does not
        # split (test_a_frozen_float32_head_laying_out_its_own_weight...).
        kw["prepared_projection"] = dflash.PreparedProjection(
            leaves["weight"])
    terms = dflash_objective(leaves["hidden"], leaves["weight"], data["ids"],
                             data["mask"], mode=mode, chunk_blocks=2, **kw,
                             **overrides)
    (terms.loss * upstream).backward(retain_graph=retain)
    grads = {name: t.grad.clone() for name, t in leaves.items()
             if t.grad is not None}
    return terms, grads, leaves


class SplitTest(unittest.TestCase):
    def assert_same(self, got, want, tol, what):
        torch.testing.assert_close(got.double(), want.double(), rtol=tol,
                                   atol=tol, msg=lambda m: f"{what}: {m}")

    def test_every_mode_equals_fused_and_the_reference(self):
        for name, overrides, extra, trainable in CASES:
            for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-6)):
                data = batch(dtype, extra)
                fused, want, _ = run(data, "fused", trainable, **overrides)
                for mode in SPLIT_MODES:
                    where = f"{name}, {mode}, {dtype}"
                    with self.subTest(where):
                        terms, grads, _ = run(data, mode, trainable,
                                              **overrides)
                        self.assert_same(terms.loss, fused.loss, tol, where)
                        self.assertEqual(grads.keys(), want.keys(), where)
                        for leaf, grad in grads.items():
                            scale = want[leaf].abs().max().clamp(min=1e-30)
                            self.assert_same(grad / scale,
                                             want[leaf] / scale, tol,
                                             f"{where}, grad of {leaf}")
        # The float64 reference for the families it has (dflash).
        family = next(f for f in reference.FAMILIES if f.name == "dflash")
        data = reference.batch(seed=3)
        for mode in ("MATERIALIZE", "SAVE_CHUNKS", "CHECKPOINT",
                     "SELECTIVE"):
            with self.subTest(f"reference, {mode}"):
                hidden = data["hidden"].clone().requires_grad_()
                terms = dflash_objective(
                    hidden, data["weight"], data["target_ids"],
                    data["weight_mask"],
                    config=family.config_text(mode, 2, 2))
                terms.loss.backward()
                ref_hidden = data["hidden"].clone().requires_grad_()
                want = reference.objective(
                    family, ref_hidden, data["weight"], data["target_ids"],
                    data["weight_mask"])
                (want[0] / want[1]).backward()
                self.assert_same(terms.loss, want[0] / want[1], 1e-12, mode)
                self.assert_same(hidden.grad, ref_hidden.grad, 1e-12, mode)

    def test_retained_graph_and_upstream(self):
        for name, overrides, extra, trainable in CASES:
            data = batch(torch.float64, extra, seed=1)
            for mode in ("checkpoint", "materialize"):
                where = f"{name}, {mode}"
                with self.subTest(where):
                    _, once, _ = run(data, mode, trainable, **overrides)
                    terms, first, leaves = run(data, mode, trainable,
                                               retain=True, **overrides)
                    terms.loss.backward()  # Accumulates the same again.
                    for leaf, grad in first.items():
                        self.assertTrue(torch.equal(grad, once[leaf]), where)
                        self.assertTrue(torch.equal(leaves[leaf].grad,
                                                    2 * grad), where)
                    _, tripled, _ = run(data, mode, trainable, upstream=3.0,
                                        **overrides)
                    for leaf, grad in once.items():
                        scale = grad.abs().max().clamp(min=1e-30)
                        self.assert_same(tripled[leaf] / scale,
                                         3 * grad / scale, 1e-14, where)

    def test_second_backward_without_retain_graph_is_torchs_error(self):
        data = batch(torch.float64, ())
        hidden = data["hidden"].clone().requires_grad_()
        terms = dflash_objective(hidden, data["weight"], data["ids"],
                                 data["mask"], mode="checkpoint")
        terms.loss.backward()
        with self.assertRaisesRegex(RuntimeError, "second time"):
            terms.loss.backward()

    def test_a_non_finite_upstream_gradient_flows_as_in_fused(self):
        # As a GradScaler's overflowing scale does: inf and NaN reach the
        # gradients, which FUSED multiplies by the upstream too.
        data = batch(torch.float64, ())
        for upstream in (float("nan"), float("inf")):
            grads = {}
            for mode in ("fused", "checkpoint"):
                hidden = data["hidden"].clone().requires_grad_()
                terms = dflash_objective(hidden, data["weight"], data["ids"],
                                         data["mask"], mode=mode)
                (terms.loss * upstream).backward()
                grads[mode] = hidden.grad
            with self.subTest(upstream=upstream):
                torch.testing.assert_close(grads["checkpoint"],
                                           grads["fused"], rtol=0, atol=0,
                                           equal_nan=True)

    def states(self):
        gc.collect()
        return list(objective_module._SAVED.values())

    def test_what_is_held_between_the_passes(self):
        self.assertEqual(self.states(), [])
        data = batch(torch.float32, ())
        active = int((data["mask"] > 0).sum())
        rows = B * N * K
        # A frozen float32 head given its PreparedProjection (one given
        # none lays out its own weight and does not split, below).
        prepared = dflash.PreparedProjection(data["weight"])
        held = {}
        for mode in SPLIT_MODES + ["fused"]:
            hidden = data["hidden"].clone().requires_grad_()
            terms = dflash_objective(hidden, data["weight"], data["ids"],
                                     data["mask"], mode=mode,
                                     prepared_projection=prepared)
            states = self.states()
            if mode == "fused":
                # A single call: no state, its gradients made in forward.
                self.assertEqual(states, [], mode)
                self.assertEqual(terms.diagnostics.stats["saved_bytes"], 0)
            else:
                self.assertEqual(len(states), 1, mode)
                held[mode] = states[0].saved_bytes
                self.assertEqual(terms.diagnostics.stats["saved_bytes"],
                                 held[mode], mode)
            del states
            terms.loss.backward()
            if mode != "fused":
                # Still the forward's figure after backward.
                self.assertEqual(terms.diagnostics.stats["saved_bytes"],
                                 held[mode], mode)
            del terms
            # Freed with the graph once backward has run.
            self.assertEqual(self.states(), [], mode)
        # The rows' state (q, float64, and the target's rank, int32) in
        # every mode; CHECKPOINT and SELECTIVE keep no gradient and no
        # logits; MATERIALIZE and SAVE_CHUNKS every active row's logits
        # gradient (float32).
        self.assertEqual(held["checkpoint"], rows * (8 + 4))
        self.assertEqual(held["selective"], rows * (8 + 4))
        self.assertEqual(held["materialize"], active * V * 4 + rows * (8 + 4))
        self.assertEqual(held["save"], active * V * 4 + rows * (8 + 4))

    def test_a_frozen_float32_head_laying_out_its_own_weight_does_not_split(
            self):
        # Its layout (PreparedProjection.packed_bytes) would be held to the
        # backward; a single call frees it before returning.
        data = batch(torch.float32, ())
        for mode in SPLIT_MODES:
            hidden = data["hidden"].clone().requires_grad_()
            terms = dflash_objective(hidden, data["weight"], data["ids"],
                                     data["mask"], mode=mode)
            self.assertEqual(self.states(), [], mode)
            self.assertEqual(terms.diagnostics.stats["saved_bytes"], 0, mode)
            terms.loss.backward()
            # A trainable one lays nothing out: it splits.
            weight = data["weight"].clone().requires_grad_()
            terms = dflash_objective(hidden, weight, data["ids"],
                                     data["mask"], mode=mode)
            self.assertEqual(len(self.states()), 1, mode)
            terms.loss.backward()

    def test_no_split_forward_only_or_fused(self):
        data = batch(torch.float64, ())
        with torch.no_grad():
            dflash_objective(data["hidden"], data["weight"], data["ids"],
                             data["mask"], mode="checkpoint")
        self.assertEqual(self.states(), [])
        self.assertFalse(dflash._core.splits_backward(
            dflash.objective_config(None, mode="fused")))
        self.assertTrue(dflash._core.splits_backward(
            dflash.objective_config(None, mode="checkpoint")))

    @unittest.skipUnless(hasattr(os, "fork"), "needs fork()")
    def test_a_forked_child_cannot_run_its_parents_backward(self):
        data = batch(torch.float64, ())
        hidden = data["hidden"].clone().requires_grad_()
        terms = dflash_objective(hidden, data["weight"], data["ids"],
                                 data["mask"], mode="checkpoint")
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # The child: report the error's message and leave.
            os.close(read)
            try:
                terms.loss.backward()
                message = "no error"
            except Exception as error:  # pylint: disable=broad-except
                message = f"{type(error).__name__}: {error}"
            os.write(write, message.encode()[:4000])
            os._exit(0)
        os.close(write)
        with os.fdopen(read, "rb") as pipe:
            message = pipe.read().decode()
        os.waitpid(pid, 0)
        self.assertIn("made before fork()", message)
        terms.loss.backward()  # The parent's backward still runs.
        self.assertIsNotNone(hidden.grad)

    @unittest.skipUnless(_library.SUPPORTED, NO_OP)
    def test_opcheck_of_the_split_operator_and_its_backward(self):
        # Every dtype a CPU run takes, with and without each optional
        # gradient: the fake kernels' outputs are the real ones' (an absent
        # gradient's empty output included).
        for loss, extra, train, dtype in (
                ("dflash", (), True, torch.float64),
                ("dflash", (), False, torch.float32),
                ("domino", ("correction",), False, torch.float64),
                ("domino", ("correction",), True, torch.float32),
                ("dspark", ("teacher", "confidence"), False, torch.float64),
                ("dspark", ("teacher", "confidence"), True, torch.float32)):
            data = batch(dtype, extra)
            x = data["hidden"].clone().requires_grad_()
            w = data["weight"].clone().requires_grad_(train)
            z, m, teacher, confidence = [
                data[name].clone().requires_grad_(name != "teacher_hidden")
                if name in data else None
                for name in ("correction_inputs", "correction_weight",
                             "teacher_hidden", "confidence_logits")]
            text = dflash.objective_config(None, loss_type=loss,
                                           mode="checkpoint").text
            args = (x, w, data["ids"], data["mask"], None, teacher,
                    confidence, z, m, text, 0, False, train, True, 0)
            # Each run's token names its own state (an address), so two
            # runs' tokens differ: the eager-vs-traced comparison of every
            # output (test_aot_dispatch_dynamic) cannot apply to the
            # forward; the compiled step below runs it under AOTAutograd.
            # opcheck runs the operator on copies of the tensors, so no
            # PreparedProjection (bound to its own weight) is given: a
            # frozen float32 head then runs as one call, which the fake
            # kernel must agree with.
            torch.library.opcheck(
                torch.ops.dflash.objective.default, args,
                test_utils=("test_schema", "test_autograd_registration",
                            "test_faketensor"))
            outputs = torch.ops.dflash.objective(*args)
            token = outputs[_library.OUTPUTS.index("token")]
            grad_hidden = outputs[_library.OUTPUTS.index("grad_hidden")]
            if not train and dtype == torch.float32:
                self.assertEqual(token.numel(), 0)
                self.assertEqual(grad_hidden.shape, x.shape)
                continue
            self.assertEqual(token.numel(), 1)
            self.assertEqual(grad_hidden.numel(), 0)
            detached = [None if t is None else t.detach()
                        for t in (teacher, confidence, z, m)]
            torch.library.opcheck(
                torch.ops.dflash.objective_backward.default,
                (token, torch.tensor(2.0, dtype=torch.float64), x.detach(),
                 w.detach(), None, *detached, train))

    @unittest.skipUnless(_library.SUPPORTED, NO_OP)
    def test_a_compiled_split_step(self):
        # With a teacher too, whose logits the backward recomputes: the
        # compiled graph keeps it for the backward.
        for loss, extra in (("dflash", ()), ("kl", ("teacher",))):
            data = batch(torch.float64, extra)
            teacher = data.get("teacher_hidden")

            def step(hidden, weight):
                return dflash_objective(
                    hidden, weight, data["ids"], data["mask"],
                    teacher_hidden=teacher, loss_type=loss,
                    mode="checkpoint").loss

            got, want = [], []
            for fn, out in ((step, want), (torch.compile(
                    step, backend="aot_eager", fullgraph=True), got)):
                hidden = data["hidden"].clone().requires_grad_()
                weight = data["weight"].clone().requires_grad_()
                loss_value = fn(hidden, weight)
                (loss_value * 3).backward()
                out += [loss_value.detach(), hidden.grad, weight.grad]
            for a, b in zip(got, want):
                self.assert_same(a, b, 1e-12, f"compiled {loss}")
            self.assertEqual(self.states(), [])

    def test_an_inplace_edit_of_the_teacher_is_torchs_error(self):
        # A split run's backward recomputes the teacher's logits from
        # teacher_hidden: edited in place between the passes, it would read
        # other values than the forward did, so autograd saves it and
        # refuses, as for any tensor a backward needs.
        for mode in ("checkpoint", "selective"):
            with self.subTest(mode):
                data = batch(torch.float64, ("teacher",))
                hidden = data["hidden"].clone().requires_grad_()
                teacher = data["teacher_hidden"].clone()
                terms = dflash_objective(hidden, data["weight"], data["ids"],
                                         data["mask"], teacher_hidden=teacher,
                                         loss_type="kl", mode=mode)
                teacher.add_(1.0)
                with self.assertRaisesRegex(
                        RuntimeError, "modified by an inplace operation"):
                    terms.loss.backward()


if __name__ == "__main__":
    unittest.main(verbosity=2)
