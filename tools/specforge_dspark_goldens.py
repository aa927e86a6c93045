#!/usr/bin/env python3
"""Makes the DSpark and Domino parity goldens by running SpecForge's own code.

For each case, SpecForge's `OnlineDSparkModel.forward` or
`OnlineDominoModel.forward` runs on the batch of tools/specforge_goldens.py
(same seed, tokens, anchors and loss-mask holes; some draft and target
states steered so that argmax hits occur, see planted_batch), with the draft
backbone replaced by given output states, and one objective chunk
(objective_chunk_blocks=0). The
draft heads are SpecForge's own: `DSparkDraftModel`'s Markov heads and
`AcceptRatePredictor`, `DominoDraftModel`'s GRU and `embed_proj` (built by
their `_init_draft_head`, without the backbone), and SpecForge's
`domino_weighted_cross_entropy` (its reference path:
SPECFORGE_DOMINO_TRITON_CE=0). Everything runs in float64; SpecForge's
float32 upcasts (`.float()`) of float64 tensors are kept in float64 unless
--float32-casts is given (long/bool to float32 casts, e.g. the decay
weights and DSpark's float32 loss weights and their sum, stay as SpecForge
does them).

    python3 tools/specforge_dspark_goldens.py --specforge /path/to/SpecForge \\
        --out tests/goldens

`--specforge` is a SpecForge tree holding
specforge/algorithms/common/dflash_family_model.py, specforge/core/chunking.py,
specforge/core/domino_loss.py, specforge/modeling/draft/dspark.py and
specforge/modeling/draft/domino.py (the versions are in the goldens'
README.md); nothing of it is copied here. Modules that only the backbone
needs (dflash.py, registry.py, specforge.utils) get light stand-ins. The
cases go to <out>/specforge_dspark/<case> and <out>/specforge_domino/<case>.
Rows R = B * N * K in (b, n, k) order, dropped blocks included. Each case
directory gets:

  config.textproto   the dflash ObjectiveConfig that computes the same loss
  input_ids.npy      int64 [B, S]
  loss_mask.npy      uint8 [B, S]
  anchors.npy        int64 [B, N]
  keep.npy           uint8 [B, N]
  hidden.npy         float64 [R, H]  the draft's output states
  weight.npy         float64 [V, H]  the frozen lm_head weight
  grad_hidden.npy    float64 [R, H]  d(loss)/d(hidden) through lm_head only
                     (not through the Markov, confidence or GRU modules,
                     which also read the states)
  With a low-rank correction, logits = hidden @ W^T + z @ M^T (DSpark's
  Markov bias: z the input of markov_w2; Domino's: z the input of
  embed_proj[2], zero rows at block slots k < suffix_start):
  correction_inputs.npy       float64 [R, r]
  correction_weight.npy       float64 [V, r]  M
  grad_correction_inputs.npy  float64 [R, r]
  grad_correction_weight.npy  float64 [V, r]
  DSpark only:
  teacher_hidden.npy float64 [R, H]  the target state SpecForge aligns to
                     each row (target_last_hidden_states[b, max(safe-1, 0)]),
                     when it reads the teacher
  confidence_logits.npy, grad_confidence_logits.npy  float64 [R], with a
                     confidence head
  terms.npy          float64 [15], DSPARK_TERMS order
  position.npy       float64 [4, K]: ce_position_num, correct_position_num,
                     position_den, dpard_credit_position_num
  Domino only:
  terms.npy          float64 [11], DOMINO_TERMS order
"""

import argparse
import contextlib
import importlib
import importlib.util
import os
import sys
import types

import numpy as np
import torch
import torch.nn.functional as F

# Domino's reference (non-CUDA) cross entropy; read by its constructor.
os.environ["SPECFORGE_DOMINO_TRITON_CE"] = "0"


