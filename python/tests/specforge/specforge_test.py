"""dflash.specforge.apply() against SpecForge's own OnlineDFlashModel.

SpecForge's model runs forward and backward on small CPU batches with a
small stand-in draft network (as in SpecForge's own loss tests), once as
shipped and once after apply(): the loss, accuracy, every metric and every
gradient must agree (float64 1e-9 relative, float32 2e-5), with one head
call per batch and no fallback. The fallbacks must warn once, naming why,
and give SpecForge's own result; revert() must restore SpecForge's
functions.

Needs the installed specforge 0.2.0 (pip install --no-deps specforge==0.2.0,
and transformers, which its model module imports): CI's torch 2.15 venv has
it. Where SpecForge cannot be imported (Debian's torch 1.13) the model
tests skip, saying why.
"""

import contextlib
import importlib
import unittest
import warnings

import torch
import torch.nn as nn

import dflash.specforge as dsf

MODULE = "specforge.algorithms.common.dflash_family_model"
try:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flash_attn is not installed, ...
        sf = importlib.import_module(MODULE)
    NO_SPECFORGE = None
except Exception as error:  # noqa: BLE001 - any import failure skips.
    sf = None
    NO_SPECFORGE = (
        f"SpecForge's {MODULE} does not import here ({type(error).__name__}: "
        f"{error}); CI installs specforge==0.2.0 --no-deps and transformers "
        "into its torch 2.15 venv (run with DFLASH_TEST_PYTHON naming it)")

B, S, K, H, HT, V = 2, 22, 4, 16, 12, 23
TOLERANCE = {torch.float64: 1e-9, torch.float32: 2e-5}
DPACE = ("dpace", "dpace-cumulative-confidence-only",
         "dpace-continuation-value-only")


class TinyDraft(nn.Module):
    """Stands in for DFlashDraftModel: the draft's output states from the
    noise embedding, the context states and the draft positions."""

    sliding_window = None

    def __init__(self):
        super().__init__()
        self.noise = nn.Linear(H, H)
        self.context = nn.Linear(HT, H, bias=False)
        self.position = nn.Embedding(S + K + 1, H)

    def forward(self, position_ids, noise_embedding, target_hidden,
                attention_mask):
        draft_positions = position_ids[:, target_hidden.shape[1]:]
        context = self.context(target_hidden.mean(dim=1, keepdim=True))
        return 2 * torch.tanh(self.noise(noise_embedding) + context
                              + self.position(draft_positions))


class TinyDominoDraft(TinyDraft):
    """Domino's draft: a correction of the logits from the previous
    tokens' embeddings."""

    def __init__(self):
        super().__init__()
        self.correction = nn.Linear(H, V, bias=False)

    def apply_logits_head(self, base_logits, hidden_states,
                          prev_token_embeddings):
        return base_logits + self.correction(prev_token_embeddings)


class TinyDSparkDraft(TinyDraft):
    """DSpark's draft: a Markov bias from the previous token, no
    confidence head."""

    def __init__(self):
        super().__init__()
        self.markov = nn.Embedding(V, V)

    def apply_logits_head(self, base_logits, prev_token_ids, hidden_states):
        return base_logits + self.markov(prev_token_ids)

    def predict_confidence(self, hidden, prev_token_ids):
        return None


class CappedHead(nn.Module):
    """A head that is not an nn.Linear weight: a softcapped projection."""

    def __init__(self, linear):
        super().__init__()
        self.linear = linear

    def forward(self, hidden):
        return 5 * torch.tanh(self.linear(hidden) / 5)


def batch(dtype, mask_dtype=None, width=HT):
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, V - 1, (B, S), generator=generator)
    hidden_states = torch.randn(B, S, width, generator=generator, dtype=dtype)
    loss_mask = torch.ones(B, S, dtype=mask_dtype or dtype)
    loss_mask[0, :3] = 0          # prompts
    loss_mask[1, :10] = 0
    loss_mask[1, -5:] = 0         # padding: 2 of its anchors are padding
    loss_mask[0, 12] = 0.75       # a fractional weight
    return input_ids, hidden_states, loss_mask


def build(loss_type="dflash", gamma=None, chunk=2, dtype=torch.float64,
          alpha=0.5, head_grad=False, bias=False, num_anchors=8,
          draft=TinyDraft):
    torch.manual_seed(0)
    head = nn.Linear(H, V, bias=bias)
    with torch.no_grad():
        head.weight.mul_(6)
    head.requires_grad_(head_grad)
    model = sf.OnlineDFlashModel(
        draft(), head, nn.Embedding(V, H), mask_token_id=V - 1,
        block_size=K, attention_backend="sdpa", num_anchors=num_anchors,
        loss_decay_gamma=gamma, objective_chunk_blocks=chunk,
        loss_type=loss_type, dpace_alpha=alpha)
    return model.to(dtype)


def step(model, inputs, grad=True):
    """SpecForge's forward and backward: every output and gradient."""
    input_ids, hidden_states, loss_mask = inputs
    hidden_states = hidden_states.clone().requires_grad_(grad)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)  # SpecForge's anchors are random.
    with torch.set_grad_enabled(grad):
        loss, accuracy, metrics = model(input_ids, hidden_states, loss_mask)
    if grad:
        loss.backward()
    out = {"loss": loss, "accuracy": accuracy,
           "accuracy_denom": metrics["accuracy_denom"],
           "acc_num": metrics["ratio_metrics"]["acc"][0],
           "acc_den": metrics["ratio_metrics"]["acc"][1],
           "loss_terms_num": metrics["loss_terms"][0],
           "loss_terms_den": metrics["loss_terms"][1]}
    if grad:
        out["grad hidden_states"] = hidden_states.grad
        for name, p in model.named_parameters():
            if p.requires_grad:
                out[f"grad {name}"] = p.grad
    return out


