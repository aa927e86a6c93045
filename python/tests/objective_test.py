"""dflash_objective against the independent float64 reference (reference.py)
and finite differences: every loss family in every execution mode, float64
and float32, frozen and trainable heads, upstream gradients and
micro-batches accumulated under a global denominator."""

import unittest

import torch

import dflash
import reference
from dflash.torch import FusedHead, dflash_objective

MODES = ["MATERIALIZE", "SAVE_CHUNKS", "CHECKPOINT", "SELECTIVE", "FUSED"]


def run(f, data, mode="FUSED", dtype=torch.float64, trainable=False,
        use_bias=False, chunk_blocks=2, segment_chunks=2, **kwargs):
    """dflash_objective on a copy of `data` in `dtype`; the leaves it made."""
    hidden = data["hidden"].to(dtype).clone().requires_grad_()
    weight = data["weight"].to(dtype).clone().requires_grad_(trainable)
    bias = (data["bias"].to(dtype).clone().requires_grad_(trainable)
            if use_bias else None)
    # float64 beside float64 hidden (ConfidenceOf), else float32.
    confidence = (data["confidence"].to(
        torch.float64 if dtype == torch.float64 else torch.float32)
                  .clone().requires_grad_() if f.confidence else None)
    teacher = data["teacher"].to(dtype) if f.teacher else None
    terms = dflash_objective(
        hidden, weight, data["target_ids"], data["weight_mask"],
        config=f.config_text(mode, chunk_blocks, segment_chunks),
        lm_head_bias=bias, teacher_hidden=teacher,
        confidence_logits=confidence, **kwargs)
    return terms, (hidden, weight, bias, confidence)


def expected(f, data, trainable=False, use_bias=False):
    """The reference terms and leaves, in float64."""
    hidden = data["hidden"].double().clone().requires_grad_()
    weight = data["weight"].double().clone().requires_grad_(trainable)
    bias = (data["bias"].double().clone().requires_grad_(trainable)
            if use_bias else None)
    confidence = (data["confidence"].double().clone().requires_grad_()
                  if f.confidence else None)
    terms = reference.objective(
        f, hidden, weight, data["target_ids"], data["weight_mask"], bias=bias,
        teacher=data["teacher"] if f.teacher else None, confidence=confidence)
    return terms, (hidden, weight, bias, confidence)