def _load_dflash_generator():
    """tools/specforge_goldens.py, for its batch and shapes."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                        "specforge_goldens.py")
    spec = importlib.util.spec_from_file_location("specforge_goldens", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_DFLASH = _load_dflash_generator()
B, S, N, K, H, V = _DFLASH.B, _DFLASH.S, _DFLASH.N, _DFLASH.K, _DFLASH.H, _DFLASH.V
R = B * N * K

# The 12 scalar chunk terms (in _dspark_objective_chunk_terms' tuple, less
# its four [K] vectors), then the forward's.
DSPARK_TERMS = (
    "ce_num",
    "l1_num",
    "confidence_num",
    "confidence_error_num",
    "correct_num",
    "eval_den",
    "teacher_agreement_num",
    "teacher_top1_num",
    "draft_top1_num",
    "tau_num",
    "tau_den",
    "dpard_loss_num",
    "local_loss_den",
    "loss",
    "accuracy",
)
# Indices of those 12 in the chunk tuple (6, 7, 8, 15 are [K] vectors).
_DSPARK_SCALAR_INDEX = (0, 1, 2, 3, 4, 5, 9, 10, 11, 12, 13, 14)
_DSPARK_POSITION_INDEX = (6, 7, 8, 15)

DOMINO_TERMS = (
    "final_num",
    "base_num",
    "loss_den",
    "correct_num",
    "base_correct_num",
    "accuracy_den",
    "accept_num",
    "base_accept_num",
    "accept_den",
    "loss",
    "accuracy",
)

DSPARK_RANK = 3
DOMINO_EMB_DIM = 3
DOMINO_GRU_HIDDEN = 5
PARAM_SCALE = 0.3
EMBED_SCALE = 0.5

# name: (OnlineDSparkModel kwargs, DSparkDraftModel dflash_config, teacher).
DSPARK_CASES = {
    "vanilla": (
        dict(),
        dict(markov_rank=DSPARK_RANK, markov_head_type="vanilla",
             enable_confidence_head=True, confidence_head_with_markov=True),
        True,
    ),
    "gated_gamma5": (
        dict(loss_decay_gamma=5.0),
        dict(markov_rank=DSPARK_RANK, markov_head_type="gated",
             enable_confidence_head=True, confidence_head_with_markov=False),
        True,
    ),
    "rnn": (
        dict(dspark_ce_loss_alpha=0.3, dspark_l1_loss_alpha=0.5,
             dspark_confidence_head_alpha=0.7),
        dict(markov_rank=DSPARK_RANK, markov_head_type="rnn",
             enable_confidence_head=True, confidence_head_with_markov=True),
        True,
    ),
    "dpard": (
        dict(loss_type="dpard", dspark_ce_loss_alpha=0.0,
             dspark_l1_loss_alpha=0.0, dpard_alpha=0.4,
             dspark_confidence_head_alpha=1.0),
        dict(markov_rank=DSPARK_RANK, markov_head_type="vanilla",
             enable_confidence_head=True, confidence_head_with_markov=True),
        True,
    ),
    "no_confidence": (
        dict(dspark_ce_loss_alpha=0.1, dspark_l1_loss_alpha=0.9,
             dspark_confidence_head_alpha=0.0),
        dict(markov_rank=DSPARK_RANK, markov_head_type="vanilla",
             enable_confidence_head=False),
        True,
    ),
    "no_markov_ce_only": (
        dict(dspark_ce_loss_alpha=1.0, dspark_l1_loss_alpha=0.0,
             dspark_confidence_head_alpha=0.0),
        dict(markov_rank=0, enable_confidence_head=False),
        False,
    ),
}

# name: (DominoDraftModel dflash_config less emb_dim/gru_hidden_dim,
#        lambda_base, loss_decay_gamma or None).
DOMINO_CASES = {
    "noshift": (dict(shift_label=False, pure_draft_prefix_len=0), 0.0, None),
    "noshift_lambda_gamma4": (
        dict(shift_label=False, pure_draft_prefix_len=1), 0.3, 4.0),
    "shift": (dict(shift_label=True, pure_draft_prefix_len=0), 0.5, None),
    "shift_prefix_gamma2": (
        dict(shift_label=True, pure_draft_prefix_len=1), 0.0, 2.0),
}


# Block slots whose draft state is steered to its label (1) or not (0), per
# block in (b, n) order: argmax hits in runs of different lengths, a miss
# before a hit, and hits over sequence 0's loss-mask hole.
PLANTED_HITS = np.array([
    [[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1]],
    [[1, 0, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0]],
], dtype=bool)
PLANT_MARGIN = 1.5


def steer(states, weight, token_ids):
    """States whose lm_head argmax is each token by PLANT_MARGIN: from
    0.5 * state, gradient steps on the token's cross entropy (float64,
    deterministic) until the token's logit leads every other by the
    margin."""
    steered = 0.5 * states.reshape(-1, states.shape[-1])
    for row, token in enumerate(token_ids.reshape(-1)):
        h = steered[row]
        for _ in range(1000):
            logits = weight @ h
            others = np.delete(logits, token)
            if logits[token] - others.max() >= PLANT_MARGIN:
                break
            p = np.exp(logits - logits.max())
            p /= p.sum()
            p[token] -= 1.0
            h = h - 0.5 * (weight.T @ p)
        steered[row] = h
    return steered.reshape(states.shape)


def planted_batch(batch, label_offset):
    """The generator's batch with argmax hits planted.

    Random states never hit their labels (every golden of
    tools/specforge_goldens.py has correct_num 0), which leaves accuracy,
    accepted lengths and teacher agreement untested. The states at
    PLANTED_HITS are steered to their labels (input_ids[b, min(a + k +
    label_offset, S - 1)]); the target model's states at positions p with
    p % 3 != 2 are steered to input_ids[b, p + 1], so the teacher predicts
    the next token there. Token ids, loss mask, anchors and keep are
    unchanged.
    """
    input_ids, loss_mask, anchors, keep, hidden, weight, target_states = batch
    labels = np.minimum(anchors[:, :, None] + np.arange(K) + label_offset,
                        S - 1)
    tokens = np.take_along_axis(input_ids, labels.reshape(B, N * K), axis=1)
    hits = PLANTED_HITS.reshape(B, N * K)
    hidden = np.where(hits[..., None], steer(hidden, weight, tokens), hidden)
    next_tokens = np.concatenate([input_ids[:, 1:], input_ids[:, -1:]], 1)
    teach = (np.arange(S) % 3 != 2)[None, :, None]
    target_states = np.where(
        teach, steer(target_states, weight, next_tokens), target_states)
    for states, ids, rows in ((hidden, tokens, hits),
                              (target_states, next_tokens,
                               np.broadcast_to(teach[..., 0], (B, S)))):
        logits = states @ weight.T
        target = np.take_along_axis(logits, ids[..., None], -1)[..., 0]
        np.put_along_axis(logits, ids[..., None], -np.inf, -1)
        assert np.all((target - logits.max(-1))[rows] >= 1.0), "planted"
    assert np.abs(hidden).max() < 10 and np.abs(target_states).max() < 10
    return input_ids, loss_mask, anchors, keep, hidden, weight, target_states


def import_specforge(root):
    """Imports SpecForge's DFlash-family, DSpark and Domino modules.

    dspark.py and domino.py subclass the DFlash backbone and register it;
    the objective never runs the backbone, so it, the registry, the
    attention backend and specforge.utils get light stand-ins. The draft
    packages point at the checkout so dspark.py and domino.py load from it.
    """
    sys.path.insert(0, root)
    for name, sub in (("specforge.modeling", "specforge/modeling"),
                      ("specforge.modeling.draft",
                       "specforge/modeling/draft")):
        package = types.ModuleType(name)
        package.__path__ = [os.path.join(root, sub)]
        sys.modules[name] = package
    draft = types.ModuleType("specforge.modeling.draft.dflash")
    draft.DFlashDraftModel = torch.nn.Module
    draft.sample = lambda logits, *args, **kwargs: logits.argmax(-1)
    backend = types.ModuleType(
        "specforge.modeling.draft.flex_attention_backend")
    backend.flex_attention_backend = lambda: "TRITON"
    registry = types.ModuleType("specforge.modeling.draft.registry")
    registry.register_draft = lambda cls: cls
    utils = types.ModuleType("specforge.utils")
    utils.get_device_type = lambda: "cpu"
    sys.modules["specforge.modeling.draft.dflash"] = draft
    sys.modules["specforge.modeling.draft.flex_attention_backend"] = backend
    sys.modules["specforge.modeling.draft.registry"] = registry
    sys.modules["specforge.utils"] = utils
    try:
        import triton  # noqa: F401  (domino_loss.py imports it at load)
    except ImportError:
        _install_triton_stand_in()
    family = importlib.import_module(
        "specforge.algorithms.common.dflash_family_model")
    dspark = importlib.import_module("specforge.modeling.draft.dspark")
    domino = importlib.import_module("specforge.modeling.draft.domino")
    domino_loss = importlib.import_module("specforge.core.domino_loss")
    return family, dspark, domino, domino_loss


def _install_triton_stand_in():
    """A stand-in triton module with what domino_loss.py reads at import
    time; its kernels are never run (SPECFORGE_DOMINO_TRITON_CE=0)."""
    triton = types.ModuleType("triton")
    language = types.ModuleType("triton.language")
    triton.jit = lambda fn: fn
    triton.next_power_of_2 = lambda n: 1 << (int(n) - 1).bit_length()
    triton.language = language
    language.constexpr = object
    sys.modules["triton"] = triton
    sys.modules["triton.language"] = language


@contextlib.contextmanager
def float64_casts(enabled):
    """SpecForge's `.float()` upcasts leave float64 tensors in float64.

    Its code upcasts bf16 logits to float32 for softmaxes, the L1, D-PARD and
    the confidence logits; on float64 inputs that would round them to
    float32. Other casts (long or bool to float32) are unchanged.
    """
    if not enabled:
        yield
        return
    original = torch.Tensor.float

    def float_keeping_float64(self, *args, **kwargs):
        if self.dtype == torch.float64:
            return self
        return original(self, *args, **kwargs)

    torch.Tensor.float = float_keeping_float64
    try:
        yield
    finally:
        torch.Tensor.float = original


class LmHead(torch.nn.Module):
    """The frozen target lm_head, float64.

    A draft call (input with grad) goes through a fresh node whose gradient
    is d(loss)/d(hidden) through lm_head alone; a teacher call (no grad)
    keeps its input, the aligned target states.
    """

    def __init__(self, weight):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.as_tensor(weight).clone(),
                                         requires_grad=False)
        self.draft_inputs = []
        self.teacher_inputs = []

    def forward(self, x):
        if x.requires_grad:
            x = x * 1.0
            x.retain_grad()
            self.draft_inputs.append(x)
        else:
            self.teacher_inputs.append(x.detach().clone())
        return F.linear(x, self.weight)


def init_parameters(module, seed):
    """Seeded normal * PARAM_SCALE, in named_parameters order."""
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for _, parameter in module.named_parameters():
            parameter.copy_(torch.from_numpy(
                rng.standard_normal(tuple(parameter.shape)) * PARAM_SCALE))


def draft_head(draft_class, dflash_config):
    """SpecForge's draft model class with its heads and no backbone.

    `_init_draft_head` builds exactly the modules its `__init__` would (the
    DFlash backbone's constructor calls it); apply_logits_head,
    predict_confidence and compute_correction_logits are SpecForge's.
    """

    class HeadOnly(draft_class):
        sliding_window = None

        def __init__(self):
            torch.nn.Module.__init__(self)
            config = types.SimpleNamespace(
                vocab_size=V, hidden_size=H,
                dflash_config=dict(dflash_config))
            self._init_draft_head(config, config.dflash_config)

    HeadOnly.__name__ = draft_class.__name__ + "HeadOnly"
    return HeadOnly().to(torch.float64)


class Captures:
    """Forward hooks that keep a module's input or output with its grad."""

    def __init__(self):
        self.tensors = []

    def pre_hook(self, module, inputs):
        x = inputs[0]
        x.retain_grad()
        self.tensors.append(x)

    def hook(self, module, inputs, output):
        output.retain_grad()
        self.tensors.append(output)


def objective_model(model_class, draft, lm_head, embed, **kwargs):
    """SpecForge's objective (OnlineDSparkModel or OnlineDominoModel) around
    the draft head, in one objective chunk (no checkpoint, so the gradient
    hooks see each tensor once)."""
    return model_class(
        draft_model=draft,
        target_lm_head=lm_head,
        target_embed_tokens=embed,
        mask_token_id=0,
        block_size=K,
        attention_backend="sdpa",
        num_anchors=N,
        objective_chunk_blocks=0,
        **kwargs,
    )


def fix_draft_blocks(model, anchors, keep, hidden):
    """The draft's forward replaced by the batch's anchors and states;
    returns the states (a leaf with a gradient), anchors and keep."""
    states = torch.from_numpy(hidden).clone().requires_grad_(True)
    anchor_t = torch.from_numpy(anchors)
    keep_t = torch.from_numpy(keep).bool()
    model._forward_draft_blocks = (
        lambda *args, **kw: (anchor_t, keep_t, states))
    return states, anchor_t, keep_t


def fmt(value):
    return f"{value:g}"


def run_dspark(family, dspark, batch, name, kwargs, dflash_config,
               with_teacher, seed, f64):
    input_ids, loss_mask, anchors, keep, hidden, weight, target_states = batch
    draft = draft_head(dspark.DSparkDraftModel, dflash_config)
    init_parameters(draft, seed)
    lm_head = LmHead(weight)
    embed = torch.nn.Embedding(V, H, dtype=torch.float64).requires_grad_(False)
    model = objective_model(family.OnlineDSparkModel, draft, lm_head, embed,
                            **kwargs)
    states, anchor_t, keep_t = fix_draft_blocks(model, anchors, keep, hidden)
    correction = Captures()
    confidence = Captures()
    if draft.markov_head is not None:
        draft.markov_head.markov_w2.register_forward_pre_hook(
            correction.pre_hook)
    if draft.confidence_head is not None:
        draft.confidence_head.register_forward_hook(confidence.hook)
    chunk_terms = []
    objective = model._dspark_objective_chunk_terms

    def recorded(*args):
        terms = objective(*args)
        chunk_terms.append([t.detach().double().clone() for t in terms])
        return terms

    model._dspark_objective_chunk_terms = recorded
    with float64_casts(f64):
        loss, accuracy, metrics = model(
            input_ids=torch.from_numpy(input_ids),
            hidden_states=torch.zeros(B, S, H, dtype=torch.float64),
            loss_mask=torch.from_numpy(loss_mask).double(),
            target_last_hidden_states=(torch.from_numpy(target_states)
                                       if with_teacher else None),
        )
        loss.backward()
    assert len(chunk_terms) == 1, name  # one chunk, no recomputation
    terms = chunk_terms[0]
    ratios = metrics["ratio_metrics"]

    def same(a, b):
        a = torch.as_tensor(a, dtype=torch.float64)
        b = torch.as_tensor(b, dtype=torch.float64)
        assert torch.allclose(a, b, rtol=1e-14, atol=0), (name, a, b)

    # The chunk terms and forward's ratio metrics must tell one story.
    local_loss_den = ratios["ce_loss"][1]
    same(ratios["acc"][0], terms[4])
    same(ratios["acc"][1], terms[5])
    same(ratios["ce_loss"][0], terms[0])
    same(ratios["l1_loss"][0], terms[1])
    same(ratios["confidence_loss"][0], terms[2])
    same(ratios["confidence_abs_error"][0], terms[3])
    same(ratios["ce_position"][0], terms[6])
    same(ratios["accuracy_position"][0], terms[7])
    same(ratios["ce_position"][1], terms[8])
    if model.loss_type == "dpard":
        same(ratios["dpard_loss"][0], terms[14])
        same(ratios["dpard_credit_position"][0], terms[15])
    if with_teacher:
        same(ratios["teacher_agreement"][0], terms[9])
        same(ratios["teacher_top1_prob"][0], terms[10])
        same(ratios["draft_top1_prob"][0], terms[11])
        same(ratios["tau_probabilistic"][0], terms[12])
        same(ratios["tau_probabilistic"][1], terms[13])
    # The loss from the terms, as _compute_dspark_loss composes it.
    den = float(local_loss_den)
    if model.loss_type == "dpard":
        expected = (float(terms[14]) / B
                    + model.dspark_confidence_head_alpha * float(terms[2]) / den)
    else:
        expected = (model.dspark_ce_loss_alpha * float(terms[0])
                    + model.dspark_l1_loss_alpha * float(terms[1])
                    + model.dspark_confidence_head_alpha * float(terms[2])) / den
    loss = loss.detach()
    tolerance = 1e-13 if f64 else 1e-6
    assert abs(expected - float(loss)) <= tolerance * abs(float(loss)), name

    values = [float(terms[i]) for i in _DSPARK_SCALAR_INDEX] + [
        float(local_loss_den), float(loss), float(accuracy)]
    arrays = common_arrays(batch, lm_head)
    arrays["terms"] = np.array(values)
    arrays["position"] = np.stack(
        [terms[i].numpy() for i in _DSPARK_POSITION_INDEX]).astype(np.float64)
    rank = None
    if draft.markov_head is not None:
        rank = draft.markov_head.markov_rank
        captured = correction.tensors
        # rnn calls markov_w2 once per block slot with [B, N, r].
        z = (captured[0] if len(captured) == 1
             else torch.stack(captured, dim=2))
        grad_z = (captured[0].grad if len(captured) == 1
                  else torch.stack([t.grad for t in captured], dim=2))
        assert z.shape == (B, N, K, rank), (name, z.shape)
        w2 = draft.markov_head.markov_w2.weight
        arrays["correction_inputs"] = z.detach().reshape(R, rank).numpy()
        arrays["correction_weight"] = w2.detach().numpy()
        arrays["grad_correction_inputs"] = grad_z.reshape(R, rank).numpy()
        arrays["grad_correction_weight"] = w2.grad.numpy()
    if with_teacher:
        assert len(lm_head.teacher_inputs) == 1, name
        teacher = lm_head.teacher_inputs[0].reshape(R, H)
        # SpecForge's alignment: target_last_hidden_states[b, max(safe-1, 0)].
        label = (anchor_t.unsqueeze(-1) + torch.arange(1, K + 1)).clamp(
            max=S - 1)
        label = torch.where(keep_t.unsqueeze(-1), label,
                            torch.zeros_like(label))
        check = torch.from_numpy(target_states)[
            torch.arange(B).view(B, 1, 1), (label - 1).clamp(min=0)]
        assert torch.equal(check.reshape(R, H), teacher), name
        arrays["teacher_hidden"] = teacher.numpy()
    else:
        assert not lm_head.teacher_inputs, name
    if draft.confidence_head is not None:
        assert len(confidence.tensors) == 1, name
        c = confidence.tensors[0]
        arrays["confidence_logits"] = c.detach().reshape(R).double().numpy()
        arrays["grad_confidence_logits"] = c.grad.reshape(R).double().numpy()

    gamma = kwargs.get("loss_decay_gamma")
    dspark_text = (
        (f"gamma: {fmt(gamma)} " if gamma is not None else "")
        + f"ce_weight: {fmt(model.dspark_ce_loss_alpha)} "
        f"l1_weight: {fmt(model.dspark_l1_loss_alpha)} "
        f"confidence_weight: {fmt(model.dspark_confidence_head_alpha)} "
        f"objective: {'DPARD' if model.loss_type == 'dpard' else 'DSPARK'} "
        f"dpard_alpha: {fmt(model.dpard_alpha)}")
    config = (
        f"# SpecForge OnlineDSparkModel({kw_text(kwargs)}); "
        f"DSparkDraftModel dflash_config {dflash_config!r}\n"
        + layout_head_text(rank)
        + f"loss {{ dspark {{ {dspark_text} }} }}\n")
    return float(loss), arrays, config


def run_domino(family, domino, batch, name, dflash_config, lambda_base,
               gamma, seed, f64):
    input_ids, loss_mask, anchors, keep, hidden, weight, _ = batch
    draft = draft_head(domino.DominoDraftModel, dict(
        emb_dim=DOMINO_EMB_DIM, gru_hidden_dim=DOMINO_GRU_HIDDEN,
        projector_type="domino", **dflash_config))
    init_parameters(draft, seed)
    rng = np.random.default_rng(seed + 7)
    embed = torch.nn.Embedding(V, H, dtype=torch.float64)
    with torch.no_grad():
        embed.weight.copy_(torch.from_numpy(
            rng.standard_normal((V, H)) * EMBED_SCALE))
    embed.requires_grad_(False)
    lm_head = LmHead(weight)
    kwargs = dict(shift_label=draft.shift_label)
    if gamma is not None:
        kwargs["loss_decay_gamma"] = gamma
    model = objective_model(family.OnlineDominoModel, draft, lm_head, embed,
                            **kwargs)
    assert not model._use_fused_domino_ce, "set SPECFORGE_DOMINO_TRITON_CE=0"
    states, _, _ = fix_draft_blocks(model, anchors, keep, hidden)
    correction = Captures()
    draft.embed_proj[2].register_forward_pre_hook(correction.pre_hook)
    chunk_terms = []
    objective = model._domino_objective_chunk_terms

    def recorded(*args):
        terms = objective(*args)
        chunk_terms.append([float(t.detach()) for t in terms])
        return terms

    model._domino_objective_chunk_terms = recorded
    with float64_casts(f64):
        loss, accuracy, metrics = model(
            input_ids=torch.from_numpy(input_ids),
            hidden_states=torch.zeros(B, S, H, dtype=torch.float64),
            loss_mask=torch.from_numpy(loss_mask).double(),
            lambda_base=lambda_base,
        )
        loss.backward()
    assert len(chunk_terms) == 1, name
    loss = loss.detach()
    terms = chunk_terms[0]
    (final_num, base_num, loss_den, correct_num, base_correct_num,
     accuracy_den, accept_num, base_accept_num, accept_den) = terms

    def close(a, b, rtol=1e-14):
        assert abs(float(a) - float(b)) <= rtol * max(1.0, abs(float(b))), (
            name, float(a), float(b))

    close(metrics["final_loss"], final_num / (loss_den + 1e-6))
    close(metrics["base_loss"], base_num / (loss_den + 1e-6))
    close(metrics["base_accuracy"], base_correct_num / (accuracy_den + 1e-6))
    # The accept-length terms are float32 (SpecForge sums float32 masks).
    close(metrics["accept_len"], accept_num / (accept_den + 1e-6), 1e-6)
    close(metrics["base_accept_len"], base_accept_num / (accept_den + 1e-6),
          1e-6)
    close(accuracy, correct_num / (accuracy_den + 1e-6))
    close(loss, (1.0 - lambda_base) * final_num / (loss_den + 1e-6)
          + lambda_base * base_num / (loss_den + 1e-6))

    arrays = common_arrays(batch, lm_head)
    arrays["terms"] = np.array(terms + [float(loss), float(accuracy)])
    s = draft.suffix_start
    assert len(correction.tensors) == 1, name
    u = correction.tensors[0]
    assert u.shape == (B, N, K - s, DOMINO_EMB_DIM), (name, u.shape)
    full = torch.zeros(B, N, K, DOMINO_EMB_DIM, dtype=torch.float64)
    grad_full = torch.zeros_like(full)
    full[:, :, s:] = u.detach()
    grad_full[:, :, s:] = u.grad
    m = draft.embed_proj[2].weight
    arrays["correction_inputs"] = full.reshape(R, DOMINO_EMB_DIM).numpy()
    arrays["correction_weight"] = m.detach().numpy()
    arrays["grad_correction_inputs"] = grad_full.reshape(
        R, DOMINO_EMB_DIM).numpy()
    arrays["grad_correction_weight"] = m.grad.numpy()

    domino_text = (
        f"shift_label: {'true' if draft.shift_label else 'false'} "
        f"pure_draft_prefix_len: {draft.pure_draft_prefix_len} "
        f"lambda_base: {fmt(lambda_base)}"
        + (f" gamma: {fmt(gamma)}" if gamma is not None else ""))
    config = (
        f"# SpecForge OnlineDominoModel({kw_text(kwargs)}), "
        f"forward(lambda_base={lambda_base!r}); DominoDraftModel "
        f"dflash_config {dict(emb_dim=DOMINO_EMB_DIM, gru_hidden_dim=DOMINO_GRU_HIDDEN, **dflash_config)!r}\n"
        + layout_head_text(DOMINO_EMB_DIM)
        + f"loss {{ domino {{ {domino_text} }} }}\n")
    return float(loss), arrays, config


def kw_text(kwargs):
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())