class Counting:
    """Counts the head's calls (dflash_objective as dflash.specforge calls
    it)."""

    def __init__(self):
        self.calls = 0
        self.original = dsf.dflash_objective

    def __enter__(self):
        def counted(*args, **kwargs):
            self.calls += 1
            return self.original(*args, **kwargs)
        dsf.dflash_objective = counted
        return self

    def __exit__(self, *exc):
        dsf.dflash_objective = self.original


class Case(unittest.TestCase):
    def setUp(self):
        if NO_SPECFORGE:
            self.skipTest(NO_SPECFORGE)
        dsf.revert()
        self.addCleanup(dsf.revert)

    def assertSame(self, got, want, tolerance, what="", loose=None):
        """`loose` names outputs (by prefix) compared with another
        tolerance."""
        self.assertEqual(sorted(got), sorted(want), what)
        for name, reference in want.items():
            value = got[name]
            where = f"{what} {name}"
            rtol = next((t for prefix, t in (loose or {}).items()
                         if name.startswith(prefix)), tolerance)
            self.assertIs(type(value), type(reference), where)
            self.assertEqual(value.dtype, reference.dtype, where)
            self.assertEqual(value.device, reference.device, where)
            self.assertEqual(value.shape, reference.shape, where)
            self.assertEqual(value.requires_grad, reference.requires_grad,
                             where)
            finite = reference.detach()[reference.detach().isfinite()]
            scale = finite.abs().max().item() if finite.numel() else 0.0
            torch.testing.assert_close(
                value.detach(), reference.detach(), rtol=rtol,
                atol=rtol * scale, equal_nan=True, msg=lambda m: (
                    f"{where}: {m}"))

    def compare(self, what, tolerance=None, heads=1, fallback=False,
                inputs=None, grad=True, apply_kwargs=None, hits=True,
                **kwargs):
        """The shipped model against the patched one: `heads` head calls
        per step, and no fallback unless `fallback`."""
        dtype = kwargs.get("dtype", torch.float64)
        inputs = inputs or batch(dtype)
        shipped = step(build(**kwargs), inputs, grad)
        dsf.apply(**(apply_kwargs or {}))
        try:
            with warnings.catch_warnings(record=True) as caught, \
                    Counting() as counter:
                warnings.simplefilter("always")
                patched = step(build(**kwargs), inputs, grad)
        finally:
            dsf.revert()
        fallbacks = [w for w in caught
                     if issubclass(w.category, dsf.SpecForgeFallbackWarning)]
        if not fallback:
            self.assertEqual(fallbacks, [], what)
        self.assertEqual(counter.calls, heads, what)
        if hits:  # Some argmax hits, so that correct_num is tested.
            self.assertGreater(shipped["acc_num"].item(), 0, what)
        self.assertSame(patched, shipped,
                        tolerance or TOLERANCE[dtype], what)
        return shipped, patched, fallbacks


class ParityTest(Case):
    def test_dflash_loss(self):
        for dtype in (torch.float64, torch.float32):
            for gamma in (None, 0.0, 7.0, 2.5):
                for chunk in (0, 1, 2, 128):
                    self.compare(f"dflash gamma {gamma} chunk {chunk} {dtype}",
                                 dtype=dtype, gamma=gamma, chunk=chunk)

    def test_dpace_variants(self):
        for dtype in (torch.float64, torch.float32):
            for loss_type in DPACE:
                for alpha in (0.5, 0.2):
                    for chunk in (0, 2):
                        self.compare(f"{loss_type} alpha {alpha} chunk "
                                     f"{chunk} {dtype}", dtype=dtype,
                                     loss_type=loss_type, alpha=alpha,
                                     chunk=chunk)

    def test_dpace_alpha_at_its_bounds(self):
        for dtype in (torch.float64, torch.float32):
            for loss_type in DPACE:
                for alpha in (0.0, 1.0):
                    self.compare(f"{loss_type} alpha {alpha} {dtype}",
                                 dtype=dtype, loss_type=loss_type,
                                 alpha=alpha)

    def test_trainable_head_with_bias(self):
        for dtype in (torch.float64, torch.float32):
            for loss_type in ("dflash", "dpace"):
                shipped, _, _ = self.compare(
                    f"{loss_type} trainable head {dtype}", dtype=dtype,
                    loss_type=loss_type, gamma=7.0, head_grad=True,
                    bias=True)
                self.assertIn("grad lm_head.weight", shipped)
                self.assertIn("grad lm_head.bias", shipped)

    def test_float32_states_with_a_float64_loss_mask(self):
        # SpecForge's loss terms are then float64 (the mask's dtype).
        for loss_type in ("dflash", "dpace-continuation-value-only"):
            shipped, _, _ = self.compare(
                f"{loss_type} mixed", dtype=torch.float32, gamma=7.0,
                loss_type=loss_type,
                inputs=batch(torch.float32, torch.float64))
            self.assertEqual(shipped["loss_terms_num"].dtype, torch.float64)

    def test_without_gradients(self):
        for loss_type in ("dflash", "dpace"):
            self.compare(f"{loss_type} no_grad", loss_type=loss_type,
                         gamma=7.0, grad=False)

    def test_other_head_modes(self):
        for mode in ("checkpoint", "materialize"):
            self.compare(f"mode {mode}", gamma=7.0, chunk=1,
                         apply_kwargs={"mode": mode, "threads": 1})

    def test_the_chunk_function_itself(self):
        # Called directly (as SpecForge's forward does per chunk without the
        # reduction): the same tuple of four tensors.
        torch.manual_seed(3)
        hidden = torch.randn(1, 3, K, H, dtype=torch.float64,
                             requires_grad=True)
        targets = torch.randint(0, V, (1, 3, K))
        mask = (torch.rand(1, 3, K, dtype=torch.float64) > 0.2).double()
        mask[..., 0] = 0
        for loss_type in ("dflash",) + DPACE:
            model = build(loss_type=loss_type, gamma=3.0)
            want = model._dflash_objective_chunk_terms(hidden, targets, mask)
            (want_grad,) = torch.autograd.grad(want[0], hidden)
            dsf.apply()
            with Counting() as counter:
                got = model._dflash_objective_chunk_terms(hidden, targets,
                                                          mask)
            dsf.revert()
            self.assertEqual(counter.calls, 1)
            self.assertIs(type(got), tuple)
            self.assertEqual(len(got), 4)
            (got_grad,) = torch.autograd.grad(got[0], hidden)
            self.assertSame(dict(enumerate(got)), dict(enumerate(want)),
                            1e-9, loss_type)
            self.assertSame({0: got_grad}, {0: want_grad}, 1e-9, loss_type)