class ObjectiveParityTest(unittest.TestCase):
    def assertClose(self, actual, wanted, rtol, what):
        torch.testing.assert_close(actual.double(), wanted.double(), rtol=rtol,
                                   atol=rtol, msg=lambda m: f"{what}: {m}")

    def check(self, f, data, mode, dtype, trainable, use_bias, rtol):
        terms, leaves = run(f, data, mode, dtype, trainable, use_bias)
        want, want_leaves = expected(f, data, trainable, use_bias)
        # The loss and its gradient with the same normalisation as SpecForge.
        (terms.loss_num / terms.loss_den).backward()
        (want[0] / want[1]).backward()
        diag = terms.diagnostics
        # reference.objective's order: the four core terms (which unpack
        # first), then the per-position and probability numerators.
        got = tuple(terms[:4]) + (diag.position_correct, diag.position_den,
                                  diag.target_probability_num)
        names = ["loss_num", "loss_den", "correct_num", "accuracy_den",
                 "position_correct", "position_den", "target_probability_num"]
        self.assertEqual(len(want), len(names))
        for name, actual, wanted in zip(names, got, want):
            self.assertClose(actual, wanted.detach(), rtol, name)
        for name, leaf, want_leaf in zip(
                ["hidden", "weight", "bias", "confidence"], leaves, want_leaves):
            if want_leaf is None or not want_leaf.requires_grad:
                continue
            # Relative to the gradient's scale, as float32 rounds it; the
            # confidence gradient is in the confidence logits' dtype.
            self.assertEqual(leaf.grad.dtype, leaf.dtype, name)
            scale = want_leaf.grad.abs().max().clamp(min=1e-30)
            self.assertClose(leaf.grad / scale, want_leaf.grad / scale, rtol,
                             f"d(loss)/d({name})")

    def test_every_family_and_mode_in_float64(self):
        data = reference.batch(seed=1)
        for f in reference.FAMILIES:
            for mode in MODES:
                with self.subTest(family=f.name, mode=mode):
                    self.check(f, data, mode, torch.float64, trainable=False,
                               use_bias=False, rtol=1e-10)

    def test_float32_confidence_beside_float64_hidden(self):
        # Upcast exactly: the float64 logits' terms, and their gradient
        # back in float32 (the float64 one, rounded once).
        data = reference.batch(seed=4)
        f = next(f for f in reference.FAMILIES if f.confidence)
        want, (_, _, _, c64) = run(f, data)
        (want.loss_num / want.loss_den).backward()
        c32 = data["confidence"].float().clone().requires_grad_()
        got = dflash_objective(
            data["hidden"].double(), data["weight"].double(),
            data["target_ids"], data["weight_mask"],
            config=f.config_text("FUSED", 2, 2),
            teacher_hidden=data["teacher"].double(), confidence_logits=c32)
        (got.loss_num / got.loss_den).backward()
        self.assertEqual(float(got.loss_num), float(want.loss_num))
        self.assertEqual(c32.grad.dtype, torch.float32)
        self.assertTrue(torch.equal(c32.grad, c64.grad.float()))

    def test_every_family_and_mode_in_float32(self):
        data = reference.batch(seed=2)
        for f in reference.FAMILIES:
            for mode in MODES:
                with self.subTest(family=f.name, mode=mode):
                    self.check(f, data, mode, torch.float32, trainable=False,
                               use_bias=False, rtol=1e-5)

    def test_trainable_weight_and_bias(self):
        data = reference.batch(seed=3)
        for f in reference.FAMILIES:
            for mode in ("CHECKPOINT", "FUSED"):
                for dtype, rtol in ((torch.float64, 1e-10), (torch.float32, 1e-5)):
                    with self.subTest(family=f.name, mode=mode, dtype=dtype):
                        self.check(f, data, mode, dtype, trainable=True,
                                   use_bias=True, rtol=rtol)

    def test_frozen_bias(self):
        data = reference.batch(seed=4)
        self.check(reference.FAMILIES[0], data, "FUSED", torch.float64,
                   trainable=False, use_bias=True, rtol=1e-10)

    def test_upstream_gradient_other_than_one(self):
        f = reference.FAMILIES[0]
        data = reference.batch(seed=5)
        for mode in MODES:
            with self.subTest(mode=mode):
                terms, (hidden, weight, bias, _) = run(
                    f, data, mode, trainable=True, use_bias=True)
                want, (ref_hidden, ref_weight, ref_bias, _) = expected(
                    f, data, trainable=True, use_bias=True)
                # Not divided by the denominator at all: d(2.5 * num).
                (2.5 * terms.loss_num).backward()
                (2.5 * want[0]).backward()
                for leaf, ref in ((hidden, ref_hidden), (weight, ref_weight),
                                  (bias, ref_bias)):
                    torch.testing.assert_close(leaf.grad, ref.grad, rtol=1e-10,
                                               atol=1e-10)

    def test_micro_batches_under_a_global_denominator(self):
        f = reference.FAMILIES[2]  # dpace: a denominator from the weights.
        first, second = reference.batch(seed=6), reference.batch(seed=7)
        weight = first["weight"].clone().requires_grad_()
        ref_weight = first["weight"].clone().requires_grad_()
        terms, grads, ref_terms, ref_grads = [], [], [], []
        for data in (first, second):
            hidden = data["hidden"].clone().requires_grad_()
            terms.append((dflash_objective(
                hidden, weight, data["target_ids"], data["weight_mask"],
                config=f.config_text("FUSED", 1, 1)), hidden))
            ref_hidden = data["hidden"].clone().requires_grad_()
            ref_terms.append((reference.objective(
                f, ref_hidden, ref_weight, data["target_ids"],
                data["weight_mask"]), ref_hidden))
        # As a trainer does: each micro-batch's backward divided by the
        # denominator of all of them (known after both forwards), summed in
        # place as an all_reduce would.
        total = torch.zeros_like(terms[0][0].loss_den)
        for t, _ in terms:
            total.add_(t.loss_den)
            t.loss_den.mul_(1.0)  # In place on an output: allowed.
        ref_total = sum(t[1] for t, _ in ref_terms)
        for (t, _), (r, _) in zip(terms, ref_terms):
            (t.loss_num / total).backward()
            (r[0] / ref_total).backward()
        torch.testing.assert_close(weight.grad, ref_weight.grad, rtol=1e-10,
                                   atol=1e-10)
        for (_, hidden), (_, ref_hidden) in zip(terms, ref_terms):
            torch.testing.assert_close(hidden.grad, ref_hidden.grad,
                                       rtol=1e-10, atol=1e-10)
        self.assertEqual(weight.grad.shape, weight.shape)