def layout_head_text(rank):
    return (
        f"layout {{ block_size: {K} num_anchors: {N} }}\n"
        f"head {{ vocab_size: {V} hidden_size: {H} dtype: FLOAT64"
        + (f" correction_rank: {rank}" if rank else "") + " }\n")


def common_arrays(batch, lm_head):
    input_ids, loss_mask, anchors, keep, hidden, weight, _ = batch
    assert len(lm_head.draft_inputs) == 1
    x = lm_head.draft_inputs[0]
    return {
        "input_ids": input_ids,
        "loss_mask": loss_mask,
        "anchors": anchors,
        "keep": keep,
        "hidden": hidden.reshape(R, H),
        "weight": weight,
        "grad_hidden": x.grad.reshape(R, H).numpy(),
    }


def check_gradients(name, arrays):
    """Nonzero gradients on supervised rows; zero on the dropped block."""
    dropped = np.zeros((B, N, K), dtype=bool)
    dropped[~arrays["keep"].astype(bool)] = True
    dropped = dropped.reshape(R)
    for key in ("grad_hidden", "grad_correction_inputs",
                "grad_confidence_logits"):
        if key not in arrays:
            continue
        g = arrays[key].reshape(R, -1)
        assert not np.any(g[dropped]), (name, key, "dropped block")
        assert np.count_nonzero(np.abs(g).sum(-1)) >= 6, (name, key)
    if "grad_correction_weight" in arrays:
        assert np.any(arrays["grad_correction_weight"]), name
    for key, value in arrays.items():
        if value.dtype.kind == "f":
            assert value.dtype == np.float64 and np.all(np.isfinite(value)), (
                name, key)