def specforge_draft():
    """SpecForge's own DFlashDraftModel, two tiny Qwen3 layers over one
    target layer's states (width H), attention through sdpa."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Config
    from specforge.modeling.draft.dflash import DFlashDraftModel
    config = Qwen3Config(
        hidden_size=H, intermediate_size=2 * H, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=H // 2,
        vocab_size=V, max_position_embeddings=2 * S)
    config.block_size = K
    config.num_target_layers = 4
    config.dflash_config = {"target_layer_ids": [1], "mask_token_id": V - 1}
    config._attn_implementation = "sdpa"
    return DFlashDraftModel(config)


class SpecForgeDraftTest(Case):
    """The same parity with SpecForge's own draft network in place of the
    stand-in."""

    def test_dflash_draft_model(self):
        for dtype in (torch.float64, torch.float32):
            for loss_type, gamma in (("dflash", 7.0), ("dpace", None)):
                shipped, _, _ = self.compare(
                    f"DFlashDraftModel {loss_type} {dtype}", dtype=dtype,
                    loss_type=loss_type, gamma=gamma,
                    draft=specforge_draft, inputs=batch(dtype, width=H),
                    hits=False)
                self.assertIn("grad draft_model.fc.weight", shipped)


class FallbackTest(Case):
    def expect_fallback(self, what, words, heads=0, **kwargs):
        _, _, fallbacks = self.compare(what, heads=heads, fallback=True,
                                       **kwargs)
        self.assertEqual(len(fallbacks), 1,
                         [str(w.message) for w in fallbacks])
        message = str(fallbacks[0].message)
        for word in words:
            self.assertIn(word, message)
        return message

    def test_a_head_that_is_not_a_linear(self):
        original = build

        def capped(**kwargs):
            model = original(**kwargs)
            model.lm_head = CappedHead(model.lm_head)
            return model

        globals()["build"] = capped
        try:
            self.expect_fallback("capped head", ["CappedHead",
                                                 "not a torch.nn.Linear"])
        finally:
            globals()["build"] = original

    def test_a_head_with_a_forward_hook(self):
        original = build

        def hooked(**kwargs):
            model = original(**kwargs)
            model.lm_head.register_forward_hook(
                lambda module, args, out: out * 0.5)
            return model

        globals()["build"] = hooked
        try:
            self.expect_fallback("hooked head", ["forward or backward hooks"])
        finally:
            globals()["build"] = original

    def test_autocast(self):
        original = step

        def autocast_step(model, inputs, grad=True):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return original(model, inputs, grad)

        globals()["step"] = autocast_step
        try:
            self.expect_fallback("autocast", ["autocast"],
                                 dtype=torch.float32)
        finally:
            globals()["step"] = original

    def test_a_decay_that_underflows(self):
        # exp(-(k - 1) / 0.01) is 0 in float32 from k = 3: SpecForge still
        # counts those rows' accuracy, dflash skips rows without weight.
        self.expect_fallback("gamma 0.01", ["loss_decay_gamma=0.01",
                                            "underflows"], gamma=0.01)

    def test_non_finite_states(self):
        inputs = list(batch(torch.float64))
        inputs[1] = inputs[1].clone()
        inputs[1][0, 4, 0] = float("nan")
        # The head is called, refuses, and SpecForge's path gives its NaN.
        self.expect_fallback("nan", ["dflash refused", "finite"], heads=1,
                             inputs=tuple(inputs))

    def chunk_inputs(self):
        torch.manual_seed(4)
        hidden = torch.randn(2, 3, K, H, dtype=torch.float64,
                             requires_grad=True)
        targets = torch.randint(0, V, (2, 3, K))
        mask = torch.ones(2, 3, K, dtype=torch.float64)
        mask[..., 0] = 0
        return hidden, targets, mask

    def direct_fallback(self, hidden, targets, mask, words, **kwargs):
        """Two direct chunk calls that fall back: SpecForge's terms and
        gradient, one warning naming why."""
        model = build(**kwargs)
        want = model._dflash_objective_chunk_terms(hidden, targets, mask)
        (want_grad,) = torch.autograd.grad(want[0], hidden)
        dsf.apply()
        with warnings.catch_warnings(record=True) as caught, \
                Counting() as counter:
            warnings.simplefilter("always")
            got = model._dflash_objective_chunk_terms(hidden, targets, mask)
            again = model._dflash_objective_chunk_terms(hidden, targets, mask)
        dsf.revert()
        self.assertEqual(counter.calls, 0)
        self.assertEqual(len(caught), 1, [str(w.message) for w in caught])
        self.assertIs(caught[0].category, dsf.SpecForgeFallbackWarning)
        for word in words:
            self.assertIn(word, str(caught[0].message))
        (got_grad,) = torch.autograd.grad(got[0], hidden)
        for terms in (got, again):
            self.assertSame(dict(enumerate(terms)), dict(enumerate(want)), 0)
        self.assertSame({0: got_grad}, {0: want_grad}, 0)

    def direct_on_head(self, hidden, targets, mask, **kwargs):
        """A direct chunk call runs on the head (one call, no warning) and
        gives SpecForge's terms and gradient (float64, 1e-9)."""
        model = build(**kwargs)
        want = model._dflash_objective_chunk_terms(hidden, targets, mask)
        (want_grad,) = torch.autograd.grad(want[0], hidden)
        dsf.apply()
        with warnings.catch_warnings(record=True) as caught, \
                Counting() as counter:
            warnings.simplefilter("always")
            got = model._dflash_objective_chunk_terms(hidden, targets, mask)
        dsf.revert()
        self.assertEqual(counter.calls, 1)
        self.assertEqual(caught, [])
        (got_grad,) = torch.autograd.grad(got[0], hidden)
        self.assertSame(dict(enumerate(got)), dict(enumerate(want)), 1e-9)
        self.assertSame({0: got_grad}, {0: want_grad}, 1e-9)
        return want

    def test_a_non_contiguous_chunk_view(self):
        # checkpointed_chunk_reduce's narrow() of a batch of 2 sequences:
        # dflash copies such a hidden once, SpecForge's gradient lands in
        # the view's slice of the batch.
        hidden, targets, mask = self.chunk_inputs()
        view = hidden.narrow(1, 1, 2)
        self.assertFalse(view.is_contiguous())
        for loss_type in ("dflash", "dpace"):
            with self.subTest(loss_type=loss_type):
                want = self.direct_on_head(view, targets.narrow(1, 1, 2),
                                           mask.narrow(1, 1, 2),
                                           loss_type=loss_type, gamma=7.0)
                self.assertEqual(len(want), 4)

    def test_ignored_targets_with_positive_weight(self):
        # SpecForge's cross-entropy gives a -100 target loss 0 while its
        # weight still counts in loss_den and accuracy_den, and q = 1 in
        # D-PACE's products and sums: the head's COUNT convention. A third
        # of the weighted rows, a whole block and a block's first weighted
        # row, so that D-PACE's weights of the rows after them change.
        hidden, targets, mask = self.chunk_inputs()
        targets = targets.clone()
        targets[0, 1, 2] = -100
        targets[1, 0, 1:] = -100
        targets[1, 2, 1] = -100
        mask = mask.clone()
        mask[1, 2, 3] = 0.5
        for loss_type in ("dflash",) + DPACE:
            for gamma in (None, 7.0):
                with self.subTest(loss_type=loss_type, gamma=gamma):
                    want = self.direct_on_head(hidden, targets, mask,
                                               loss_type=loss_type,
                                               gamma=gamma)
                    self.assertGreater(want[0].item(), 0)

    def test_ignored_targets_without_weight_run_on_the_head(self):
        hidden, targets, mask = self.chunk_inputs()
        targets = targets.clone()
        targets[0, 1, 0] = -100   # position 0: no weight
        model = build(gamma=7.0)
        want = model._dflash_objective_chunk_terms(hidden, targets, mask)
        dsf.apply()
        with Counting() as counter:
            got = model._dflash_objective_chunk_terms(hidden, targets, mask)
        self.assertEqual(counter.calls, 1)
        self.assertSame(dict(enumerate(got)), dict(enumerate(want)), 1e-9)

    def test_a_bool_weight_mask(self):
        hidden, targets, mask = self.chunk_inputs()
        self.direct_fallback(hidden, targets, mask > 0, ["torch.bool",
                                                         "weight_mask"])

    def test_each_reason_warns_once_per_apply(self):
        hidden, targets, mask = self.chunk_inputs()
        # Two reasons: a decay weight that underflows, and a bool mask.
        model, decayed = build(), build(gamma=0.01)
        dsf.apply()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                decayed._dflash_objective_chunk_terms(hidden, targets, mask)
                model._dflash_objective_chunk_terms(hidden, targets,
                                                    mask > 0)
        self.assertEqual(len(caught), 2, [str(w.message) for w in caught])
        dsf.revert()
        dsf.apply()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model._dflash_objective_chunk_terms(hidden, targets, mask > 0)
        self.assertEqual(len(caught), 1)


