"""What the GlobalNormalizer tests share: each rank's training windows in
every mode, the single-process reference of a window, and the comparison
(float64, 1e-12 relative).

The reference is one process holding all the data:
- dflash: every rank's micro-batches as one batch (sum of numerators over
  sum of denominators);
- dspark: each micro-batch index as one batch of every rank's rows, the
  window's mean of their losses;
- domino: the mean of every rank's micro-batch losses, each on its own.
Compared: the gradients of the draft's parameters (and Domino's
correction), the loss, the summed denominator, the micro-batch count and
the metric ratios, on every rank (which all agree).
"""

import unittest

import torch

import ranks
from dflash.torch.distributed import MODES, GlobalNormalizer

TOLERANCE = 1e-12


def metric_ratio(num, den):
    """A metric's value from its summed (numerator, denominator): 0 where
    the denominator is."""
    num = torch.as_tensor(num, dtype=torch.float64)
    den = torch.as_tensor(den, dtype=torch.float64)
    return torch.where(den != 0, num / den.clamp_min(1e-300),
                       torch.zeros_like(num))


def train_rank(rank, world, plans, grad_sync):
    """Each window of `plans` ([window][rank] = [(blocks, masked)] per
    micro-batch) in every mode: the gradients after synchronisation and
    step(), and step()'s result."""
    weight = ranks.lm_head()
    out = {}
    for mode in MODES:
        params = ranks.parameters(mode)
        norm = GlobalNormalizer(mode=mode, grad_sync=grad_sync)
        windows = []
        for window, plan in enumerate(plans):
            for p in params.values():
                p.grad = None
            for micro, (blocks, masked) in enumerate(plan[rank]):
                batch = ranks.micro_batch(rank, 10 * window + micro, blocks,
                                          masked)
                terms = ranks.objective(mode, params, weight, batch)
                norm.loss(terms).backward()
            ranks.synchronise(params, grad_sync)
            result = norm.step(params.values())
            windows.append({
                "grads": {n: p.grad.clone() for n, p in params.items()},
                "step": result._asdict()})
        out[mode] = windows
    return out


def reference(mode, plan, window):
    """One process: the window's loss under the mode, its gradients, the
    summed denominator, micro-batch count and metric pairs."""
    weight = ranks.lm_head()
    params = ranks.parameters(mode)
    world = len(plan)
    batches = [[ranks.micro_batch(rank, 10 * window + micro, blocks, masked)
                for micro, (blocks, masked) in enumerate(plan[rank])]
               for rank in range(world)]
    if mode == "dflash":
        calls = [ranks.objective(mode, params, weight, ranks.concatenated(
            [b for rank_batches in batches for b in rank_batches]))]
        loss = calls[0].loss
    elif mode == "dspark":
        micro_count = len(plan[0])
        calls = [ranks.objective(mode, params, weight, ranks.concatenated(
            [batches[rank][micro] for rank in range(world)]))
            for micro in range(micro_count)]
        loss = sum(t.loss for t in calls) / micro_count
    else:
        calls = [ranks.objective(mode, params, weight, b)
                 for rank_batches in batches for b in rank_batches]
        loss = sum(t.loss for t in calls) / len(calls)
    loss.backward()
    family = [t.diagnostics.family_terms for t in calls]
    pairs = {
        "loss": (sum(t.loss_num for t in calls),
                 sum(t.loss_den for t in calls)),
        "accuracy": (sum(t.correct_num for t in calls),
                     sum(t.accuracy_den for t in calls)),
        "accuracy_per_position": (
            sum(t.diagnostics.position_correct for t in calls),
            sum(t.diagnostics.position_den for t in calls)),
        "target_probability": (
            sum(t.diagnostics.target_probability_num for t in calls),
            sum(t.accuracy_den for t in calls)),
    }
    if mode == "dspark":
        pairs["l1_loss"] = (sum(f["l1_loss_num"] for f in family),
                            sum(t.loss_den for t in calls))
    if mode == "domino":
        pairs["accept_length"] = (sum(f["accept_num"] for f in family),
                                  sum(f["accept_den"] for f in family))
    return {
        "loss": float(loss.detach()),
        "grads": {n: p.grad for n, p in params.items()},
        "loss_den": float(pairs["loss"][1]),
        "micro_batches": sum(len(p) for p in plan),
        "pairs": pairs,
    }


def train_scenarios(rank, world, scenarios):
    """train_rank for each (plans, grad_sync) of `scenarios`."""
    return [train_rank(rank, world, plans, grad_sync)
            for plans, grad_sync in scenarios]


class NormalizerTestCase(unittest.TestCase):
    def check(self, results, plans):
        for mode in MODES:
            for window, plan in enumerate(plans):
                want = reference(mode, plan, window)
                first = results[0][mode][window]
                for rank, result in enumerate(results):
                    got = result[mode][window]
                    where = f"{mode}, window {window}, rank {rank}"
                    with self.subTest(where):
                        step = got["step"]
                        # Every rank gets the same result.
                        self.assertEqual(step["loss"], first["step"]["loss"])
                        self.assertEqual(step["grad_scale"],
                                         first["step"]["grad_scale"])
                        self.assertLess(ranks.relative_error(
                            step["loss"], want["loss"]), TOLERANCE)
                        self.assertLess(ranks.relative_error(
                            step["loss_den"], want["loss_den"]), TOLERANCE)
                        self.assertEqual(step["micro_batches"],
                                         want["micro_batches"])
                        for name, p in got["grads"].items():
                            self.assertLess(ranks.relative_error(
                                p, want["grads"][name]), TOLERANCE, name)
                        for name, (num, den) in want["pairs"].items():
                            self.assertLess(ranks.relative_error(
                                step["metrics"][name],
                                metric_ratio(num, den)), TOLERANCE, name)
                            self.assertLess(ranks.relative_error(
                                step["sums"][name][1],
                                torch.as_tensor(den, dtype=torch.float64)),
                                TOLERANCE, name)