def write_case(directory, arrays, config):
    os.makedirs(directory, exist_ok=True)
    for old in os.listdir(directory):
        if old.endswith(".npy"):
            os.remove(os.path.join(directory, old))
    for key, array in arrays.items():
        np.save(os.path.join(directory, key + ".npy"), array)
    with open(os.path.join(directory, "config.textproto"), "w") as f:
        f.write(config)


README = """\
# SpecForge {model} goldens

Made by `tools/specforge_dspark_goldens.py` (its docstring lists the files),
which runs SpecForge's own `{model}` from `dflash_family_model.py` at
sgl-project/SpecForge 0124aa926ba1bcf5e99cad94d48a3cc261c95159, in float64,
with {modules}.
Regenerate (torch 2.x, a SpecForge tree with those files):

    python3 tools/specforge_dspark_goldens.py --specforge /path/to/SpecForge --out tests/goldens
"""

README_MODULES = {
    "specforge_dspark": (
        "OnlineDSparkModel",
        "the Markov heads and AcceptRatePredictor of\n"
        "`specforge/modeling/draft/dspark.py` at sgl-project/SpecForge\n"
        "a6b6b0230009d15ec2a97a57384e6f53f0f96946"),
    "specforge_domino": (
        "OnlineDominoModel",
        "the reference path of `specforge/core/domino_loss.py` at\n"
        "sgl-project/SpecForge 58e0701f0d15bcb40fddba110ca950eae9ecec3f and the\n"
        "`compute_correction_logits` version of `specforge/modeling/draft/domino.py`\n"
        "(a code-index copy; its commit is not known)"),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--specforge", required=True,
                        help="a SpecForge tree (see the docstring)")
    parser.add_argument("--out", required=True,
                        help="the goldens directory (tests/goldens)")
    parser.add_argument("--seed", type=int, default=20261203)
    parser.add_argument("--float32-casts", action="store_true",
                        help="let SpecForge's .float() round float64 "
                        "tensors to float32 (as torch does)")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    family, dspark, domino, _ = import_specforge(
        os.path.abspath(args.specforge))
    batch = _DFLASH.make_batch(args.seed)
    # DSpark and shifted Domino label slot k with a + 1 + k, unshifted
    # Domino with a + k.
    batches = {1: planted_batch(batch, 1), 0: planted_batch(batch, 0)}
    f64 = not args.float32_casts
    for index, (name, (kwargs, dflash_config, with_teacher)) in enumerate(
            DSPARK_CASES.items()):
        loss, arrays, config = run_dspark(
            family, dspark, batches[1], name, kwargs, dflash_config, with_teacher,
            args.seed + 100 + index, f64)
        check_gradients(name, arrays)
        assert arrays["terms"][13] == loss
        write_case(os.path.join(args.out, "specforge_dspark", name), arrays,
                   config)
        print(f"dspark/{name}: loss {loss:.15g}")
    for index, (name, (dflash_config, lambda_base, gamma)) in enumerate(
            DOMINO_CASES.items()):
        loss, arrays, config = run_domino(
            family, domino, batches[1 if dflash_config["shift_label"] else 0],
            name, dflash_config, lambda_base, gamma,
            args.seed + 200 + index, f64)
        check_gradients(name, arrays)
        assert arrays["terms"][9] == loss
        write_case(os.path.join(args.out, "specforge_domino", name), arrays,
                   config)
        print(f"domino/{name}: loss {loss:.15g}")
    for directory, (model, modules) in README_MODULES.items():
        with open(os.path.join(args.out, directory, "README.md"), "w") as f:
            f.write(README.format(model=model, modules=modules))


if __name__ == "__main__":
    main()