class FiniteDifferenceTest(unittest.TestCase):
    """torch.autograd.gradcheck: numerical against analytic gradients, for
    the families whose weights carry no stop-gradient (D-PACE, lk-lambda and
    DSpark's acceptance are without gradient by definition). With a teacher,
    only hidden moves: the frozen teacher projection shares the weight but
    has no gradient by definition."""

    def test_gradcheck(self):
        data = reference.batch(seed=8, B=1, N=2, K=3, H=4, V=7)
        names = {"dflash", "dflash-ce-options", "dflash-softcap", "tv", "kl",
                 "reverse-kl", "jsd"}
        for f in (f for f in reference.FAMILIES if f.name in names):
            with self.subTest(family=f.name):
                def loss_num(hidden, weight=data["weight"], bias=data["bias"]):
                    return dflash_objective(
                        hidden, weight, data["target_ids"], data["weight_mask"],
                        config=f.config_text("FUSED", 1, 1), lm_head_bias=bias,
                        teacher_hidden=data["teacher"] if f.teacher else None,
                    ).loss_num
                inputs = (data["hidden"].clone().requires_grad_(),)
                if not f.teacher:
                    inputs += (data["weight"].clone().requires_grad_(),
                               data["bias"].clone().requires_grad_())
                self.assertTrue(torch.autograd.gradcheck(
                    loss_num, inputs, eps=1e-6, atol=1e-7, rtol=1e-5))

    def test_gradcheck_dspark_confidence(self):
        f = next(f for f in reference.FAMILIES if f.name == "dspark")
        data = reference.batch(seed=9, B=1, N=2, K=3, H=4, V=7)

        def loss_num(confidence):
            return dflash_objective(
                data["hidden"], data["weight"], data["target_ids"],
                data["weight_mask"], config=f.config_text("FUSED", 1, 1),
                teacher_hidden=data["teacher"], confidence_logits=confidence,
            ).loss_num

        # float64 confidence logits beside float64 hidden: gradcheck's own
        # tolerances, as for the states.
        confidence = data["confidence"].double().clone().requires_grad_()
        self.assertTrue(torch.autograd.gradcheck(
            loss_num, (confidence,), eps=1e-6, atol=1e-7, rtol=1e-5))


class Float64MaskTest(unittest.TestCase):
    """A float64 run keeps float64 weight masks (1/3, decay weights) exactly:
    terms and gradients within 1e-12 of plain torch in float64."""

    def batch(self, seed=3, B=2, N=3, K=4, H=6, V=11):
        generator = torch.Generator().manual_seed(seed)
        hidden = torch.randn(B, N, K, H, generator=generator,
                             dtype=torch.float64)
        weight = torch.randn(V, H, generator=generator, dtype=torch.float64)
        target_ids = torch.randint(0, V, (B, N, K), generator=generator)
        return hidden, weight, target_ids

    def masks(self, shape):
        k = torch.arange(shape[2], dtype=torch.float64)
        thirds = torch.full(shape, 1.0 / 3, dtype=torch.float64)
        thirds[0, 1] = 2.0 / 3
        thirds[1, 0, 1] = 0.0
        # SpecForge's decayed weights handed over as the mask.
        decayed = torch.exp(-k / 5.0).expand(shape) * thirds
        return {"thirds": thirds, "decayed": decayed}

    def assertClose(self, actual, wanted, what):
        torch.testing.assert_close(actual, wanted, rtol=1e-12, atol=1e-12,
                                   msg=lambda m: f"{what}: {m}")

    def test_ce_with_float64_masks(self):
        hidden, weight, target_ids = self.batch()
        for name, mask in self.masks(target_ids.shape).items():
            for gamma in (None, 7.0):
                loss = "dflash { }" if gamma is None else (
                    f"dflash {{ gamma: {gamma} }}")
                what = f"{name} gamma {gamma}"
                h = hidden.clone().requires_grad_()
                w = weight.clone().requires_grad_()
                terms = dflash_objective(
                    h, w, target_ids, mask,
                    config=f"chunking {{ blocks_per_chunk: 2 }} "
                           f"loss {{ {loss} }}")
                self.assertEqual(terms.loss_num.dtype, torch.float64)
                (terms.loss_num / terms.loss_den).backward()
                # Plain torch: CE weighted by mask x exp(-max(k - 1, 0) /
                # gamma).
                h_ref = hidden.clone().requires_grad_()
                w_ref = weight.clone().requires_grad_()
                k = torch.arange(hidden.shape[2], dtype=torch.float64)
                row_w = mask * (1.0 if gamma is None else
                                torch.exp(-(k - 1).clamp(min=0) / gamma))
                ce = torch.nn.functional.cross_entropy(
                    (h_ref @ w_ref.T).flatten(0, 2), target_ids.flatten(),
                    reduction="none").view_as(row_w)
                loss_num, loss_den = (row_w * ce).sum(), row_w.sum()
                (loss_num / loss_den).backward()
                self.assertClose(terms.loss_num, loss_num.detach(),
                                 f"{what} loss_num")
                self.assertClose(terms.loss_den, loss_den, f"{what} loss_den")
                self.assertClose(terms.accuracy_den, mask.sum(),
                                 f"{what} accuracy_den")
                self.assertClose(h.grad, h_ref.grad, f"{what} d/d(hidden)")
                self.assertClose(w.grad, w_ref.grad, f"{what} d/d(weight)")

    def test_float32_runs_round_float64_masks(self):
        # A float32 run takes the masks in float32, as before: a float64
        # mask gives what its float32 rounding gives.
        hidden, weight, target_ids = self.batch()
        mask = self.masks(target_ids.shape)["thirds"]
        runs = [dflash_objective(hidden.float(), weight.float(), target_ids, m,
                                 config="loss { dflash { gamma: 7 } }")
                for m in (mask, mask.float())]
        for name in ("loss_num", "loss_den", "correct_num", "accuracy_den"):
            self.assertEqual(getattr(runs[0], name).item(),
                             getattr(runs[1], name).item(), name)


