"""A dflash CheckpointPolicy driving torch's selective activation
checkpointing: what each rule keeps, counted as matrix products run again in
backward. Needs torch >= 2.4 (create_selective_checkpoint_contexts); with an
older torch the policy tests skip, printing why, and asking for a policy is
checked to be a clear error."""

import unittest

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

import dflash
from dflash.torch import (checkpoint_options, chunked_reduce,
                          selective_checkpoint_context_fn)

HAS_SAC = hasattr(torch.utils.checkpoint, "create_selective_checkpoint_contexts")
NO_SAC = (f"torch {torch.__version__} has no "
          "torch.utils.checkpoint.create_selective_checkpoint_contexts "
          "(torch >= 2.4); run with DFLASH_TEST_PYTHON naming a newer torch")


class PolicyAsDataTest(unittest.TestCase):
    def test_presets_expand_into_rules(self):
        policy = dflash.objective_config(
            "checkpoint { preset: SELECTIVE_FROZEN_PROJECTION segment_chunks: 4 "
            "memory_budget_bytes: 1024 }").checkpoint_policy()
        self.assertEqual([r["action"] for r in policy["rules"]],
                         ["MUST_SAVE", "PREFER_SAVE", "MUST_RECOMPUTE"])
        self.assertEqual(policy["rules"][0]["kind"], "PROJECTION")
        self.assertIs(policy["rules"][0]["weight_frozen"], True)
        self.assertIs(policy["rules"][0]["input_requires_grad"], False)
        self.assertIsNone(policy["rules"][2]["kind"])
        self.assertEqual(policy["segment_chunks"], 4)
        self.assertEqual(policy["memory_budget_bytes"], 1024)

    def test_invalid_policies_are_errors(self):
        with self.assertRaisesRegex(ValueError, "checkpoint.memory_budget_bytes"):
            dflash.objective_config(
                "checkpoint { rules { action: PREFER_SAVE } "
                "memory_budget_bytes: 0 }").checkpoint_policy()

    def test_checkpoint_options(self):
        self.assertEqual(
            checkpoint_options("checkpoint { preset: FULL_RECOMPUTE segment_chunks: 3 }"),
            {"checkpoint": True, "segment_chunks": 3, "context_fn": None})
        self.assertEqual(
            checkpoint_options("checkpoint { preset: SAVE_ALL segment_chunks: 0 }"),
            {"checkpoint": False, "segment_chunks": 1, "context_fn": None})

    def test_asking_for_a_policy_without_the_api_is_an_error(self):
        if HAS_SAC:
            self.skipTest(f"torch {torch.__version__} has the API")
        with self.assertRaisesRegex(
                RuntimeError, r"needs torch.utils.checkpoint."
                r"create_selective_checkpoint_contexts \(torch >= 2.4\); "
                r"this torch is"):
            selective_checkpoint_context_fn(mode="selective")


class _CountMatmuls(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func.overloadpacket) in ("aten.mm", "aten.addmm"):
            self.count += 1
        return func(*args, **(kwargs or {}))


@unittest.skipUnless(HAS_SAC, NO_SAC)
class SelectiveCheckpointTest(unittest.TestCase):
    """Per chunk (2 rows, 4 chunks): a trainable draft layer on states that
    need a gradient, the frozen lm_head on its output, and the same lm_head
    on teacher states without gradient (DSpark's eligible frozen
    projection), then CE plus KL to the teacher. Backward runs 3 gradient
    products a chunk (lm_head's input gradient, the draft layer's weight and
    input gradients) and recomputes, unless kept, the 3 forward products."""

    CHUNKS = 4

    def run_with(self, options):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(8, 6, generator=g, dtype=torch.float64).requires_grad_()
        teacher_x = torch.randn(8, 5, generator=g, dtype=torch.float64)
        draft = torch.randn(5, 6, generator=g, dtype=torch.float64).requires_grad_()
        lm_head = torch.randn(11, 5, generator=g, dtype=torch.float64)
        targets = torch.randint(0, 11, (8,), generator=g)

        def terms(x, teacher_x, targets):
            logits = F.linear(torch.tanh(F.linear(x, draft)), lm_head)
            teacher = F.linear(teacher_x, lm_head)
            kl = F.kl_div(F.log_softmax(logits, -1), F.log_softmax(teacher, -1),
                          log_target=True, reduction="sum")
            return (F.cross_entropy(logits, targets, reduction="sum") + kl,)

        (loss,) = chunked_reduce(terms, x, teacher_x, targets, chunk_size=2,
                                 **options)
        with _CountMatmuls() as backward:
            loss.backward()
        return loss.detach(), draft.grad, x.grad, backward.count

    def assertRecomputed(self, options, per_chunk, reference):
        loss, draft_grad, x_grad, count = self.run_with(options)
        self.assertEqual(count, (3 + per_chunk) * self.CHUNKS)
        for actual, expected in zip((loss, draft_grad, x_grad), reference):
            torch.testing.assert_close(actual, expected, rtol=0, atol=0)

    def test_policies_keep_what_they_name(self):
        reference = self.run_with({"checkpoint": False})[:3]
        cases = {
            # Everything recomputed, as SpecForge does.
            "preset: FULL_RECOMPUTE": 3,
            # Both frozen projections kept: the draft layer alone recomputed.
            "preset: SELECTIVE_FROZEN_PROJECTION": 1,
            # Only the teacher's (frozen weight, input without gradient).
            "rules { kind: PROJECTION weight_frozen: true "
            "input_requires_grad: false action: MUST_SAVE } "
            "default_action: MUST_RECOMPUTE": 2,
            # Every product, by op name: nothing but cheap ops recomputed.
            'rules { name: "aten.mm" action: MUST_SAVE } '
            "rules { action: MUST_RECOMPUTE }": 0,
            'rules { name: "aten.*" action: MUST_SAVE }': 0,
        }
        for policy, recomputed in cases.items():
            with self.subTest(policy=policy):
                self.assertRecomputed(
                    checkpoint_options(f"checkpoint {{ {policy} }}"),
                    recomputed, reference)

    def test_prefer_save_within_the_budget(self):
        # A chunk's projection is 2 rows x 11 logits x 8 bytes = 176 bytes;
        # regions (segments) of 2 chunks with a budget for one keep one
        # frozen projection each, in offer order, and recompute the rest.
        reference = self.run_with({"checkpoint": False})[:3]
        options = checkpoint_options(
            "checkpoint { rules { kind: PROJECTION weight_frozen: true "
            "action: PREFER_SAVE } default_action: MUST_RECOMPUTE "
            "memory_budget_bytes: 200 segment_chunks: 2 }")
        self.assertEqual(options["segment_chunks"], 2)
        loss, draft_grad, x_grad, count = self.run_with(options)
        self.assertEqual(count, 6 * self.CHUNKS - self.CHUNKS // 2)
        torch.testing.assert_close(draft_grad, reference[1], rtol=0, atol=0)


if __name__ == "__main__":
    unittest.main(verbosity=2)
