"""Bad inputs to dflash_objective: each raises a Python exception whose
message names the argument, the value and what was expected; none crashes
the interpreter."""

import os
import tempfile
import unittest

import numpy as np
import torch

import dflash
import reference
from dflash.torch import FusedHead, chunked_reduce, dflash_objective


class BadInputsTest(unittest.TestCase):
    def setUp(self):
        data = reference.batch(seed=20, dtype=torch.float32)
        self.hidden = data["hidden"]
        self.weight = data["weight"]
        self.target_ids = data["target_ids"]
        self.weight_mask = data["weight_mask"]

    def call(self, **changes):
        args = {"hidden": self.hidden, "lm_head_weight": self.weight,
                "target_ids": self.target_ids, "weight_mask": self.weight_mask}
        args.update(changes)
        return dflash_objective(**args)

    def assertRaisesMessage(self, error, message, **changes):
        with self.assertRaises(error) as raised:
            self.call(**changes)
        self.assertEqual(str(raised.exception), message)

    def test_wrong_dtype(self):
        self.assertRaisesMessage(
            ValueError, "hidden: must be float32 or float64 (on the CPU), got float16",
            hidden=self.hidden.half())
        self.assertRaisesMessage(
            ValueError, "lm_head_weight: must be float32 (hidden's dtype), got float64",
            lm_head_weight=self.weight.double())
        self.assertRaisesMessage(
            ValueError, "target_ids: must be int64 or int32, got float32",
            target_ids=self.target_ids.float())
        self.assertRaisesMessage(
            ValueError,
            "weight_mask: must be float32 or float64 or bool, got int64",
            weight_mask=self.weight_mask.long())

    def test_bad_correction(self):
        b, n, k, _ = self.hidden.shape
        v = self.weight.shape[0]
        z = torch.zeros(b, n, k, 3)
        m = torch.zeros(v, 3)
        self.assertRaisesMessage(
            ValueError,
            "correction_weight: required beside correction_inputs (the "
            "correction is z @ M^T), got None",
            correction_inputs=z)
        self.assertRaisesMessage(
            ValueError,
            "correction_inputs: required beside correction_weight (the "
            "correction is z @ M^T), got None",
            correction_weight=m)
        self.assertRaisesMessage(
            ValueError,
            f"correction_weight: must have shape [V, r] (V of lm_head_weight, "
            f"r of correction_inputs) = ({v}, 3), got ({v}, 2)",
            correction_inputs=z, correction_weight=torch.zeros(v, 2))
        self.assertRaisesMessage(
            ValueError,
            "correction_inputs: must be float32 (hidden's dtype), got float64",
            correction_inputs=z.double(), correction_weight=m)
        self.assertRaisesMessage(
            ValueError,
            "correction_inputs: must have shape [B, N, K, r] with r > 0, got "
            f"({b}, {n}, {k}, 0)",
            correction_inputs=torch.zeros(b, n, k, 0),
            correction_weight=torch.zeros(v, 0))
        bad = z.clone()
        bad[0, 0, 1, 2] = float("inf")
        with self.assertRaises(ValueError) as raised:
            self.call(correction_inputs=bad, correction_weight=m)
        self.assertIn("correction_inputs[0, 0, 1, 2]: must be finite, got inf",
                      str(raised.exception))

    def test_tensors_without_strided_data(self):
        self.assertRaisesMessage(
            TypeError,
            "hidden: must hold data, got a meta tensor (shape and dtype only)",
            hidden=self.hidden.to("meta"))
        self.assertRaisesMessage(
            TypeError,
            "lm_head_weight: must hold data, got a meta tensor (shape and "
            "dtype only)",
            lm_head_weight=self.weight.to("meta"))
        self.assertRaisesMessage(
            TypeError,
            "lm_head_weight: must be a dense (strided) tensor, got "
            "torch.sparse_coo (call .to_dense())",
            lm_head_weight=self.weight.to_sparse())
        self.assertRaisesMessage(
            TypeError,
            "weight_mask: must be a dense (strided) tensor, got "
            "torch.sparse_coo (call .to_dense())",
            weight_mask=self.weight_mask.to_sparse())
        if torch.backends.mkldnn.is_available():
            self.assertRaisesMessage(
                TypeError,
                "hidden: must be a dense (strided) tensor, got torch._mkldnn "
                "(call .to_dense())",
                hidden=self.hidden.to_mkldnn())
        with self.assertRaisesRegex(
                TypeError, "^lm_head_bias: must be a dense \\(strided\\)"):
            self.call(lm_head_bias=torch.zeros(13).to_sparse())
        with self.assertRaisesRegex(
                TypeError, "^lm_head_weight: must hold data, got a meta"):
            dflash.PreparedProjection(self.weight.to("meta"))

    def test_lazily_negated_views(self):
        # torch's neg bit: the memory holds the values un-negated.
        negated = torch._neg_view(self.hidden)
        self.assertTrue(negated.is_neg())
        self.assertRaisesMessage(
            TypeError,
            "hidden: must not be a lazily negated view (call .resolve_neg(), "
            "one copy)",
            hidden=negated)
        self.assertEqual(self.call(hidden=negated.resolve_neg()).loss_num,
                         self.call(hidden=-self.hidden).loss_num)

    def test_prepared_projection_of_the_wrong_kind(self):
        self.assertRaisesMessage(
            TypeError,
            "prepared_projection: must be a dflash.PreparedProjection or "
            "None, got str",
            prepared_projection="x")
        prepared = dflash.PreparedProjection(self.weight)
        self.assertRaisesMessage(
            ValueError,
            "prepared_projection: serves a frozen float32 CPU lm_head_weight, "
            "got one that requires grad",
            lm_head_weight=self.weight.clone().requires_grad_(),
            prepared_projection=prepared)

    def test_wrong_shape(self):
        self.assertRaisesMessage(
            ValueError,
            "hidden: must have 4 dimensions [B, N, K, H], got shape (6, 4, 8)",
            hidden=self.hidden.reshape(6, 4, 8))
        self.assertRaisesMessage(
            ValueError,
            "lm_head_weight: must have shape [V, H] with V > 0 and H = 8 "
            "(hidden's last dimension), got (13, 7)",
            lm_head_weight=self.weight[:, :7].contiguous())
        self.assertRaisesMessage(
            ValueError,
            "weight_mask: must have shape [B, N, K] (hidden's) = (2, 3, 4), got (2, 3, 5)",
            weight_mask=torch.ones(2, 3, 5))
        self.assertRaisesMessage(
            ValueError,
            "hidden: every dimension of [B, N, K, H] must be > 0, got shape (0, 3, 4, 8)",
            hidden=self.hidden[:0])
        self.assertRaisesMessage(
            ValueError,
            "lm_head_bias: must have shape [V] = (13,), got (12,)",
            lm_head_bias=torch.zeros(12))

    def test_non_contiguous(self):
        transposed = self.weight.T.contiguous().T
        self.assertRaisesMessage(
            ValueError,
            "lm_head_weight: must be contiguous (dflash reads it in place; call "
            ".contiguous(), one copy), got strides (1, 13) for shape (13, 8)",
            lm_head_weight=transposed)
        # Row metadata may be strided: it is read on the host, element by element.
        mask = self.weight_mask.transpose(0, 1).contiguous().transpose(0, 1)
        self.assertEqual(self.call(weight_mask=mask).loss_den,
                         self.call().loss_den)

    def test_non_finite(self):
        hidden = self.hidden.clone()
        hidden[1, 0, 2, 5] = float("nan")
        with self.assertRaises(ValueError) as raised:
            self.call(hidden=hidden)
        self.assertTrue(str(raised.exception).startswith(
            "hidden[1, 0, 2, 5]: must be finite, got nan (the head reported: "),
            str(raised.exception))
        weight = self.weight.clone()
        weight[4, 1] = float("inf")
        with self.assertRaisesRegex(
                ValueError, r"^lm_head_weight\[4, 1\]: must be finite, got inf"):
            self.call(lm_head_weight=weight)
        mask = self.weight_mask.clone()
        mask[0, 1, 3] = float("nan")
        self.assertRaisesMessage(
            ValueError, "weight_mask[0, 1, 3]: must be finite and >= 0, got nan",
            weight_mask=mask)
        mask[0, 1, 3] = -1
        self.assertRaisesMessage(
            ValueError, "weight_mask[0, 1, 3]: must be finite and >= 0, got -1",
            weight_mask=mask)

    def test_non_finite_in_an_unweighted_row_is_never_read(self):
        hidden = self.hidden.clone()
        hidden[0, 0, 0] = float("nan")  # k = 0: never weighted.
        self.assertTrue(torch.isfinite(self.call(hidden=hidden).loss_num))

    def test_targets_out_of_range(self):
        self.weight_mask[0, 2, 1] = 1
        targets = self.target_ids.clone()
        targets[0, 2, 1] = 13
        self.assertRaisesMessage(
            ValueError,
            "target_ids[0, 2, 1]: must lie in [0, V = 13) or be ignore_index "
            "(-100) where weight_mask > 0, got 13",
            target_ids=targets)
        targets[0, 2, 1] = -5
        with self.assertRaisesRegex(ValueError, r"target_ids\[0, 2, 1\].*got -5"):
            self.call(target_ids=targets)
        targets[0, 2, 1] = 2**40
        with self.assertRaisesRegex(ValueError, r"got 1099511627776"):
            self.call(target_ids=targets)
        # Out of range where nothing is weighted, or ignore_index: no error.
        targets[0, 2, 1] = -100
        targets[0, 0, 0] = 10**6
        self.call(target_ids=targets)

    def test_wrong_types_and_options(self):
        with self.assertRaisesRegex(TypeError, "hidden: must be a torch.Tensor, got list"):
            self.call(hidden=[1.0])
        with self.assertRaisesRegex(ValueError, r"top_k: must be an int in \[0, min\(64, V = 13\)\], got 20"):
            self.call(top_k=20)
        with self.assertRaisesRegex(TypeError, "unexpected keyword override 'gama'"):
            self.call(gama=7)
        with self.assertRaisesRegex(ValueError, "loss_type: must be one of dflash"):
            self.call(loss_type="ce")
        with self.assertRaisesRegex(ValueError, r"loss.dpace.alpha.*got 2"):
            self.call(config="loss { dpace { alpha: 2 } }")
        with self.assertRaisesRegex(
                ValueError, r'^config:1:\d+: .*has no field named "dflsh"'):
            self.call(config="loss { dflsh { } }")
        with self.assertRaisesRegex(
                FileNotFoundError, "cannot open: No such file or directory"):
            import pathlib
            self.call(config=pathlib.Path("/nonexistent/objective.textproto"))

    def test_an_empty_config_string(self):
        for text in ("", "  \n"):
            self.assertRaisesMessage(
                ValueError,
                "config: an empty str; pass None for the default config, text "
                "format or a path",
                config=text)

    def test_config_strings_that_name_paths(self):
        # A str that looks like a path is read as one: missing, a directory
        # or a FIFO is said so, not parsed as text format.
        with self.assertRaisesRegex(
                FileNotFoundError,
                "^config: objective.textproto: cannot open: No such file"):
            self.call(config="objective.textproto")
        with self.assertRaisesRegex(
                FileNotFoundError,
                "^config: configs/missing: cannot open: No such file"):
            self.call(config="configs/missing")
        with tempfile.TemporaryDirectory() as tmp:
            with self.assertRaisesRegex(
                    ValueError, f"^config: {tmp}/: is a directory"):
                self.call(config=tmp + "/")
            fifo = os.path.join(tmp, "objective.txtpb")
            os.mkfifo(fifo)
            with self.assertRaisesRegex(
                    ValueError,
                    f"^config: {fifo}: is a FIFO \\(named pipe\\)"):
                self.call(config=fifo)
            # A file with a byte-order mark and non-ASCII comments parses.
            path = os.path.join(tmp, "bom.textproto")
            with open(path, "w", encoding="utf-8") as f:
                f.write("\ufeff# objectif: décroissance\n"
                        "loss { dflash { gamma: 3 } }\n")
            self.assertEqual(self.call(config=path).loss_num,
                             self.call(gamma=3.0).loss_num)
        self.assertEqual(
            self.call(config="\ufeffloss { dflash { gamma: 3 } }").loss_num,
            self.call(gamma=3.0).loss_num)
        # Non-ASCII outside a comment: line:column and a message.
        for text, where in (("loss { dflash { } } é", "config:1:21: "),
                            ("loss {\n dflésh { } }", "config:2:5: ")):
            with self.assertRaises(ValueError) as raised:
                self.call(config=text)
            self.assertTrue(str(raised.exception).startswith(where),
                            str(raised.exception))
            self.assertIn("non ascii", str(raised.exception))

    def test_loss_inputs_must_match_the_family(self):
        self.assertRaisesMessage(
            ValueError,
            "teacher_hidden: loss.dspark reads the teacher's hidden states "
            "[B, N, K, H], got None",
            loss_type="dspark")
        self.assertRaisesMessage(
            ValueError,
            "confidence_logits: loss.dflash has no confidence term, got a tensor (pass None)",
            confidence_logits=torch.zeros(2, 3, 4))
        self.assertRaisesMessage(
            ValueError,
            "confidence_logits: must be float32 (the loss reads confidence "
            "logits in float64 beside float64 hidden, else in float32; "
            "hidden is float32), got float64",
            loss_type="dspark", teacher_hidden=self.hidden,
            confidence_logits=torch.zeros(2, 3, 4, dtype=torch.float64))

    def test_argument_types(self):
        # NumPy integers are ints; bools and floats are not.
        numpy_k = self.call(top_k=np.int64(3)).diagnostics
        self.assertEqual(numpy_k.top_k.shape[-1], 3)
        torch.testing.assert_close(
            numpy_k.top_k_values, self.call(top_k=3).diagnostics.top_k_values)
        for bad in (True, 2.0):
            with self.assertRaisesRegex(
                    TypeError, f"^top_k: must be an int, got {bad!r}$"):
                self.call(top_k=bad)
        self.assertRaisesMessage(
            TypeError, "gamma: must be a float, got True", gamma=True)
        self.assertRaisesMessage(
            TypeError, "chunk_blocks: must be an int, got True",
            chunk_blocks=True)
        self.assertRaisesMessage(
            TypeError, "threads: must be an int, got False", threads=False)
        with self.assertRaisesRegex(TypeError, "^top_k: must be an int, got"):
            self.call(top_k=np.bool_(True))
        with self.assertRaisesRegex(TypeError, "^gamma: must be a float, got"):
            self.call(gamma=np.bool_(True))
        self.assertRaisesMessage(
            ValueError,
            "chunk_blocks: must fit in 64 bits, got 9223372036854775808",
            chunk_blocks=2**63)
        self.assertRaisesMessage(
            ValueError,
            "ignore_index: must fit in 64 bits, got 1180591620717411303424",
            ignore_index=2**70)
        self.assertEqual(self.call(gamma=np.float64(5)).loss_num,
                         self.call(gamma=5.0).loss_num)
        self.assertEqual(self.call(chunk_blocks=np.int32(1)).loss_num,
                         self.call(chunk_blocks=1).loss_num)

    def test_override_ranges_name_the_keyword(self):
        for keyword, value, message in (
                ("chunk_blocks", 0,
                 "chunk_blocks: must be > 0 (chunking.blocks_per_chunk), "
                 "got 0"),
                ("segment_chunks", -1,
                 "segment_chunks: must be >= 0 (0: never recompute) "
                 "(checkpoint.segment_chunks), got -1"),
                ("gamma", -1.0,
                 "gamma: must be finite and >= 0 (the loss family's gamma), "
                 "got -1"),
                ("gamma", float("nan"),
                 "gamma: must be finite and >= 0 (the loss family's gamma), "
                 "got nan"),
                ("label_smoothing", 1.0,
                 "label_smoothing: must be in [0, 1) "
                 "(loss.cross_entropy.label_smoothing), got 1"),
                ("z_loss_scale", float("inf"),
                 "z_loss_scale: must be finite and >= 0 "
                 "(loss.cross_entropy.z_loss_scale), got inf")):
            with self.subTest(keyword=keyword, value=value):
                self.assertRaisesMessage(ValueError, message,
                                         **{keyword: value})

    def test_thread_counts_are_bounded(self):
        message = ("threads: must lie in [0, 1024] (0: every usable CPU), "
                   "got 100000")
        self.assertRaisesMessage(ValueError, message, threads=100000)
        self.assertRaisesMessage(
            ValueError, message.replace("100000", "-1"), threads=-1)
        with self.assertRaises(ValueError) as raised:
            dflash.PreparedProjection(self.weight, threads=100000)
        self.assertEqual(str(raised.exception), message)
        with self.assertRaisesRegex(TypeError, "^threads: must be an int"):
            dflash.PreparedProjection(self.weight, threads=2.5)
        with self.assertRaisesRegex(
                ValueError, r"^head.threads: must lie in \[0, 1024\], got "
                "5000"):
            self.call(config="head { threads: 5000 } loss { dflash {} }")
        # More than the CPUs runs on the CPUs, and says so in its stats.
        cpus = len(os.sched_getaffinity(0))
        terms = self.call(threads=1024)
        self.assertEqual(terms.diagnostics.stats["threads"], min(1024, cpus))
        self.assertEqual(terms.loss_num, self.call(threads=1).loss_num)

    def test_mask_sum_beyond_float32(self):
        mask = self.weight_mask.clone()
        mask[0, 1, 1] = 3e38
        mask[0, 1, 2] = 3e38
        self.assertRaisesMessage(
            ValueError,
            "weight_mask: its values sum to more than float32 holds "
            "(3.40282e+38) by weight_mask[0, 1, 2] = 3e+38; the loss and "
            "accuracy denominators would be inf",
            weight_mask=mask)

    def test_terms_beyond_float32(self):
        # The masks' sum fits float32; the loss they weigh does not.
        mask = (self.weight_mask > 0).float() * 2.5e37
        with self.assertRaisesRegex(
                ValueError, r"^weight_mask: the loss_num it weighs, [0-9.]+e\+3"
                r"[89], overflows float32 \(the terms' dtype\); scale "
                "weight_mask down$"):
            self.call(weight_mask=mask)
        # float64 holds them.
        terms = self.call(hidden=self.hidden.double(),
                          lm_head_weight=self.weight.double(),
                          weight_mask=mask.double())
        self.assertTrue(torch.isfinite(terms.loss_num))

    def test_memory_error(self):
        # 2^18 rows x 2^24 logits (16 TiB) in one chunk: the allocation fails.
        rows = (1, 2**14, 16)
        with self.assertRaises(MemoryError) as raised:
            dflash_objective(
                torch.zeros(rows + (1,)), torch.zeros(2**24, 1),
                torch.zeros(rows, dtype=torch.long), torch.ones(rows),
                mode="materialize")
        self.assertIn("bytes", str(raised.exception))

    def test_chunked_reduce_argument_types(self):
        x = torch.ones(6, 2)
        terms = lambda t: (t.sum(),)  # noqa: E731
        with self.assertRaisesRegex(
                ValueError, r"^chunk_size: must be an int >= 0, got 2.5$"):
            chunked_reduce(terms, x, chunk_size=2.5)
        with self.assertRaisesRegex(
                ValueError, r"^chunk_size: must be an int >= 0, got True$"):
            chunked_reduce(terms, x, chunk_size=True)
        with self.assertRaisesRegex(
                ValueError, r"^segment_chunks: must be an int >= 1, got 1.5$"):
            chunked_reduce(terms, x, chunk_size=2, segment_chunks=1.5)
        with self.assertRaisesRegex(
                TypeError,
                r"^tensors\[1\]: must be a torch.Tensor or None, got float$"):
            chunked_reduce(terms, x, 2.0, chunk_size=2)
        with self.assertRaisesRegex(TypeError, r"^dim: must be an int, got"):
            chunked_reduce(terms, x, chunk_size=2, dim=0.0)
        self.assertEqual(
            chunked_reduce(terms, x, chunk_size=np.int64(4))[0].item(), 12)

    def test_fused_head_names_its_arguments_too(self):
        head = FusedHead(torch.nn.Linear(8, 13))
        with self.assertRaisesRegex(ValueError, "^hidden: must be float32"):
            head(self.hidden.half(), self.target_ids, self.weight_mask)


if __name__ == "__main__":
    unittest.main(verbosity=2)
