"""dflash.specforge.apply() against SpecForge main's own models.

SpecForge main (commit dflash.specforge.MAIN_COMMIT) is not on PyPI, so
this test runs only where DFLASH_SPECFORGE_MAIN names a folder holding
main's `specforge` package (tools/specforge_main_overlay.sh builds one from
an installed specforge 0.2.0 and main's files); that folder goes first on
sys.path. Elsewhere it skips, saying why: CI proves main's terms by the
goldens in tests/goldens/specforge_main instead.

Main's OnlineDFlashModel, OnlineDSparkModel and OnlineDominoModel run
forward and backward on small CPU batches with small stand-in drafts, once
as shipped and once after apply(): the loss, accuracy, every metric and
every gradient agree (float64 1e-9 relative, float32 2e-5), for every
loss type and LK type main has (D-PACE with its sequence-balanced
denominator), with one head call per DFlash step; main's DSpark (with
confidence logits) and Domino (with and without the shift) fall back to
SpecForge's own objective with one warning naming why. revert() restores
main's functions.
"""

import importlib
import os
import sys
import unittest
import warnings

import torch
import torch.nn as nn

import dflash.specforge as dsf

MODULE = "specforge.algorithms.common.dflash_family_model"
FOLDER = os.environ.get("DFLASH_SPECFORGE_MAIN")
sf = None
if not FOLDER:
    NO_MAIN = (
        "DFLASH_SPECFORGE_MAIN is not set: SpecForge main is not on PyPI "
        "(tools/specforge_main_overlay.sh builds a package folder to name "
        "there); CI proves main's terms by tests/goldens/specforge_main")
else:
    sys.path.insert(0, FOLDER)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # flash_attn is not installed.
            sf = importlib.import_module(MODULE)
        NO_MAIN = None
        if not hasattr(sf, "DFlashObjectiveTerms"):
            NO_MAIN = (f"{sf.__file__} is not SpecForge main's (no "
                       "DFlashObjectiveTerms); DFLASH_SPECFORGE_MAIN="
                       f"{FOLDER}")
    except Exception as error:  # noqa: BLE001 - any import failure skips.
        NO_MAIN = (f"SpecForge main's {MODULE} does not import from "
                   f"DFLASH_SPECFORGE_MAIN={FOLDER} ({type(error).__name__}: "
                   f"{error})")

B, S, K, H, HT, V = 2, 22, 4, 16, 12, 23
TOLERANCE = {torch.float64: 1e-9, torch.float32: 2e-5}
LOSS_TYPES = ("dflash", "dpace", "dpace-cumulative-confidence-only",
              "dpace-continuation-value-only")
LK_TYPES = (None, "alpha", "lambda", "tv")


class TinyDraft(nn.Module):
    """Stands in for main's DFlashDraftModel: the draft's output states
    from the noise embedding, the context states and the draft positions."""

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
    """Main's Domino draft interface: correction logits for the corrected
    suffix from the head tokens' embeddings."""

    suffix_start = 1

    def __init__(self):
        super().__init__()
        self.correction = nn.Linear(H, V, bias=False)

    def compute_correction_logits(self, hidden_states,
                                  prev_token_embeddings):
        return self.correction(
            prev_token_embeddings[:, :, self.suffix_start:]
            + hidden_states[:, :, self.suffix_start:])


class TinyDSparkDraft(TinyDraft):
    """DSpark's draft: a Markov bias from the previous token and a
    confidence head."""

    def __init__(self):
        super().__init__()
        self.markov = nn.Embedding(V, V)
        self.confidence_head = nn.Linear(H, 1)

    def apply_logits_head(self, base_logits, prev_token_ids, hidden_states):
        return base_logits + self.markov(prev_token_ids)

    def predict_confidence(self, hidden, prev_token_ids):
        return self.confidence_head(hidden).squeeze(-1)


def batch(dtype):
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, V - 1, (B, S), generator=generator)
    hidden_states = torch.randn(B, S, HT, generator=generator, dtype=dtype)
    loss_mask = torch.ones(B, S, dtype=dtype)
    loss_mask[0, :3] = 0          # prompts
    loss_mask[1, :10] = 0         # fewer anchors: the sequences' balance
    loss_mask[1, -5:] = 0         # padding
    loss_mask[0, 12] = 0.75       # a fractional weight
    return input_ids, hidden_states, loss_mask


