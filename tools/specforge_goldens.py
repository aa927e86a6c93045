#!/usr/bin/env python3
"""Makes the SpecForge parity goldens by running SpecForge's own code.

For each case, SpecForge's `OnlineDFlashModel.forward` runs on a small fixed
batch (its labels, weight masks, chunked objective, LK composition and
denominators), with the draft network replaced by given output states: the
goldens hold what SpecForge computes from those states, and the gradient of
its loss with respect to them. Everything runs in float64, so the goldens
are the exact reference for dflash's float64 path.

    python3 tools/specforge_goldens.py --specforge /path/to/SpecForge \\
        --out tests/goldens/specforge_dflash

`--specforge` is a checkout of sgl-project/SpecForge (the commit this
project matches is in tests/goldens/README.md); nothing of it is copied
here. Needs torch >= 2.1. Each case directory gets:

  config.textproto   the dflash ObjectiveConfig that computes the same loss
  input_ids.npy      int64 [B, S]
  loss_mask.npy      uint8 [B, S]
  anchors.npy        int64 [B, N]  anchor positions
  keep.npy           uint8 [B, N]  anchor keep mask
  hidden.npy         float64 [B * N * K, H]  the draft's output states
  weight.npy         float64 [V, H]  the frozen lm_head weight
  grad_hidden.npy    float64 [B * N * K, H]  d(loss)/d(hidden)
  terms.npy          float64, in TERMS order (below)
  teacher_hidden.npy float64 [B * N * K, H]  the target model's state
                     behind each row's label (target_last_hidden_states,
                     aligned by SpecForge), for the teacher diagnostics
  position.npy       float64 [9, K]: per block position k >= 1 (column 0
                     is 0), from SpecForge's metrics: the weight mask's sum,
                     argmax hits, target probability, loss weight, top-16
                     recall and top-16 mass, teacher acceptance, top-1
                     agreement and top-16 mass (the numerators)
  accepted.npy       float64 [4]: block_den, the top-16 oracle accepted
                     length's, the expected accepted length's and the
                     teacher's expected accepted length's numerators
                     (top-5, the selector's, in the selector cases)

The DFlash2 cases (a candidate selector, SelectorStandIn) also have:
  selector.npy       float64, in SELECTOR_TERMS order
  selector_embed.npy float64 [V, 4], selector_proj.npy float64 [H, 4]: the
                     stand-in selector's tables
"""

import argparse
import os
import sys
import types

import numpy as np
import torch

TERMS = (
    "ce_loss_num",
    "tv_loss_num",
    "loss_den",
    "target_probability_num",
    "correct_num",
    "accuracy_den",
    "loss_num",
    "loss",
    "accuracy",
)

B, S, N, K, H, V = 2, 24, 3, 4, 8, 37

# The DFlash2 cases' stand-in selector: its top-k, SpecForge's
# selector_loss_alpha for it, and the draft's transform_unary_logits, a
# tanh softcap that dflash's head.logit_softcap reproduces.
SELECTOR_TOP_K = 5
UNARY_SOFTCAP = 20.0
SELECTOR_TERMS = (
    "selector_ce_num",
    "selector_probability_num",
    "selector_correct_num",
    "selector_weight_den",
    "selector_covered_num",
    # The case's settings, for the caller who runs the selector.
    "selector_loss_alpha",
    "selector_stop_gradient",
)