class RowOutputsTest(unittest.TestCase):
    def test_neg_log_q_argmax_and_top_k(self):
        f = reference.FAMILIES[0]
        data = reference.batch(seed=10)
        terms, _ = run(f, data, return_rows=True, top_k=3)
        rows = terms.diagnostics
        z = data["hidden"] @ data["weight"].T
        nll = torch.logsumexp(z, -1) - z.gather(
            -1, data["target_ids"].unsqueeze(-1)).squeeze(-1)
        weighted = data["weight_mask"] > 0
        self.assertEqual(rows.neg_log_q.dtype, torch.float64)
        torch.testing.assert_close(rows.neg_log_q[weighted],
                                   nll[weighted].double(), rtol=1e-12,
                                   atol=1e-12)
        self.assertTrue(torch.equal(rows.argmax[weighted],
                                    z.argmax(-1)[weighted]))
        self.assertTrue(torch.equal(rows.top_k[weighted],
                                    z.topk(3, dim=-1).indices[weighted]))
        self.assertTrue((rows.argmax[~weighted] == -1).all())
        self.assertTrue((rows.neg_log_q[~weighted] == 0).all())
        self.assertEqual(rows.argmax.dtype, torch.int64)

    def test_accuracy_per_position_and_stats(self):
        data = reference.batch(seed=11)
        terms, _ = run(reference.FAMILIES[0], data, mode="CHECKPOINT")
        diag = terms.diagnostics
        acc = diag.accuracy_per_position
        self.assertEqual(acc[0].item(), 0)  # k = 0 never carries a mask.
        torch.testing.assert_close(
            acc[1:], diag.position_correct[1:] / diag.position_den[1:])
        self.assertEqual(diag.stats["mode"], "CHECKPOINT")
        self.assertEqual(diag.stats["chunks"], 3)  # 6 blocks, 2 a chunk.
        # CHECKPOINT recomputes in backward (split from forward), whose
        # work the stats then include.
        self.assertEqual(diag.stats["segment_recomputes"], 0)
        terms.loss.backward()
        self.assertGreater(diag.stats["segment_recomputes"], 0)
        self.assertIsNone(diag.neg_log_q)

    def test_no_grad_runs_without_a_graph(self):
        data = reference.batch(seed=12)
        with torch.no_grad():
            terms, _ = run(reference.FAMILIES[0], data)
        self.assertIsNone(terms.loss_num.grad_fn)
        self.assertFalse(terms.loss_num.requires_grad)