def head(bias=False, trainable=False):
    linear = nn.Linear(H, V, bias=bias)
    with torch.no_grad():
        linear.weight.mul_(6)
    return linear.requires_grad_(trainable)


def make_dflash(loss_type="dflash", lk=None, gamma=None, chunk=2, alpha=0.5,
                bias=False, trainable=False):
    def make():
        torch.manual_seed(0)
        lm_head = head(bias, trainable)
        return sf.OnlineDFlashModel(
            TinyDraft(), lm_head, nn.Embedding(V, H),
            mask_token_id=V - 1, block_size=K, attention_backend="sdpa",
            num_anchors=8, loss_decay_gamma=gamma,
            objective_chunk_blocks=chunk, loss_type=loss_type,
            dpace_alpha=alpha, lk_loss_type=lk, kl_scale=0.8, kl_decay=2.0)
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


def step(make, dtype, forward_kwargs=None, grad=True):
    """Main's forward and backward: every output, metric and gradient."""
    input_ids, hidden_states, loss_mask = batch(dtype)
    model = make().to(dtype)
    states = hidden_states.clone().requires_grad_(grad)
    kwargs = dict(forward_kwargs or {})
    if kwargs.get("target_last_hidden_states") is True:
        generator = torch.Generator().manual_seed(3)
        kwargs["target_last_hidden_states"] = 2 * torch.randn(
            B, S, H, generator=generator, dtype=dtype)
    torch.manual_seed(7)  # SpecForge's anchors are random.
    with torch.set_grad_enabled(grad):
        loss, accuracy, metrics = model(input_ids, states, loss_mask,
                                        **kwargs)
    out = {"loss": loss, "accuracy": accuracy}
    flatten("metrics", metrics, out)
    if grad:
        loss.backward()
        out["grad hidden_states"] = states.grad
        for name, p in model.named_parameters():
            if p.grad is not None:
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
        if NO_MAIN:
            self.skipTest(NO_MAIN)
        dsf.revert()
        self.addCleanup(dsf.revert)

    def assertSame(self, got, want, tolerance, what):
        self.assertEqual(sorted(got), sorted(want), what)
        for name, reference in want.items():
            value = got[name]
            where = f"{what} {name}"
            self.assertIs(type(value), type(reference), where)
            if not isinstance(reference, torch.Tensor):
                self.assertEqual(value, reference, where)
                continue
            self.assertEqual(value.dtype, reference.dtype, where)
            self.assertEqual(value.device, reference.device, where)
            self.assertEqual(value.shape, reference.shape, where)
            self.assertEqual(value.requires_grad, reference.requires_grad,
                             where)
            finite = reference.detach()[reference.detach().isfinite()]
            scale = finite.abs().max().item() if finite.numel() else 0.0
            torch.testing.assert_close(
                value.detach(), reference.detach(), rtol=tolerance,
                atol=tolerance * scale, equal_nan=True,
                msg=lambda m: f"{where}: {m}")

    def compare(self, what, make, dtype=torch.float64, forward_kwargs=None,
                heads=1, fallbacks=(), grad=True):
        """Main's model as shipped and after apply(): the same outputs and
        gradients, `heads` head calls (None: at least one), and the
        fallback warnings whose words are `fallbacks`, one each."""
        shipped = step(make, dtype, forward_kwargs, grad)
        dsf.apply()
        try:
            with warnings.catch_warnings(record=True) as caught, \
                    Counting() as counter:
                warnings.simplefilter("always")
                patched = step(make, dtype, forward_kwargs, grad)
        finally:
            dsf.revert()
        messages = [str(w.message) for w in caught
                    if issubclass(w.category, dsf.SpecForgeFallbackWarning)]
        self.assertEqual(len(messages), len(fallbacks), (what, messages))
        for message, words in zip(messages, fallbacks):
            self.assertIn(words, message, what)
        if heads is None:
            self.assertGreater(counter.calls, 0, what)
        else:
            self.assertEqual(counter.calls, heads, what)
        self.assertSame(patched, shipped, TOLERANCE[dtype], what)
        if not fallbacks:  # Some argmax hits, so that correct_num counts.
            self.assertGreater(shipped["metrics.ratio_metrics.acc.0"], 0,
                               what)
        return shipped