# name: (SpecForge constructor arguments, the dflash LossConfig body).
CASES = {
    "dflash_gamma7": (
        dict(loss_type="dflash", loss_decay_gamma=7.0),
        "dflash { gamma: 7 }",
    ),
    "dflash_gamma0": (
        dict(loss_type="dflash", loss_decay_gamma=0.0),
        "dflash { gamma: 0 }",
    ),
    "dflash_lk_lambda": (
        dict(loss_type="dflash", lk_loss_type="lambda"),
        "dflash { lk { type: LAMBDA } }",
    ),
    "dflash_lk_lambda_gamma7": (
        dict(loss_type="dflash", loss_decay_gamma=7.0, lk_loss_type="lambda",
             kl_scale=0.8, kl_decay=2.5),
        "dflash { gamma: 7 lk { type: LAMBDA kl_scale: 0.8 kl_decay: 2.5 } }",
    ),
    "dflash_lk_alpha": (
        dict(loss_type="dflash", lk_loss_type="alpha"),
        "dflash {}",
    ),
    "dflash_lk_tv_gamma3": (
        dict(loss_type="dflash", loss_decay_gamma=3.0, lk_loss_type="tv"),
        "tv { gamma: 3 }",
    ),
    "dpace": (
        dict(loss_type="dpace", dpace_alpha=0.5),
        "dpace { alpha: 0.5 }",
    ),
    "dpace_lk_tv": (
        dict(loss_type="dpace", dpace_alpha=0.5, lk_loss_type="tv"),
        "dpace { alpha: 0.5 lk { type: TV } }",
    ),
    "dpace_lk_lambda": (
        dict(loss_type="dpace", dpace_alpha=0.4, lk_loss_type="lambda",
             kl_scale=1.2, kl_decay=0.5),
        "dpace { alpha: 0.4 lk { type: LAMBDA kl_scale: 1.2 kl_decay: 0.5 } }",
    ),
    "dpace_cumulative": (
        dict(loss_type="dpace-cumulative-confidence-only", dpace_alpha=0.3),
        "dpace { alpha: 0.3 variant: CUMULATIVE_CONFIDENCE_ONLY }",
    ),
    "dpace_continuation": (
        dict(loss_type="dpace-continuation-value-only", dpace_alpha=0.7),
        "dpace { alpha: 0.7 variant: CONTINUATION_VALUE_ONLY }",
    ),
    "dpace_continuation_lk_lambda": (
        dict(loss_type="dpace-continuation-value-only", dpace_alpha=0.6,
             lk_loss_type="lambda"),
        "dpace { alpha: 0.6 variant: CONTINUATION_VALUE_ONLY "
        "lk { type: LAMBDA } }",
    ),
    # With a DFlash2 candidate selector (SelectorStandIn below).
    "dflash_selector": (
        dict(loss_type="dflash", loss_decay_gamma=7.0, selector_loss_alpha=0.5),
        "dflash { gamma: 7 }",
    ),
    "dpace_lk_tv_selector_stop_gradient": (
        dict(loss_type="dpace", dpace_alpha=0.5, lk_loss_type="tv",
             selector_loss_alpha=1.0, selector_stop_gradient=True),
        "dpace { alpha: 0.5 lk { type: TV } }",
    ),
}


class SelectorStandIn(torch.nn.Module):
    """A fixed tiny DFlash2 candidate selector: each candidate's score is
    0.8 * its unary logit plus its embedding against the projected hidden
    state and the predecessor's embedding. The goldens hold its tables
    (selector_embed.npy, selector_proj.npy); //python:specforge_goldens_test
    runs this class on dflash's top-k."""

    top_k = SELECTOR_TOP_K

    def __init__(self, embed, proj):
        super().__init__()
        self.register_buffer("embed", torch.as_tensor(embed))
        self.register_buffer("proj", torch.as_tensor(proj))

    def score_candidates(self, candidate_ids, unary_logits, hidden_states,
                         predecessor_ids):
        context = hidden_states @ self.proj + self.embed[predecessor_ids]
        return 0.8 * unary_logits + (
            self.embed[candidate_ids] * context.unsqueeze(-2)).sum(-1)

    def greedy_path(self, candidate_ids, unary_logits, hidden_states,
                    anchor_token_ids):
        previous, path = anchor_token_ids, []
        for slot in range(candidate_ids.shape[1]):
            scores = self.score_candidates(
                candidate_ids[:, slot], unary_logits[:, slot],
                hidden_states[:, slot], previous)
            previous = candidate_ids[:, slot].gather(
                -1, scores.argmax(-1, keepdim=True)).squeeze(-1)
            path.append(previous)
        return torch.stack(path, dim=1)


def selector_tables(seed):
    rng = np.random.default_rng(seed + 1)
    return rng.standard_normal((V, 4)) * 0.5, rng.standard_normal((H, 4)) * 0.5


