"""dflash_objective against SpecForge's own OnlineDFlashModel, through
autograd: the goldens in tests/goldens/specforge_dflash (made by
tools/specforge_goldens.py from SpecForge's code; the matched commit is in
tests/goldens/README.md) hold a token batch, anchors, the draft's output
states, the frozen lm_head, and SpecForge's terms, loss and d(loss)/d(states).
"""

import importlib.util
import os
import unittest

import numpy as np
import torch

from dflash.torch import dflash_objective

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
GOLDENS = os.path.join(ROOT, "tests", "goldens", "specforge_dflash")


def generator():
    """tools/specforge_goldens.py, for its stand-in DFlash2 selector."""
    spec = importlib.util.spec_from_file_location(
        "specforge_goldens", os.path.join(ROOT, "tools", "specforge_goldens.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
# terms.npy's order (tools/specforge_goldens.py TERMS).
CE_NUM, TV_NUM, LOSS_DEN, PROB_NUM, CORRECT, ACC_DEN, LOSS_NUM, LOSS, ACC = \
    range(9)


def load(directory):
    arrays = {name[:-4]: np.load(os.path.join(directory, name))
              for name in os.listdir(directory) if name.endswith(".npy")}
    with open(os.path.join(directory, "config.textproto")) as f:
        arrays["config"] = f.read()
    return arrays


def labels(g, block_size):
    """SpecForge's labels: slot k of an anchor predicts token anchor + k;
    the weight mask is keep x in range x (k > 0) x loss mask, written here
    from its definition."""
    input_ids = torch.from_numpy(g["input_ids"])
    loss_mask = torch.from_numpy(g["loss_mask"]).double()
    anchors = torch.from_numpy(g["anchors"])
    keep = torch.from_numpy(g["keep"]).double()
    seq_len = input_ids.shape[1]
    index = anchors.unsqueeze(-1) + torch.arange(block_size)
    in_range = (index < seq_len).double()
    index = index.clamp(max=seq_len - 1)
    rows = torch.arange(input_ids.shape[0]).view(-1, 1, 1)
    target_ids = input_ids[rows, index]
    not_anchor = (torch.arange(block_size) > 0).double()
    weight_mask = keep.unsqueeze(-1) * in_range * not_anchor * loss_mask[
        rows, index]
    return target_ids, weight_mask


def selector_loss_num(g, terms, hidden, target_ids):
    """What SpecForge adds for a DFlash2 draft: selector_loss_alpha times the
    stand-in selector's CE over dflash's top-k, weighted by the loss weight
    where the target is a candidate; the selector sees detached inputs with
    selector_stop_gradient."""
    gen = generator()
    selector = gen.SelectorStandIn(g["selector_embed"], g["selector_proj"])
    rows = terms.diagnostics
    values = rows.top_k_values.double()
    alpha, stop_gradient = g["selector"][5], g["selector"][6]
    if stop_gradient:
        values, hidden = values.detach(), hidden.detach()
    predecessor_ids = torch.cat([target_ids[..., :1], target_ids[..., :-1]],
                                dim=-1)
    logits = selector.score_candidates(rows.top_k.clamp(min=0), values,
                                       hidden, predecessor_ids)
    ce = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        rows.target_candidate_index.reshape(-1),
        reduction="none").reshape(target_ids.shape)
    weights = rows.loss_weight.double() * rows.target_is_candidate.double()
    return alpha * (ce * weights).sum(), float((ce * weights).sum())


class SpecForgeGoldensTest(unittest.TestCase):

    def test_every_golden_in_fused_and_checkpoint_mode(self):
        names = sorted(os.listdir(GOLDENS))
        self.assertGreaterEqual(len(names), 14)
        for name in names:
            g = load(os.path.join(GOLDENS, name))
            batch, num_anchors = g["anchors"].shape
            hidden_size = g["hidden"].shape[1]
            block_size = g["hidden"].shape[0] // (batch * num_anchors)
            target_ids, weight_mask = labels(g, block_size)
            with_selector = "selector" in g
            # SpecForge rounds its decay weights to float32; the selector
            # reads float32 values and loss weights (dflash's outputs).
            rtol = 3e-7 if "gamma: 7" in g["config"] or "gamma: 3" in g[
                "config"] else 1e-10
            if with_selector:
                rtol = 1e-5
            for mode in ("fused", "checkpoint"):
                with self.subTest(case=name, mode=mode):
                    hidden = torch.from_numpy(g["hidden"]).reshape(
                        batch, num_anchors, block_size, hidden_size)
                    hidden.requires_grad_(True)
                    # The teacher diagnostics where SpecForge's teacher
                    # logits and dflash's agree (no logit transform).
                    teacher = None
                    if "logit_softcap" not in g["config"]:
                        teacher = torch.from_numpy(g["teacher_hidden"]).reshape(
                            hidden.shape)
                    terms = dflash_objective(
                        hidden, torch.from_numpy(g["weight"]), target_ids,
                        weight_mask, config=g["config"], mode=mode,
                        chunk_blocks=2, teacher_hidden=teacher,
                        top_k=5 if with_selector else 0)
                    loss_num = terms.loss_num
                    if with_selector:
                        added, ce_num = selector_loss_num(
                            g, terms, hidden, target_ids)
                        loss_num = loss_num + added
                        self.assertAlmostEqual(
                            ce_num, g["selector"][0],
                            delta=rtol * abs(g["selector"][0]),
                            msg="selector_ce_num")
                    loss = loss_num / terms.loss_den
                    loss.backward()
                    want = g["terms"]
                    diag = terms.diagnostics
                    for label, actual, index in (
                            ("loss", loss, LOSS),
                            ("loss_num", loss_num, LOSS_NUM),
                            ("loss_den", terms.loss_den, LOSS_DEN),
                            ("ce_loss_num", diag.ce_loss_num, CE_NUM),
                            ("tv_loss_num", diag.tv_loss_num, TV_NUM),
                            ("target_probability_num",
                             diag.target_probability_num, PROB_NUM),
                            ("correct_num", terms.correct_num, CORRECT),
                            ("accuracy_den", terms.accuracy_den, ACC_DEN)):
                        self.assertAlmostEqual(
                            float(actual), float(want[index]),
                            delta=rtol * max(1.0, abs(float(want[index]))),
                            msg=label)
                    grad = hidden.grad.reshape(-1, hidden_size).numpy()
                    scale = np.abs(g["grad_hidden"]).max()
                    self.assertLessEqual(
                        np.abs(grad - g["grad_hidden"]).max() / scale, rtol,
                        "d(loss)/d(hidden)")
                    # The diagnostics: SpecForge takes its softmax in
                    # float32 for them (position.npy, accepted.npy).
                    d = diag.metrics
                    position = g["position"]
                    checked = [
                        (2, "target_probability_per_position", 2e-6),
                        (3, "loss_weight_per_position", 2e-6),
                        (4, "top_k_recall_per_position", 0),
                        (5, "top_k_mass_per_position", 2e-6)]
                    if teacher is not None:
                        checked += [
                            (6, "teacher_acceptance_per_position", 2e-6),
                            (7, "teacher_agreement_per_position", 0),
                            (8, "teacher_top_k_mass_per_position", 2e-6)]
                        self.assertAlmostEqual(
                            float(d["teacher_expected_accepted_length_num"]),
                            g["accepted"][3], delta=2e-6 * g["accepted"][3])
                    for row, name, tol in checked:
                        np.testing.assert_allclose(
                            d[name].numpy()[1:], position[row, 1:],
                            rtol=tol, atol=tol, err_msg=name)
                    accepted = g["accepted"]
                    self.assertEqual(float(d["block_den"]), accepted[0])
                    self.assertEqual(float(d["oracle_accepted_length_num"]),
                                     accepted[1])
                    self.assertAlmostEqual(
                        float(d["expected_accepted_length_num"]), accepted[2],
                        delta=2e-6 * accepted[2])
                    if "LAMBDA" in g["config"]:
                        self.assertIsNotNone(diag.lk_kl_weight)
                    else:
                        self.assertIsNone(diag.lk_kl_weight)


if __name__ == "__main__":
    unittest.main()