class DFlashTest(Case):
    def test_every_loss_and_lk_type(self):
        # LK lambda's CE weight is the batch's, known after the head's
        # call: backward runs the head again for its gradients.
        for dtype in (torch.float64, torch.float32):
            for loss_type in LOSS_TYPES:
                for lk in LK_TYPES:
                    self.compare(
                        f"{loss_type} lk {lk} {dtype}",
                        make_dflash(loss_type, lk), dtype,
                        heads=None if lk == "lambda" else 1)

    def test_decay_chunks_and_teacher_metrics(self):
        for lk in (None, "tv"):
            for chunk in (0, 1, 2, 8):
                self.compare(f"dflash gamma 3 chunk {chunk} lk {lk}",
                             make_dflash(gamma=3.0, chunk=chunk, lk=lk),
                             forward_kwargs={
                                 "target_last_hidden_states": True})

    def test_dpace_alphas_and_a_trainable_head_with_bias(self):
        for loss_type in LOSS_TYPES[1:]:
            for alpha in (0.0, 1.0, 0.3):
                self.compare(f"{loss_type} alpha {alpha}",
                             make_dflash(loss_type, alpha=alpha))
            self.compare(f"{loss_type} trainable head with bias",
                         make_dflash(loss_type, "tv", bias=True,
                                     trainable=True))

    def test_without_gradients_or_detailed_metrics(self):
        self.compare("dpace no grad", make_dflash("dpace", "lambda"),
                     grad=False)
        self.compare("dpace no detailed metrics",
                     make_dflash("dpace", "lambda"), heads=None,
                     forward_kwargs={"collect_detailed_metrics": False})

    def test_a_chunk_of_longer_sequences_falls_back(self):
        # The whole batch's sequence_anchor_scale beside half its blocks:
        # the head would balance the half, so SpecForge's function runs.
        model = make_dflash("dpace")()
        generator = torch.Generator().manual_seed(5)
        hidden = torch.randn(B, 4, K, H, generator=generator,
                             dtype=torch.float64)
        targets = torch.randint(0, V, (B, 4, K), generator=generator)
        mask = torch.ones(B, 4, K, dtype=torch.float64)
        mask[1, 3] = 0
        mask[..., 0] = 0
        model = model.to(torch.float64)
        scale = model._sequence_anchor_scale(mask)
        args = (hidden[:, :2], targets[:, :2], mask[:, :2], targets[:, :2],
                scale[:, :2])
        want = model._dflash_objective_chunk_terms(*args)
        dsf.apply()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = model._dflash_objective_chunk_terms(*args)
            whole = model._dflash_objective_chunk_terms(
                hidden, targets, mask, targets, scale)
        dsf.revert()
        self.assertEqual(len(caught), 1)
        self.assertIn("sequence_anchor_scale", str(caught[0].message))
        self.assertIs(type(got), sf.DFlashObjectiveTerms)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
        # The whole sequences run on the head: SpecForge's values.
        reference = model._dflash_objective_chunk_terms(
            hidden, targets, mask, targets, scale)
        self.assertIs(type(whole), sf.DFlashObjectiveTerms)
        for g, w in zip(whole, reference):
            self.assertEqual(g.dtype, w.dtype)
            torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-12)


class TinySelector(nn.Module):
    """A DFlash2 candidate selector: scores the unary top-k."""

    top_k = 3

    def __init__(self):
        super().__init__()
        self.score = nn.Linear(H, 1)

    def score_candidates(self, candidate_ids, unary_logits, hidden_states,
                         predecessor_ids):
        return unary_logits + self.score(hidden_states)


class TinySelectorDraft(TinyDraft):
    def __init__(self):
        super().__init__()
        self.candidate_selector = TinySelector()

    def transform_unary_logits(self, logits):
        return logits