def import_specforge(root):
    """Imports SpecForge's DFlash model module from a checkout.

    The module imports the draft network and the attention backend at load
    time; the objective never calls them, so light stand-ins take their place
    (the real ones need transformers and a GPU attention stack).
    """
    sys.path.insert(0, root)
    draft = types.ModuleType("specforge.modeling.draft.dflash")
    draft.DFlashDraftModel = torch.nn.Module
    backend = types.ModuleType(
        "specforge.modeling.draft.flex_attention_backend")
    backend.flex_attention_backend = lambda: "TRITON"
    for name in ("specforge.modeling", "specforge.modeling.draft"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["specforge.modeling.draft.dflash"] = draft
    sys.modules["specforge.modeling.draft.flex_attention_backend"] = backend
    from specforge.algorithms.common import dflash_family_model
    return dflash_family_model


def make_batch(seed):
    """A token batch with masked spans, anchors (one padding anchor)."""
    rng = np.random.default_rng(seed)
    input_ids = rng.integers(0, V, size=(B, S), dtype=np.int64)
    loss_mask = np.ones((B, S), dtype=np.uint8)
    loss_mask[0, :3] = 0
    loss_mask[0, 13] = 0
    loss_mask[1, :5] = 0
    loss_mask[1, 18:] = 0
    # Sequence 0 ends with an anchor whose block runs past S; sequence 1
    # has two anchors and a padding slot.
    anchors = np.array([[3, 9, 21], [5, 11, 0]], dtype=np.int64)
    keep = np.array([[1, 1, 1], [1, 1, 0]], dtype=np.uint8)
    hidden = rng.standard_normal((B, N * K, H))
    weight = rng.standard_normal((V, H)) * 0.7
    # The target model's last hidden states, for the teacher diagnostics.
    target_states = rng.standard_normal((B, S, H))
    return input_ids, loss_mask, anchors, keep, hidden, weight, target_states


class DraftStandIn(torch.nn.Module):
    """The draft network's attributes the objective reads."""

    sliding_window = None


class SelectorDraftStandIn(DraftStandIn):
    """A DFlash2 draft: a candidate selector and a unary-logit transform."""

    def __init__(self, selector):
        super().__init__()
        self.candidate_selector = selector

    @staticmethod
    def transform_unary_logits(logits):
        return UNARY_SOFTCAP * torch.tanh(logits / UNARY_SOFTCAP)


def run_case(module, kwargs, batch, selector=None):
    """SpecForge's forward and backward on the batch.

    Returns its loss, accuracy, metrics, d(loss)/d(states), and the sum of
    the additive terms its chunk function returned in the forward pass.
    """
    input_ids, loss_mask, anchors, keep, hidden, weight, target_states = batch
    lm_head = torch.nn.Linear(H, V, bias=False, dtype=torch.float64)
    with torch.no_grad():
        lm_head.weight.copy_(torch.from_numpy(weight))
    lm_head.requires_grad_(False)
    embed = torch.nn.Embedding(V, 4, dtype=torch.float64)
    model = module.OnlineDFlashModel(
        draft_model=(DraftStandIn() if selector is None
                     else SelectorDraftStandIn(selector)),
        target_lm_head=lm_head,
        target_embed_tokens=embed,
        mask_token_id=0,
        block_size=K,
        attention_backend="sdpa",
        num_anchors=N,
        objective_chunk_blocks=2,
        **kwargs,
    )
    states = torch.from_numpy(hidden).clone().requires_grad_(True)
    anchor_t = torch.from_numpy(anchors)
    keep_t = torch.from_numpy(keep).bool()
    # The draft's forward: the given states for the given anchors.
    model._forward_draft_blocks = (
        lambda *args, **kw: (anchor_t, keep_t, states))
    # The chunk function's terms as forward sums them (recomputations in
    # backward are not counted).
    chunk_terms = []
    recording = [True]
    objective = model._dflash_objective_chunk_terms

    def recorded(*args):
        terms = objective(*args)
        if recording[0]:
            chunk_terms.append([float(t.detach()) for t in terms])
        return terms

    model._dflash_objective_chunk_terms = recorded
    loss, accuracy, metrics = model(
        input_ids=torch.from_numpy(input_ids),
        hidden_states=torch.zeros(B, S, H, dtype=torch.float64),
        loss_mask=torch.from_numpy(loss_mask).double(),
        target_last_hidden_states=torch.from_numpy(target_states),
    )
    recording[0] = False
    loss.backward()
    terms = np.sum(np.array(chunk_terms), axis=0)
    # The target state behind each row's label, as SpecForge aligns it.
    labels = (anchor_t.unsqueeze(-1) + torch.arange(K)).clamp(max=S - 1)
    teacher = model._aligned_target_hidden(torch.from_numpy(target_states),
                                           labels)
    return (loss, accuracy, metrics, states.grad, terms,
            teacher.reshape(B * N * K, H).numpy())


def position_metrics(metrics, top_k):
    """Per block position k >= 1, from SpecForge's ratio metrics: the
    weight mask's sum, argmax hits, target probability, loss weight, top-k
    recall and top-k mass, teacher acceptance, top-1 agreement and top-k
    mass (the ratios' numerators)."""
    ratios = metrics["ratio_metrics"]
    table = np.zeros((9, K))
    for k in range(1, K):
        def num(name):
            return float(ratios[f"position_{k}/{name}"][0])

        table[:, k] = [
            float(ratios[f"position_{k}/hard_label/unary_top1_accuracy"][1]),
            num("hard_label/unary_top1_accuracy"),
            num("hard_label/unary_probability"),
            num("objective/loss_weight_share"),
            num(f"hard_label/unary_top{top_k}_recall"),
            num(f"hard_label/unary_top{top_k}_mass"),
            num("teacher/expected_acceptance"),
            num("teacher/unary_top1_agreement"),
            num(f"teacher/unary_top{top_k}_mass"),
        ]
    return table


def accepted_lengths(metrics, top_k):
    """block_den and the oracle and expected accepted lengths' numerators."""
    ratios = metrics["ratio_metrics"]
    oracle, den = ratios[
        f"dflash/hard_label/unary_top{top_k}_oracle_accepted_length"]
    expected, _ = ratios["dflash/hard_label/expected_accepted_length"]
    teacher, _ = ratios["dflash/teacher/expected_accepted_length"]
    return np.array([float(den), float(oracle), float(expected),
                     float(teacher)])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--specforge", required=True,
                        help="a checkout of sgl-project/SpecForge")
    parser.add_argument("--out", required=True, help="the goldens directory")
    parser.add_argument("--seed", type=int, default=20261203)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    module = import_specforge(os.path.abspath(args.specforge))
    batch = make_batch(args.seed)
    input_ids, loss_mask, anchors, keep, hidden, weight, _ = batch
    embed, proj = selector_tables(args.seed)
    for name, (kwargs, loss_text) in CASES.items():
        with_selector = "selector_loss_alpha" in kwargs
        selector = SelectorStandIn(embed, proj) if with_selector else None
        loss, accuracy, metrics, grad, terms, teacher = run_case(
            module, kwargs, batch, selector)
        # SpecForge's metric top-k: the selector's, else metric_top_k (16).
        top_k = SELECTOR_TOP_K if with_selector else 16
        position = position_metrics(metrics, top_k)
        loss_num, loss_den = metrics["loss_terms"]
        values = [float(t) for t in terms[:6]] + [
            float(loss_num), float(loss), float(accuracy)]
        # The chunk function's terms and forward's must tell one story.
        assert abs(values[2] - float(loss_den)) <= 1e-12 * max(
            1.0, abs(values[2])), name
        directory = os.path.join(args.out, name)
        os.makedirs(directory, exist_ok=True)
        arrays = {
            "input_ids": input_ids,
            "loss_mask": loss_mask,
            "anchors": anchors,
            "keep": keep,
            "hidden": hidden.reshape(B * N * K, H),
            "weight": weight,
            "grad_hidden": grad.numpy().reshape(B * N * K, H),
            "teacher_hidden": teacher,
            "terms": np.array(values, dtype=np.float64),
            "position": position,
            "accepted": accepted_lengths(metrics, top_k),
        }
        if with_selector:
            arrays["selector"] = np.array(
                list(terms[6:11]) + [
                    kwargs["selector_loss_alpha"],
                    float(kwargs.get("selector_stop_gradient", False))],
                dtype=np.float64)
            arrays["selector_embed"] = embed
            arrays["selector_proj"] = proj
        for key, array in arrays.items():
            np.save(os.path.join(directory, key + ".npy"), array)
        with open(os.path.join(directory, "config.textproto"), "w") as f:
            f.write(
                f"# SpecForge OnlineDFlashModel({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})\n"
                f"layout {{ block_size: {K} num_anchors: {N} }}\n"
                f"head {{ vocab_size: {V} hidden_size: {H} dtype: FLOAT64"
                + (f" logit_softcap: {UNARY_SOFTCAP:g} metric_top_k: "
                   f"{SELECTOR_TOP_K}" if with_selector else "")
                + " }\n"
                f"loss {{ {loss_text} }}\n")
        print(f"{name}: loss {float(loss):.12g}")


if __name__ == "__main__":
    main()
