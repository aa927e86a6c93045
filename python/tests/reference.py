"""An independent float64 reference of the DFlash-family objective, written
naively in torch from the loss definitions (SpecForge's chunk terms and
dflash's documented families), for the parity tests. It shares no code with
dflash: logits are materialised, every term is spelled out, and autograd
differentiates it (weights documented as "without gradient" are detached).
"""

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F


@dataclass
class Family:
    """One loss as a config text and the parameters the reference needs."""

    name: str
    loss_text: str  # The body of `loss { ... }`.
    kind: str  # dflash, dpace, tv, lk, dspark, distillation.
    gamma: Optional[float] = None
    alpha: float = 0.5
    variant: str = "dpace"
    kl_scale: float = 1.0
    kl_decay: float = 1.0
    ce_weight: float = 0.1  # dspark: DSparkLoss.ce_weight's default.
    l1_weight: float = 1.0
    confidence_weight: float = 1.0
    divergence: str = "kl"
    beta: float = 0.5
    temperature: float = 1.0
    ignore_index: int = -100
    label_smoothing: float = 0.0
    z_loss_scale: float = 0.0
    head_text: str = ""  # Extra HeadConfig fields.
    logit_scale: float = 1.0
    logit_softcap: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def teacher(self):
        return self.kind in ("dspark", "distillation")

    @property
    def confidence(self):
        return self.kind == "dspark" and self.confidence_weight > 0

    def config_text(self, mode, chunk_blocks, segment_chunks):
        preset = ("preset: SELECTIVE_FROZEN_PROJECTION"
                  if mode == "SELECTIVE" else "")
        return (f"chunking {{ blocks_per_chunk: {chunk_blocks} }} "
                f"checkpoint {{ {preset} segment_chunks: {segment_chunks} }} "
                f"head {{ mode: {mode} {self.head_text} }} "
                f"loss {{ {self.loss_text} }}")


FAMILIES = [
    Family("dflash", "dflash { gamma: 7 }", "dflash", gamma=7),
    Family("dflash-no-decay", "dflash { }", "dflash"),
    Family("dpace", "dpace { alpha: 0.3 variant: DPACE }", "dpace", alpha=0.3),
    Family("dpace-cumulative-confidence-only",
           "dpace { variant: CUMULATIVE_CONFIDENCE_ONLY }", "dpace",
           variant="prefix"),
    Family("dpace-continuation-value-only",
           "dpace { alpha: 0.7 variant: CONTINUATION_VALUE_ONLY }", "dpace",
           alpha=0.7, variant="value"),
    Family("tv", "tv { gamma: 5 }", "tv", gamma=5),
    Family("lk-lambda", "lk_lambda { gamma: 7 kl_scale: 0.8 kl_decay: 2 }",
           "lk", gamma=7, kl_scale=0.8, kl_decay=2),
    Family("dspark",
           "dspark { gamma: 4 l1_weight: 0.9 confidence_weight: 0.5 }",
           "dspark", gamma=4, l1_weight=0.9, confidence_weight=0.5),
    Family("kl", "distillation { divergence: FORWARD_KL gamma: 7 }",
           "distillation", gamma=7, divergence="kl"),
    Family("reverse-kl",
           "distillation { divergence: REVERSE_KL temperature: 2 }",
           "distillation", divergence="reverse-kl", temperature=2),
    Family("jsd", "distillation { divergence: JSD beta: 0.3 temperature: 0.5 }",
           "distillation", divergence="jsd", beta=0.3, temperature=0.5),
    Family("dflash-ce-options",
           "dflash { gamma: 7 } cross_entropy { ignore_index: 3 "
           "label_smoothing: 0.1 z_loss_scale: 0.001 }",
           "dflash", gamma=7, ignore_index=3, label_smoothing=0.1,
           z_loss_scale=0.001),
    Family("dflash-softcap", "dflash { gamma: 7 }", "dflash", gamma=7,
           head_text="logit_scale: 0.8 logit_softcap: 4", logit_scale=0.8,
           logit_softcap=4.0),
]


def decay(gamma, k, offset):
    """exp(-max(k - offset, 0) / gamma), 1 without gamma."""
    if not gamma:
        return torch.ones_like(k, dtype=torch.float64)
    return torch.exp(-(k - offset).clamp(min=0).to(torch.float64) / gamma)


def transform(z, f):
    if f.logit_softcap > 0:
        return f.logit_softcap * torch.tanh(f.logit_scale * z / f.logit_softcap)
    return f.logit_scale * z


def dpace_weights(q, m, f):
    """Block weights along the last dimension (k), without gradient."""
    smooth = torch.where(m > 0, (1 - f.alpha) * q + f.alpha, torch.ones_like(q))
    prefix = torch.cumprod(smooth, dim=-1)
    suffix = torch.flip(torch.cumsum(torch.flip(prefix * m, [-1]), -1), [-1])
    if f.variant == "prefix":
        weights = prefix
    elif f.variant == "value":
        weights = suffix / prefix.clamp(min=torch.finfo(torch.float64).tiny)
    else:
        weights = suffix
    return weights * m