class PatchTest(Case):
    def originals(self):
        return (sf.OnlineDFlashModel.__dict__["_dflash_objective_chunk_terms"],
                sf.checkpointed_chunk_reduce)

    def family_originals(self):
        return (sf.OnlineDSparkModel.__dict__["_dspark_objective_chunk_terms"],
                sf.OnlineDominoModel.__dict__["_domino_objective_chunk_terms"],
                sf.OnlineDominoModel.__dict__["forward"],
                sf.OnlineDSparkModel.__dict__["_compute_dspark_loss"])

    def test_revert_restores_dspark_and_domino(self):
        before = self.family_originals()
        dsf.apply()
        during = self.family_originals()
        for i in range(3):
            self.assertIsNot(during[i], before[i], i)
        self.assertIs(during[3], before[3])  # Read, not replaced.
        dsf.revert()
        self.assertEqual(self.family_originals(), before)

    def test_revert_restores_and_apply_twice_is_harmless(self):
        terms, reduce = self.originals()
        self.assertFalse(dsf.is_applied())
        dsf.apply()
        patched = self.originals()
        self.assertIsNot(patched[0], terms)
        self.assertIsNot(patched[1], reduce)
        dsf.apply()
        self.assertEqual(self.originals(), patched)
        self.assertTrue(dsf.is_applied())
        dsf.revert()
        self.assertEqual(self.originals(), (terms, reduce))
        self.assertFalse(dsf.is_applied())
        dsf.revert()
        self.assertEqual(self.originals(), (terms, reduce))
        # Other users of SpecForge's chunked reduction are passed through.
        self.assertIs(importlib.import_module(
            "specforge.core.chunking").checkpointed_chunk_reduce, reduce)

    def test_reduction_of_other_functions_is_specforges(self):
        dsf.apply()
        x = torch.arange(6.0).view(1, 6)
        got = sf.checkpointed_chunk_reduce(
            lambda t: (t.sum(), t.max()), x, chunk_size=4, dim=1)
        self.assertEqual([t.item() for t in got], [15.0, 8.0])
        with self.assertRaisesRegex(ValueError, "chunk_size must be >= 0"):
            sf.checkpointed_chunk_reduce(lambda t: (t,), x, chunk_size=-1)

    def test_an_unknown_seam_is_refused(self):
        terms, reduce = self.originals()

        def changed(self, hidden, target_ids, weight_mask):
            return terms(self, hidden, target_ids, weight_mask)

        sf.OnlineDFlashModel._dflash_objective_chunk_terms = changed
        try:
            with self.assertRaisesRegex(
                    dsf.SpecForgeVersionError,
                    r"the installed SpecForge \(0\.2\.0\) is not a version "
                    r"whose seam dflash knows \(known: 0\.2\.0\): "
                    r"OnlineDFlashModel\._dflash_objective_chunk_terms"):
                dsf.apply()
            self.assertFalse(dsf.is_applied())
            self.assertIs(sf.checkpointed_chunk_reduce, reduce)
        finally:
            sf.OnlineDFlashModel._dflash_objective_chunk_terms = terms

    def test_apply_twice_with_other_options_is_an_error(self):
        dsf.apply(mode="checkpoint")
        dsf.apply(mode="checkpoint")
        with self.assertRaisesRegex(ValueError, r"already applied with "
                                    r"\{'mode': 'checkpoint'\}; call "
                                    r"revert\(\) before applying the "
                                    r"defaults"):
            dsf.apply()
        self.assertTrue(dsf.is_applied())

    def test_options_are_checked_at_apply(self):
        with self.assertRaises(ValueError):
            dsf.apply(mode="sideways")
        with self.assertRaises(TypeError):
            dsf.apply(threads=1.5)
        self.assertFalse(dsf.is_applied())

    def test_supported_versions(self):
        self.assertEqual(dsf.SUPPORTED_VERSIONS, ("0.2.0",))


