"""dflash.torch.chunked_reduce: SpecForge's checkpointed_chunk_reduce cases,
its argument checks and messages, and segments of chunks as the recompute
boundary (counted chunk-function calls)."""

import unittest
from unittest import mock

import torch

from dflash.torch import chunked_reduce
from dflash.torch import chunking


class SpecForgeCasesTest(unittest.TestCase):
    """SpecForge's four tests of checkpointed_chunk_reduce, unchanged."""

    def test_sums_additive_terms_and_preserves_gradients(self):
        values = torch.arange(12, dtype=torch.double).reshape(2, 6)
        values.requires_grad_()
        weights = torch.linspace(0.5, 1.5, 12, dtype=torch.double).reshape(2, 6)

        def terms(value_chunk, weight_chunk, optional):
            self.assertIsNone(optional)
            return ((value_chunk * weight_chunk).sum(),
                    (value_chunk.square() * weight_chunk).sum())

        linear, quadratic = chunked_reduce(terms, values, weights, None,
                                           chunk_size=2, dim=1)
        torch.testing.assert_close(linear, (values * weights).sum())
        torch.testing.assert_close(quadratic, (values.square() * weights).sum())
        quadratic.backward()
        torch.testing.assert_close(values.grad, 2 * values.detach() * weights)

    def test_zero_chunk_size_runs_one_full_slice(self):
        calls = []
        values = torch.arange(5)

        def terms(chunk):
            calls.append(tuple(chunk.shape))
            return (chunk.sum(),)

        (total,) = chunked_reduce(terms, values, chunk_size=0)
        self.assertEqual(calls, [(5,)])
        self.assertEqual(total.item(), 10)

    def test_checkpoint_false_keeps_chunks_without_recompute(self):
        calls = []
        values = torch.arange(6, dtype=torch.double).requires_grad_()

        def terms(chunk):
            calls.append(tuple(chunk.shape))
            return (chunk.square().sum(),)

        with mock.patch("torch.utils.checkpoint.checkpoint") as checkpoint:
            (total,) = chunked_reduce(terms, values, chunk_size=4,
                                      checkpoint=False)
            total.backward()
        checkpoint.assert_not_called()
        self.assertEqual(calls, [(4,), (2,)])
        torch.testing.assert_close(values.grad, 2 * values.detach())

    def test_rejects_misaligned_inputs(self):
        with self.assertRaisesRegex(ValueError, "must be aligned"):
            chunked_reduce(lambda left, right: (left.sum() + right.sum(),),
                           torch.zeros(2, 3), torch.zeros(2, 4),
                           chunk_size=1, dim=1)


class ArgumentChecksTest(unittest.TestCase):
    """SpecForge's messages, in its order: the first failing check wins."""

    def check(self, error, message, *tensors, **kwargs):
        kwargs.setdefault("chunk_size", 1)
        with self.assertRaises(error) as raised:
            chunked_reduce(lambda *t: (torch.zeros(()),), *tensors, **kwargs)
        self.assertEqual(str(raised.exception), message)

    def test_messages_in_order(self):
        x = torch.zeros(2, 3)
        self.check(ValueError, "chunk_size must be >= 0, got -1", None,
                   chunk_size=-1)
        self.check(ValueError, "segment_chunks must be >= 1, got 0", x,
                   segment_chunks=0)
        self.check(ValueError, "chunked reduction requires at least one tensor",
                   None, None)
        self.check(ValueError, "dim 2 is invalid for a 2D tensor", x, dim=2)
        self.check(ValueError, "dim -3 is invalid for a 2D tensor", x, dim=-3)
        self.check(ValueError, "chunked reduction received an empty dimension",
                   torch.zeros(0, 3), torch.zeros(5))
        self.check(ValueError, "dim 1 is invalid for a 1D tensor", x,
                   torch.zeros(2), dim=1)
        self.check(ValueError,
                   "chunked reduction inputs must be aligned: expected "
                   "dimension length 3, got 4", x, torch.zeros(4), dim=-1)

    def test_chunk_function_results(self):
        x = torch.arange(4.0)
        with self.assertRaisesRegex(TypeError,
                                    "chunk function must return a tuple of tensors"):
            chunked_reduce(lambda c: [c.sum()], x, chunk_size=2)
        sizes = iter([1, 2])
        with self.assertRaisesRegex(
                ValueError, "chunk function returned a different number of terms"):
            chunked_reduce(lambda c: (c.sum(),) * next(sizes), x, chunk_size=2)

    def test_ranks_may_differ_and_none_passes_through(self):
        a = torch.arange(12.0).reshape(3, 4)
        b = torch.arange(4.0)
        seen = []
        (total,) = chunked_reduce(
            lambda x, n, y: (seen.append(n) or (x.sum(0) * y).sum(),),
            a, None, b, chunk_size=3, dim=-1)
        self.assertEqual(seen, [None, None])
        torch.testing.assert_close(total, (a.sum(0) * b).sum())


class SegmentsTest(unittest.TestCase):
    """A segment of chunks is recomputed as one: every chunk runs once in
    forward and once more in backward whatever the segment, but backward
    reruns whole segments from the last, chunks in order within each."""

    def run_with(self, segment_chunks):
        calls = []
        values = torch.linspace(-1, 1, 8, dtype=torch.double).requires_grad_()

        def terms(chunk):
            calls.append(int(round((chunk[0].item() + 1) * 3.5)))
            return ((chunk.sin() * chunk).sum(), chunk.detach().sum())

        total, plain = chunked_reduce(terms, values, chunk_size=2,
                                      segment_chunks=segment_chunks)
        forward = list(calls)
        total.backward()
        return total, plain, values.grad, forward, calls[len(forward):]

    def test_segments_give_the_same_result_with_whole_segments_recomputed(self):
        base = self.run_with(1)
        expected_backward = {1: [6, 4, 2, 0], 2: [4, 6, 0, 2], 4: [0, 2, 4, 6],
                             100: [0, 2, 4, 6]}
        for segment, order in expected_backward.items():
            with self.subTest(segment_chunks=segment):
                total, plain, grad, forward, backward = self.run_with(segment)
                self.assertEqual(forward, [0, 2, 4, 6])
                self.assertEqual(backward, order)
                torch.testing.assert_close(total, base[0], rtol=0, atol=0)
                torch.testing.assert_close(plain, base[1], rtol=0, atol=0)
                torch.testing.assert_close(grad, base[2], rtol=0, atol=0)
        values = torch.linspace(-1, 1, 8, dtype=torch.double)
        torch.testing.assert_close(base[2], values.sin() + values * values.cos())

    def test_no_checkpoint_without_gradients(self):
        calls = []
        values = torch.arange(6.0, requires_grad=True)
        with torch.no_grad(), mock.patch("torch.utils.checkpoint.checkpoint") as cp:
            chunked_reduce(lambda c: (calls.append(1) or c.sum(),), values,
                           chunk_size=2, segment_chunks=3)
        cp.assert_not_called()
        self.assertEqual(len(calls), 3)

    def test_context_fn_needs_a_torch_that_takes_it(self):
        if chunking._HAS_CONTEXT_FN:
            self.skipTest(f"torch {torch.__version__} takes context_fn")
        with self.assertRaisesRegex(RuntimeError, r"context_fn needs .*torch >= 2.1"):
            chunked_reduce(lambda c: (c.sum(),), torch.zeros(2), chunk_size=1,
                           context_fn=lambda: None)


if __name__ == "__main__":
    unittest.main(verbosity=2)