def divergence(z, t, f):
    """Per row D(teacher, draft) at temperature T, over the last dimension."""
    ls = F.log_softmax(z / f.temperature, dim=-1)
    lt = F.log_softmax(t / f.temperature, dim=-1)
    if f.divergence == "kl":
        return (lt.exp() * (lt - ls)).sum(-1)
    if f.divergence == "reverse-kl":
        return (ls.exp() * (ls - lt)).sum(-1)
    lm = torch.logsumexp(torch.stack([math.log(f.beta) + lt,
                                      math.log(1 - f.beta) + ls]), dim=0)
    return (f.beta * (lt.exp() * (lt - lm)).sum(-1)
            + (1 - f.beta) * (ls.exp() * (ls - lm)).sum(-1))


def objective(f, hidden, weight, target_ids, weight_mask, bias=None,
              teacher=None, confidence=None):
    """(loss_num, loss_den, correct, accuracy_den, position_correct,
    position_den, target_probability_num) in float64, differentiable where
    dflash's are."""
    hidden, weight = hidden.double(), weight.double()
    mask = weight_mask.double() * (target_ids != f.ignore_index)
    target = torch.where(mask > 0, target_ids, torch.zeros_like(target_ids))
    z = hidden @ weight.T
    if bias is not None:
        z = z + bias.double()
    z = transform(z, f)
    lse = torch.logsumexp(z, dim=-1)
    nll = lse - z.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    q = torch.exp(-nll)
    k = torch.arange(hidden.shape[2])

    w = mask * decay(f.gamma, k, 1)
    ce_w, tv_w = w, torch.zeros_like(w)
    if f.kind == "dpace":
        w = dpace_weights(q.detach(), mask, f)
        ce_w = w
    elif f.kind == "tv":
        ce_w, tv_w = torch.zeros_like(w), w
    elif f.kind == "lk":
        mass = mask.sum(-1, keepdim=True)
        acc = torch.where(mass > 0, (q.detach() * mask).sum(-1, keepdim=True)
                          / mass.clamp(min=1e-300), torch.zeros_like(mass))
        kl_w = f.kl_scale * torch.exp(-f.kl_decay * acc)
        ce_w, tv_w = w * kl_w, w * (1 - kl_w)
    elif f.kind == "dspark":
        w = mask * decay(f.gamma, k, 0)
        ce_w = w * f.ce_weight

    if f.kind == "distillation":
        t = transform(teacher.double() @ weight.T.detach() + (
            0 if bias is None else bias.double().detach()), f)
        num = (w * divergence(z, t, f)).sum()
    else:
        eps = f.label_smoothing if f.kind != "tv" else 0.0
        ce = (1 - eps) * nll + eps * (lse - z.mean(-1))
        num = (ce_w * ce + tv_w * (1 - q) + w * f.z_loss_scale * lse**2).sum()
        if f.kind == "dspark":
            t = transform(teacher.double() @ weight.T.detach() + (
                0 if bias is None else bias.double().detach()), f)
            l1 = (F.softmax(z, -1) - F.softmax(t, -1)).abs().sum(-1)
            num = num + (w * f.l1_weight * l1).sum()
            if f.confidence_weight > 0:
                accept = (1 - 0.5 * l1).clamp(0, 1).detach()
                bce = F.binary_cross_entropy_with_logits(
                    confidence.double(), accept, reduction="none")
                num = num + (w * f.confidence_weight * bce).sum()
    den = w.detach().sum()

    hit = ((z.detach().argmax(-1) == target) & (mask > 0.5)).double()
    return (num, den, hit.sum(), mask.sum(), hit.sum(dim=(0, 1)),
            mask.sum(dim=(0, 1)), (q.detach() * mask).sum())


def batch(seed, B=2, N=3, K=4, H=8, V=13, dtype=torch.float64):
    """A small DFlash batch: states, head, targets, a mask with k = 0 and a
    dropped block unweighted, teacher states and confidence logits."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, N, K, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) / math.sqrt(H)
    bias = 0.1 * torch.randn(V, generator=g, dtype=torch.float64)
    target = torch.randint(0, V, (B, N, K), generator=g)
    # Pull some states towards their target so that accuracy is not 0.
    hidden = hidden + 2 * weight[target] * (torch.rand(B, N, K, 1, generator=g) > 0.5)
    # Mostly 0/1 as SpecForge's masks are, some fractional.
    mask = (torch.rand(B, N, K, generator=g) > 0.2).double()
    mask[torch.rand(B, N, K, generator=g) > 0.8] *= 0.7
    mask[..., 0] = 0
    mask[B - 1, N - 1] = 0
    teacher = hidden + 0.3 * torch.randn(B, N, K, H, generator=g, dtype=torch.float64)
    confidence = torch.randn(B, N, K, generator=g, dtype=torch.float64)
    as_dtype = lambda t: t.to(dtype)
    return {
        "hidden": as_dtype(hidden), "weight": as_dtype(weight),
        "bias": as_dtype(bias), "target_ids": target,
        "weight_mask": mask.to(torch.float32), "teacher": as_dtype(teacher),
        "confidence": confidence.to(torch.float32),
    }