def qwen3_config(extra):
    """A tiny Qwen3 config for SpecForge's draft models (one layer, sdpa)."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Config
    config = Qwen3Config(
        hidden_size=H, intermediate_size=2 * H, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=H // 2,
        vocab_size=V, max_position_embeddings=2 * S)
    config.block_size = K
    config.num_target_layers = 4
    config.dflash_config = {"target_layer_ids": [1], "mask_token_id": V - 1,
                            **extra}
    config._attn_implementation = "sdpa"
    return config


def dspark_draft(markov="vanilla", confidence=True, with_markov=True):
    """SpecForge's DSparkDraftModel: a Markov head of `markov`'s kind (None:
    none) and a confidence head."""
    from specforge.modeling.draft.dspark import DSparkDraftModel
    extra = {"enable_confidence_head": confidence,
             "confidence_head_with_markov": bool(markov) and with_markov}
    if markov:
        extra.update(markov_rank=3, markov_head_type=markov)
    return DSparkDraftModel(qwen3_config(extra))


def domino_draft(shift=False, prefix=0):
    """SpecForge's DominoDraftModel: its GRU and embed_proj."""
    from specforge.modeling.draft.domino import DominoDraftModel
    return DominoDraftModel(qwen3_config({
        "emb_dim": 3, "gru_hidden_dim": 5, "shift_label": shift,
        "pure_draft_prefix_len": prefix}))


def family_head():
    torch.manual_seed(0)
    head = nn.Linear(H, V, bias=False)
    with torch.no_grad():
        head.weight.mul_(6)
    return head.requires_grad_(False)


def make_dspark(draft, gamma=None, alphas=(0.1, 0.9, 1.0), chunk=2):
    def make():
        torch.manual_seed(0)
        return sf.OnlineDSparkModel(
            draft(), family_head(), nn.Embedding(V, H), mask_token_id=V - 1,
            block_size=K, attention_backend="sdpa", num_anchors=8,
            loss_decay_gamma=gamma, dspark_ce_loss_alpha=alphas[0],
            dspark_l1_loss_alpha=alphas[1],
            dspark_confidence_head_alpha=alphas[2],
            objective_chunk_blocks=chunk)
    return make


def make_domino(draft, shift=False, gamma=None, chunk=2):
    def make():
        torch.manual_seed(0)
        return sf.OnlineDominoModel(
            draft(), family_head(), nn.Embedding(V, H), mask_token_id=V - 1,
            block_size=K, attention_backend="sdpa", num_anchors=8,
            loss_decay_gamma=gamma, objective_chunk_blocks=chunk,
            shift_label=shift)
    return make


def flatten(prefix, value, out):
    if isinstance(value, dict):
        for key, item in value.items():
            flatten(f"{prefix}.{key}", item, out)
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            flatten(f"{prefix}.{i}", item, out)
    else:
        out[prefix] = value