class FusedHeadTest(unittest.TestCase):
    def test_wraps_a_frozen_linear(self):
        data = reference.batch(seed=13)
        V, H = data["weight"].shape
        linear = torch.nn.Linear(H, V, dtype=torch.float64)
        with torch.no_grad():
            linear.weight.copy_(data["weight"])
            linear.bias.copy_(data["bias"])
        head = FusedHead(linear, loss_type="dflash", gamma=7.0, chunk_blocks=2)
        self.assertFalse(linear.weight.requires_grad)
        hidden = data["hidden"].clone().requires_grad_()
        loss_num, loss_den, correct_num, accuracy_den, *_ = head(
            hidden, data["target_ids"], data["weight_mask"])
        (loss_num / loss_den).backward()
        f = reference.FAMILIES[0]
        ref_hidden = data["hidden"].clone().requires_grad_()
        want = reference.objective(f, ref_hidden, data["weight"],
                                   data["target_ids"], data["weight_mask"],
                                   bias=data["bias"])
        (want[0] / want[1]).backward()
        torch.testing.assert_close(loss_num, want[0].detach(), rtol=1e-10,
                                   atol=1e-10)
        torch.testing.assert_close(hidden.grad, ref_hidden.grad, rtol=1e-10,
                                   atol=1e-10)
        self.assertIsNone(linear.weight.grad)

    def test_float32_keeps_its_layout_until_the_weight_changes(self):
        data = reference.batch(seed=14, dtype=torch.float32)
        V, H = data["weight"].shape
        linear = torch.nn.Linear(H, V)
        with torch.no_grad():
            linear.weight.copy_(data["weight"])
            linear.bias.copy_(data["bias"])
        head = FusedHead(linear, chunk_blocks=2)

        def run():
            hidden = data["hidden"].clone().requires_grad_()
            terms = head(hidden, data["target_ids"], data["weight_mask"])
            terms.loss.backward()
            return terms.loss.detach(), hidden.grad

        def want():
            hidden = data["hidden"].double().requires_grad_()
            num, den, *_ = reference.objective(
                reference.FAMILIES[0], hidden, linear.weight.double(),
                data["target_ids"], data["weight_mask"],
                bias=linear.bias.double())
            (num / den).backward()
            return (num / den).detach(), hidden.grad

        for _ in range(2):
            loss, grad = run()
            ref_loss, ref_grad = want()
            torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5,
                                       atol=1e-6)
            torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-4,
                                       atol=1e-6)
        first = head._prepared
        self.assertIsNotNone(first)
        self.assertGreater(first.packed_bytes, 0)
        run()
        self.assertIs(head._prepared, first)  # Kept across calls.
        with torch.no_grad():
            linear.weight.mul_(0.5)  # Changed in place: laid out again there.
        loss, grad = run()
        self.assertIs(head._prepared, first)
        ref_loss, ref_grad = want()
        torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5,
                                   atol=1e-6)
        torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-4,
                                   atol=1e-6)

    def test_a_prepared_projection_must_be_of_the_weight(self):
        data = reference.batch(seed=15, dtype=torch.float32)
        other = dflash.PreparedProjection(data["weight"].clone())
        with self.assertRaisesRegex(
                ValueError, "^prepared_projection: was made from other "
                "tensors than lm_head_weight and lm_head_bias"):
            dflash_objective(data["hidden"], data["weight"], data["target_ids"],
                             data["weight_mask"], prepared_projection=other)
        with self.assertRaisesRegex(ValueError,
                                    "lm_head_weight: must be float32"):
            dflash.PreparedProjection(data["weight"].double())

    def test_rejects_other_modules(self):
        with self.assertRaisesRegex(TypeError, "lm_head: must be a torch.nn.Linear"):
            FusedHead(torch.nn.Embedding(3, 4))


class ConfigTest(unittest.TestCase):
    def test_sources_and_overrides(self):
        default = dflash.objective_config()
        self.assertIn("gamma: 7", default.text)
        changed = dflash.objective_config(default, loss_type="tv", gamma=3.0,
                                          mode="checkpoint")
        self.assertIn("tv {\n    gamma: 3", changed.text)
        self.assertIn("mode: CHECKPOINT", changed.text)
        from_text = dflash.objective_config("loss { tv { gamma: 2 } }")
        self.assertIn("tv", from_text.text)
        with self.assertRaisesRegex(TypeError, "config: must be None"):
            dflash.objective_config(3)


if __name__ == "__main__":
    unittest.main(verbosity=2)