class DFlashFallbackTest(Case):
    def test_a_selector_draft(self):
        def make():
            torch.manual_seed(0)
            lm_head = head()
            return sf.OnlineDFlashModel(
                TinySelectorDraft(), lm_head, nn.Embedding(V, H),
                mask_token_id=V - 1, block_size=K, attention_backend="sdpa",
                num_anchors=8, objective_chunk_blocks=2, loss_type="dpace")
        self.compare("selector", make, heads=0,
                     forward_kwargs={"collect_detailed_metrics": False},
                     fallbacks=("candidate_selector",))

    def test_lk_lambda_with_a_trainable_head(self):
        self.compare("lambda trainable", make_dflash("dflash", "lambda",
                                                     trainable=True),
                     heads=1, fallbacks=("head.trainable",))

    def test_fused_head(self):
        # Main's Triton head stays SpecForge's: the call goes there (which
        # needs specforge.core.dflash_head_triton, triton and CUDA tensors,
        # and raises on these CPU ones).
        model = make_dflash()().to(torch.float64)
        hidden = torch.randn(B, 2, K, H, dtype=torch.float64)
        targets = torch.zeros(B, 2, K, dtype=torch.int64)
        mask = torch.ones(B, 2, K, dtype=torch.float64)
        dsf.apply()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with self.assertRaises(Exception):
                model._dflash_objective_chunk_terms(
                    hidden, targets, mask, targets, fused_head=True)
        self.assertEqual(len(caught), 1)
        self.assertIn("fused_head=True", str(caught[0].message))


class FamilyTest(Case):
    def test_dspark_with_confidence_logits_falls_back(self):
        def make():
            torch.manual_seed(0)
            return sf.OnlineDSparkModel(
                TinyDSparkDraft(), head(), nn.Embedding(V, H),
                mask_token_id=V - 1, block_size=K, attention_backend="sdpa",
                num_anchors=8, objective_chunk_blocks=2)
        self.compare("dspark", make, heads=0,
                     forward_kwargs={"target_last_hidden_states": True},
                     fallbacks=("SpecForge main's DSpark objective",))

    def test_domino_with_and_without_the_shift_falls_back(self):
        for shift in (False, True):
            def make(shift=shift):
                torch.manual_seed(0)
                return sf.OnlineDominoModel(
                    TinyDominoDraft(), head(), nn.Embedding(V, H),
                    mask_token_id=V - 1, block_size=K,
                    attention_backend="sdpa", num_anchors=8,
                    objective_chunk_blocks=2, shift_label=shift)
            self.compare(f"domino shift {shift}", make, heads=0,
                         forward_kwargs={"lambda_base": 0.3},
                         fallbacks=("SpecForge main's Domino objective",))


class PatchTest(Case):
    def originals(self):
        return (sf.OnlineDFlashModel.__dict__["_dflash_objective_chunk_terms"],
                sf.OnlineDSparkModel.__dict__["_dspark_objective_chunk_terms"],
                sf.OnlineDominoModel.__dict__["_domino_objective_chunk_terms"],
                sf.OnlineDominoModel.__dict__["forward"],
                sf.checkpointed_chunk_reduce)

    def test_apply_knows_main_and_revert_restores_it(self):
        before = self.originals()
        dsf.apply()
        during = self.originals()
        for i, function in enumerate(before):
            self.assertIsNot(during[i], function, i)
        self.assertEqual(dsf._patch.version, f"main-{dsf.MAIN_COMMIT}")
        dsf.revert()
        self.assertEqual(self.originals(), before)
        self.assertIs(importlib.import_module(
            "specforge.core.chunking").checkpointed_chunk_reduce, before[-1])

    def test_reduction_of_other_functions_is_main_s(self):
        dsf.apply()
        x = torch.arange(6.0, requires_grad=True).view(1, 6)
        for checkpoint in (True, False):
            got = sf.checkpointed_chunk_reduce(
                lambda t: (t.sum(), t.max()), x, chunk_size=4, dim=1,
                checkpoint=checkpoint)
            self.assertEqual([t.item() for t in got], [15.0, 8.0])

    def test_another_main_is_refused(self):
        terms = sf.OnlineDFlashModel.__dict__["_sequence_anchor_scale"]
        sf.OnlineDFlashModel._sequence_anchor_scale = staticmethod(
            lambda weight_mask: terms.__func__(weight_mask))
        try:
            with self.assertRaisesRegex(
                    dsf.SpecForgeVersionError,
                    r"OnlineDFlashModel\._sequence_anchor_scale \(in .*\) "
                    r"differ from the nearest known version's "
                    r"\(main-c1625dc7;"):
                dsf.apply()
            self.assertFalse(dsf.is_applied())
        finally:
            sf.OnlineDFlashModel._sequence_anchor_scale = terms


if __name__ == "__main__":
    unittest.main()