def family_step(make, dtype, forward_kwargs, width=H):
    """SpecForge's forward and backward of a DSpark or Domino model: the
    loss, accuracy, every metric and every gradient."""
    input_ids, hidden_states, loss_mask = batch(dtype, width=width)
    torch.manual_seed(0)
    model = make().to(dtype)
    states = hidden_states.clone().requires_grad_()
    kwargs = dict(forward_kwargs)
    if kwargs.get("target_last_hidden_states") is True:
        generator = torch.Generator().manual_seed(3)
        kwargs["target_last_hidden_states"] = 2 * torch.randn(
            B, S, H, generator=generator, dtype=dtype)
    torch.manual_seed(7)
    loss, accuracy, metrics = model(input_ids, states, loss_mask, **kwargs)
    loss.backward()
    out = {"loss": loss, "accuracy": accuracy,
           "grad hidden_states": states.grad}
    flatten("metrics", metrics, out)
    for name, p in model.named_parameters():
        if p.grad is not None:
            out[f"grad {name}"] = p.grad
    return out


@contextlib.contextmanager
def float64_upcasts():
    """SpecForge's `.float()` upcasts (of bfloat16 logits, meant) leave
    float64 tensors in float64 inside the DSpark objective, so that its
    L1, softmax and confidence terms are float64 too (as
    tools/specforge_dspark_goldens.py makes its goldens)."""
    original = torch.Tensor.float

    def keeping_float64(self, *args, **kwargs):
        if self.dtype == torch.float64:
            return self
        return original(self, *args, **kwargs)

    compute = sf.OnlineDSparkModel.__dict__["_compute_dspark_loss"]

    def upcasting(self, **kwargs):
        torch.Tensor.float = keeping_float64
        try:
            return compute(self, **kwargs)
        finally:
            torch.Tensor.float = original

    sf.OnlineDSparkModel._compute_dspark_loss = upcasting
    try:
        yield
    finally:
        sf.OnlineDSparkModel._compute_dspark_loss = compute


class FamilyCase(Case):
    def compare_family(self, what, make, dtype=torch.float64, tolerance=None,
                       forward_kwargs=None, heads=1, upcasts=False,
                       loose=None):
        """SpecForge's DSpark or Domino model as shipped and after apply():
        the same outputs and gradients, `heads` head calls, no fallback."""
        forward_kwargs = forward_kwargs or {}
        scope = float64_upcasts if upcasts else contextlib.nullcontext
        with scope():
            shipped = family_step(make, dtype, forward_kwargs)
        dsf.apply()
        try:
            with warnings.catch_warnings(record=True) as caught, \
                    Counting() as counter, scope():
                warnings.simplefilter("always")
                patched = family_step(make, dtype, forward_kwargs)
        finally:
            dsf.revert()
        self.assertEqual([str(w.message) for w in caught], [], what)
        self.assertEqual(counter.calls, heads, what)
        self.assertSame(patched, shipped, tolerance or TOLERANCE[dtype], what,
                        loose)
        return shipped


# SpecForge computes DSpark's L1, softmaxes and confidence terms in float32
# (its .float() upcasts) also for a float64 model.
SPECFORGE_FLOAT32 = 2e-5
# With a decay the head's mask is SpecForge's eval mask times a
# per-position factor (SpecForge's float32 decay over the head's float64
# one, 1 within about 1e-8); the patch divides it out of the per-position
# sums, but DSpark's top-1 probability sums come from the head as scalars,
# weighted by the mask: about 1e-8 relative. Every loss term and gradient
# is within 1e-9.
DECAYED_TOP1 = {"metrics.ratio_metrics.teacher_top1_prob": 1e-7,
                "metrics.ratio_metrics.draft_top1_prob": 1e-7}


class DSparkTest(FamilyCase):
    """OnlineDSparkModel with SpecForge's own DSparkDraftModel (its Markov
    heads and confidence head) through the head: one call per step."""

    def test_markov_heads_and_alphas(self):
        alphas_cases = ((0.1, 0.9, 1.0), (0.3, 0.5, 0.7), (1.0, 0.0, 0.0),
                        (0.0, 1.0, 0.0), (0.0, 0.0, 1.0), (0.5, 0.0, 0.5),
                        (0.0, 0.0, 0.0))
        for markov in ("vanilla", "gated", "rnn", None):
            for alphas in alphas_cases:
                for gamma in (None, 5.0):
                    self.compare_family(
                        f"dspark {markov} {alphas} gamma {gamma}",
                        make_dspark(lambda: dspark_draft(markov), gamma,
                                    alphas),
                        tolerance=SPECFORGE_FLOAT32,
                        forward_kwargs={"target_last_hidden_states": True})

    def test_without_confidence_head_or_teacher(self):
        for markov in ("vanilla", None):
            # No teacher: only CE (SpecForge needs one for L1/confidence).
            self.compare_family(
                f"dspark {markov} CE only",
                make_dspark(lambda: dspark_draft(markov, confidence=False),
                            alphas=(1.0, 0.0, 0.7)))
            self.compare_family(
                f"dspark {markov} L1, no confidence head",
                make_dspark(lambda: dspark_draft(markov, confidence=False),
                            gamma=4.0),
                tolerance=SPECFORGE_FLOAT32,
                forward_kwargs={"target_last_hidden_states": True})

    def test_float64_exact_with_float64_upcasts(self):
        # SpecForge's float32 upcasts kept in float64: every term and
        # gradient within 1e-9, the confidence head's too (the float64 head
        # takes float64 confidence logits). One chunk: SpecForge's
        # checkpoint would recompute it in backward, outside
        # float64_upcasts.
        for markov in ("vanilla", "gated", "rnn", None):
            for alphas in ((0.1, 0.9, 0.0), (0.0, 1.0, 0.0)):
                self.compare_family(
                    f"dspark {markov} {alphas} float64",
                    make_dspark(lambda: dspark_draft(markov,
                                                     confidence=False),
                                alphas=alphas, chunk=0),
                    forward_kwargs={"target_last_hidden_states": True},
                    upcasts=True)
        for markov in ("vanilla", "gated", "rnn", None):
            for alphas in ((0.1, 0.9, 1.0), (0.3, 0.5, 0.7), (0.0, 0.0, 1.0)):
                self.compare_family(
                    f"dspark {markov} {alphas} float64 confidence",
                    make_dspark(lambda: dspark_draft(markov), alphas=alphas,
                                chunk=0),
                    forward_kwargs={"target_last_hidden_states": True},
                    upcasts=True)
        self.compare_family(
            "dspark vanilla float64 gamma 5",
            make_dspark(lambda: dspark_draft("vanilla", confidence=False),
                        gamma=5.0, chunk=0),
            forward_kwargs={"target_last_hidden_states": True}, upcasts=True,
            loose=DECAYED_TOP1)

    def test_float32(self):
        for markov in ("vanilla", "rnn"):
            for gamma in (None, 5.0):
                self.compare_family(
                    f"dspark {markov} float32 gamma {gamma}",
                    make_dspark(lambda: dspark_draft(markov), gamma),
                    dtype=torch.float32,
                    forward_kwargs={"target_last_hidden_states": True})

    def test_chunk_sizes(self):
        for chunk in (0, 1, 128):
            self.compare_family(
                f"dspark chunk {chunk}",
                make_dspark(lambda: dspark_draft("gated"), 5.0, chunk=chunk),
                tolerance=SPECFORGE_FLOAT32,
                forward_kwargs={"target_last_hidden_states": True})


class DominoTest(FamilyCase):
    """OnlineDominoModel with SpecForge's own DominoDraftModel (its GRU and
    embed_proj) through the head: one call per step, lambda_base learnt
    from forward."""

    def test_shift_and_lambda(self):
        for shift in (False, True):
            for prefix in (0, 1):
                for lambda_base in (0.0, 0.5, 1.0):
                    self.compare_family(
                        f"domino shift {shift} prefix {prefix} lambda "
                        f"{lambda_base}",
                        make_domino(lambda: domino_draft(shift, prefix),
                                    shift),
                        forward_kwargs={"lambda_base": lambda_base})

    def test_decay(self):
        for shift in (False, True):
            for lambda_base in (0.0, 0.3):
                self.compare_family(
                    f"domino shift {shift} gamma 7 lambda {lambda_base}",
                    make_domino(lambda: domino_draft(shift), shift, 7.0),
                    forward_kwargs={"lambda_base": lambda_base})

    def test_float32_and_chunks(self):
        for shift in (False, True):
            for chunk in (0, 1, 128):
                self.compare_family(
                    f"domino float32 shift {shift} chunk {chunk}",
                    make_domino(lambda: domino_draft(shift), shift, 7.0,
                                chunk=chunk),
                    dtype=torch.float32,
                    forward_kwargs={"lambda_base": 0.25})

    def test_lambda_outside_forward_defaults(self):
        # SpecForge's forward default (lambda_base 0).
        self.compare_family("domino default lambda",
                            make_domino(lambda: domino_draft(True), True))


def chunk_batch(dtype, shift=False):
    """One chunk's inputs, direct to the chunk functions."""
    generator = torch.Generator().manual_seed(11)
    hidden = torch.randn(B, 3, K, H, generator=generator, dtype=dtype)
    target_ids = torch.randint(0, V - 1, (B, 3, K), generator=generator)
    prev_ids = torch.randint(0, V - 1, (B, 3, K), generator=generator)
    teacher = torch.randn(B, 3, K, H, generator=generator, dtype=dtype)
    eval_mask = torch.ones(B, 3, K, dtype=torch.bool)
    eval_mask[1, 2, 2:] = False
    return hidden, prev_ids, target_ids, teacher, eval_mask


class NumeratorsTest(FamilyCase):
    """The chunk functions called directly and their numerators combined
    otherwise than SpecForge's forward does: backward recomputes (one head
    call for the positive weights, one for the negative), and the
    gradients are those of SpecForge's own chunk function."""

    def chunk_gradients(self, model, name, args, weights, parameters):
        terms = getattr(model, name)(*args)
        loss = sum(w * terms[i] for i, w in weights.items())
        wanted = [args[0]] + parameters
        grads = torch.autograd.grad(loss, wanted, allow_unused=True)
        # A numerator that does not read a parameter: SpecForge's gradient
        # is None, the recomputed one zeros.
        return terms, [torch.zeros_like(t) if g is None else g
                       for g, t in zip(grads, wanted)]

    def check(self, model, name, args, weights, heads, tolerance=1e-9,
              scope=contextlib.nullcontext):
        parameters = [p for p in model.parameters() if p.requires_grad]
        with scope():
            want = self.chunk_gradients(model, name, args, weights,
                                        parameters)
        dsf.apply()
        try:
            with Counting() as counter, scope():
                got = self.chunk_gradients(model, name, args, weights,
                                           parameters)
        finally:
            dsf.revert()
        self.assertEqual(counter.calls, heads, weights)
        self.assertIs(type(got[0]), tuple)
        self.assertEqual(len(got[0]), len(want[0]))
        for i, (a, b) in enumerate(zip(got[0], want[0])):
            self.assertEqual((a.dtype, a.device, a.shape),
                             (b.dtype, b.device, b.shape), i)
        self.assertSame(
            {i: t.detach() for i, t in enumerate(got[0])},
            {i: t.detach() for i, t in enumerate(want[0])}, tolerance)
        self.assertSame(dict(enumerate(got[1])), dict(enumerate(want[1])),
                        tolerance, str(weights))

    def test_dspark_numerators_with_other_weights(self):
        hidden, prev_ids, target_ids, teacher, eval_mask = chunk_batch(
            torch.float64)
        model = make_dspark(lambda: dspark_draft("rnn", confidence=False),
                            alphas=(0.2, 0.6, 0.0))().double()
        hidden.requires_grad_()
        weights = eval_mask.float()
        args = (hidden, prev_ids, target_ids, weights, eval_mask, teacher)
        # ce_num (0) and l1_num (1): proportional to the alphas (one call),
        # other weights (two calls, or one when all have one sign).
        for combination, heads in (({0: 0.2, 1: 0.6}, 1),
                                   ({0: 1.0, 1: 0.6}, 2),
                                   ({0: 0.7, 1: -1.3}, 3),
                                   ({0: -2.0}, 2)):
            self.check(model, "_dspark_objective_chunk_terms", args,
                       combination, heads, scope=float64_upcasts_direct)

    def test_dspark_confidence_numerator_with_other_weights(self):
        # Against SpecForge as shipped, whose L1 and confidence terms are
        # float32.
        hidden, prev_ids, target_ids, teacher, eval_mask = chunk_batch(
            torch.float64)
        model = make_dspark(lambda: dspark_draft("gated"))().double()
        hidden.requires_grad_()
        args = (hidden, prev_ids, target_ids, eval_mask.float(), eval_mask,
                teacher)
        for combination, heads in (({0: 0.1, 1: 0.9, 2: 1.0}, 1),
                                   ({0: 1.0, 2: -0.5}, 3), ({2: 2.0}, 2)):
            self.check(model, "_dspark_objective_chunk_terms", args,
                       combination, heads, tolerance=SPECFORGE_FLOAT32)

    def test_domino_numerators_with_other_weights(self):
        hidden, prev_ids, target_ids, _, eval_mask = chunk_batch(
            torch.float64)
        model = make_domino(lambda: domino_draft(False))().double()
        hidden.requires_grad_()
        mask = eval_mask.double()
        mask[..., 0] = 0
        args = (hidden, prev_ids, target_ids, mask, mask.clone())
        # Outside forward the head runs with lambda_base 0: (1, 0).
        for combination, heads in (({0: 3.0}, 1), ({0: 1.0, 1: 1.0}, 2),
                                   ({0: 2.0, 1: -0.5}, 3), ({1: 1.0}, 2)):
            self.check(model, "_domino_objective_chunk_terms", args,
                       combination, heads)


@contextlib.contextmanager
def float64_upcasts_direct():
    """float64_upcasts for a direct chunk-function call."""
    original = torch.Tensor.float

    def keeping_float64(self, *args, **kwargs):
        if self.dtype == torch.float64:
            return self
        return original(self, *args, **kwargs)

    torch.Tensor.float = keeping_float64
    try:
        yield
    finally:
        torch.Tensor.float = original


class FamilyFallbackTest(FamilyCase):
    """What the head cannot run goes to SpecForge's own objective, with
    one warning naming why, and gives SpecForge's result."""

    def run_fallback(self, make, forward_kwargs, words, width=H):
        shipped = family_step(make, torch.float64, forward_kwargs, width)
        dsf.apply()
        try:
            with warnings.catch_warnings(record=True) as caught, \
                    Counting() as counter:
                warnings.simplefilter("always")
                patched = family_step(make, torch.float64, forward_kwargs,
                                      width)
                family_step(make, torch.float64, forward_kwargs, width)
        finally:
            dsf.revert()
        self.assertEqual(counter.calls, 0)
        self.assertSame(patched, shipped, 0)
        self.assertEqual(len(caught), 1, [str(w.message) for w in caught])
        self.assertIs(caught[0].category, dsf.SpecForgeFallbackWarning)
        for word in words:
            self.assertIn(word, str(caught[0].message))

    def common(self):
        return dict(target_lm_head=family_head(),
                    target_embed_tokens=nn.Embedding(V, H),
                    mask_token_id=V - 1, block_size=K,
                    attention_backend="sdpa", num_anchors=8,
                    loss_decay_gamma=7.0, objective_chunk_blocks=2)

    def test_a_domino_draft_of_another_form(self):
        self.run_fallback(
            lambda: sf.OnlineDominoModel(TinyDominoDraft(), **self.common()),
            {"lambda_base": 0.3},
            ["TinyDominoDraft", "not SpecForge's Domino one"], width=HT)

    def test_a_dspark_draft_of_another_form(self):
        self.run_fallback(
            lambda: sf.OnlineDSparkModel(
                TinyDSparkDraft(), dspark_l1_loss_alpha=0.0,
                **self.common()), {},
            ["TinyDSparkDraft", "not SpecForge's DSpark or DFlash one"],
            width=HT)

    def test_a_markov_projection_with_a_bias(self):
        def make():
            draft = dspark_draft("vanilla", confidence=False)
            draft.markov_head.markov_w2 = nn.Linear(3, V)
            return sf.OnlineDSparkModel(draft, **self.common())
        self.run_fallback(make, {"target_last_hidden_states": True},
                          ["bias-free"])

    def test_a_head_that_is_not_a_linear(self):
        def make():
            common = self.common()
            common["target_lm_head"] = CappedHead(common["target_lm_head"])
            return sf.OnlineDominoModel(domino_draft(), **common)
        self.run_fallback(make, {"lambda_base": 0.5},
                          ["CappedHead", "not a torch.nn.Linear"])

    def test_domino_shift_label_differing_from_the_draft(self):
        self.run_fallback(
            lambda: sf.OnlineDominoModel(domino_draft(shift=True),
                                         **self.common()),
            {"lambda_base": 0.5}, ["shift_label"])


class WithoutSpecForgeTest(unittest.TestCase):
    def test_apply_says_what_to_install(self):
        if not NO_SPECFORGE:
            self.skipTest("SpecForge imports here")
        with self.assertRaisesRegex(ImportError,
                                    r"pip install --no-deps specforge"):
            dsf.apply()
        self.assertFalse(dsf.is_applied())
        dsf.revert()


if __name__ == "__main__":
    unittest.main(verbosity=2)
