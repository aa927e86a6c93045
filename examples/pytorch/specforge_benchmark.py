"""Times one training step of SpecForge's own OnlineDFlashModel,
OnlineDSparkModel or OnlineDominoModel (--model) on the CPU, as SpecForge
ships it and after dflash.specforge.apply(), and reports
seconds, peak memory, the ratio of each to the two GEMMs a step cannot
avoid (measured in the same process), and how far the patched step's loss
and gradients are from the shipped one's.

Each variant runs in a fresh child process (this script with --variant), so
that one variant's allocations (SpecForge's logits, dflash's workspaces and
its laid-out weight) cannot hide or inflate the other's peak. In each child:

- the model: SpecForge 0.2.0's model with a frozen nn.Linear lm_head
  (V x H, float32) and an embedding. DFlash: a small stand-in draft network
  (one linear layer over the noise embedding and the context; SpecForge's
  own loss tests stand the draft in the same way), so that the step's time
  is the objective's. DSpark and Domino: SpecForge's own draft models with
  one Qwen3 layer (DSpark with a vanilla Markov head of rank 32 and a
  confidence head, given the target's last hidden states; Domino with its
  GRU and embed_proj of width 32, lambda_base 0.3), whose logits
  corrections are part of the objective;
- one untimed warm-up step, then the best of --repeats steps (forward and
  backward). Peak memory is the resident set's high-water mark over all the
  steps, warm-up included, above where it stood once the model and batch
  were built: it counts what dflash allocates once (its workspaces, the
  weight's prepared layout) as well as each step's logits;
- the floor: hidden @ W^T and d_logits @ W for the step's rows (torch.mm,
  float32, every thread), the two GEMMs any exact step computes; timed
  after the steps, best of --repeats.

Needs SpecForge 0.2.0 and transformers (pip install transformers;
pip install --no-deps specforge==0.2.0) beside torch 2.x.

    python examples/pytorch/specforge_benchmark.py [--vocab 151936] [--out t.md]
"""

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings

import torch
import torch.nn as nn

MODULE = "specforge.algorithms.common.dflash_family_model"
VARIANTS = ("shipped", "applied")


class StandInDraft(nn.Module):
    """The draft's output states from the noise embedding and the mean of
    the context states: cheap next to the vocabulary projection."""

    sliding_window = None

    def __init__(self, hidden, context):
        super().__init__()
        self.noise = nn.Linear(hidden, hidden)
        self.context = nn.Linear(context, hidden, bias=False)

    def forward(self, position_ids, noise_embedding, target_hidden,
                attention_mask):
        context = self.context(target_hidden.mean(dim=1, keepdim=True))
        return torch.tanh(self.noise(noise_embedding) + context)


def qwen3_draft(model, args):
    """SpecForge's DSpark or Domino draft model: one Qwen3 layer of width
    H with SpecForge's defaults for its logits corrections."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Config
    h, v = args.hidden, args.vocab
    heads = max(2, h // 128)
    config = Qwen3Config(
        hidden_size=h, intermediate_size=2 * h, num_hidden_layers=1,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
        head_dim=h // heads, vocab_size=v,
        max_position_embeddings=args.seq + args.block + 1)
    config.block_size = args.block
    config.num_target_layers = 4
    extra = {"target_layer_ids": [1], "mask_token_id": v - 1}
    if model == "dspark":
        from specforge.modeling.draft.dspark import DSparkDraftModel
        extra.update(enable_confidence_head=True, markov_rank=32,
                     markov_head_type="vanilla")
        draft_class = DSparkDraftModel
    else:
        from specforge.modeling.draft.domino import DominoDraftModel
        extra.update(emb_dim=32, gru_hidden_dim=32, shift_label=False)
        draft_class = DominoDraftModel
    config.dflash_config = extra
    config._attn_implementation = "sdpa"
    return draft_class(config)


def resident(field):
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def build(args):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flash_attn is not installed, ...
        import importlib
        sf = importlib.import_module(MODULE)
    g = torch.Generator().manual_seed(args.seed)
    h, v = args.hidden, args.vocab
    lm_head = nn.Linear(h, v, bias=False)
    embed = nn.Embedding(v, h)
    with torch.no_grad():
        lm_head.weight.copy_(torch.randn(v, h, generator=g) / h**0.5)
        embed.weight.copy_(torch.randn(v, h, generator=g))
    lm_head.requires_grad_(False)
    embed.requires_grad_(False)
    torch.manual_seed(args.seed)
    common = dict(mask_token_id=v - 1, block_size=args.block,
                  attention_backend="sdpa", num_anchors=args.anchors,
                  loss_decay_gamma=args.gamma,
                  objective_chunk_blocks=args.chunk_blocks)
    forward_kwargs = {}
    if args.model == "dflash":
        model = sf.OnlineDFlashModel(StandInDraft(h, h), lm_head, embed,
                                     loss_type=args.loss_type, **common)
    elif args.model == "dspark":
        model = sf.OnlineDSparkModel(qwen3_draft("dspark", args), lm_head,
                                     embed, **common)
        forward_kwargs["target_last_hidden_states"] = torch.randn(
            args.batch, args.seq, h, generator=g)
    else:
        model = sf.OnlineDominoModel(qwen3_draft("domino", args), lm_head,
                                     embed, **common)
        forward_kwargs["lambda_base"] = 0.3
    # Prompts and padding as a chat batch has them: the first eighth of
    # each sequence unsupervised, the rest supervised.
    input_ids = torch.randint(0, v - 1, (args.batch, args.seq), generator=g)
    hidden_states = torch.randn(args.batch, args.seq, h, generator=g)
    loss_mask = torch.ones(args.batch, args.seq)
    loss_mask[:, :args.seq // 8] = 0
    return model, (input_ids, hidden_states, loss_mask, forward_kwargs)


def step(model, inputs):
    input_ids, hidden_states, loss_mask, forward_kwargs = inputs
    hidden_states = hidden_states.detach().requires_grad_()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)  # SpecForge samples its anchors at random.
    loss, accuracy, _ = model(input_ids, hidden_states, loss_mask,
                              **forward_kwargs)
    loss.backward()
    return loss.detach(), accuracy.detach(), hidden_states.grad


def gemm_floor(model, args):
    """Best seconds of the two GEMMs of the step's rows."""
    g = torch.Generator().manual_seed(args.seed + 1)
    rows = args.batch * args.anchors * args.block
    weight = model.lm_head.weight.detach()
    x = torch.randn(rows, args.hidden, generator=g)
    best = float("inf")
    for i in range(args.repeats + 1):
        start = time.perf_counter()
        logits = torch.mm(x, weight.t())
        torch.mm(logits, weight)
        elapsed = time.perf_counter() - start
        del logits
        if i > 0:
            best = min(best, elapsed)
    return best


def run_variant(args):
    """One variant in this process: prints one JSON line."""
    torch.set_num_threads(os.cpu_count())
    model, inputs = build(args)
    if args.variant == "applied":
        import dflash.specforge
        dflash.specforge.apply()
    gc.collect()
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # reset the high-water mark
    base = resident("VmRSS:")
    seconds = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(args.repeats + 1):
            start = time.perf_counter()
            loss, accuracy, grad = step(model, inputs)
            elapsed = time.perf_counter() - start
            if i > 0:
                seconds.append(elapsed)
    # The applied step must have run on the head, not SpecForge's fallback.
    fallbacks = sorted({str(w.message) for w in caught
                        if w.category.__name__ == "SpecForgeFallbackWarning"})
    peak = resident("VmHWM:") - base
    floor = gemm_floor(model, args)
    torch.save(grad, args.grad_out)
    print(json.dumps({"variant": args.variant, "seconds": min(seconds),
                      "peak_bytes": peak, "floor_seconds": floor,
                      "loss": loss.item(), "accuracy": accuracy.item(),
                      "fallbacks": fallbacks}))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--anchors", type=int, default=64)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--chunk_blocks", type=int, default=128,
                        help="SpecForge's objective_chunk_blocks (its "
                        "default, 128)")
    parser.add_argument("--model", default="dflash",
                        choices=["dflash", "dspark", "domino"],
                        help="SpecForge's OnlineDFlashModel, "
                        "OnlineDSparkModel or OnlineDominoModel")
    parser.add_argument("--loss_type", default="dflash",
                        help="OnlineDFlashModel's loss_type")
    parser.add_argument("--gamma", type=float, default=7.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="also write the table here")
    parser.add_argument("--variant", choices=VARIANTS,
                        help="run one variant in this process (internal)")
    parser.add_argument("--grad_out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.variant:
        run_variant(args)
        return None

    results, grads = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for variant in VARIANTS:
            grad_out = os.path.join(tmp, f"{variant}.pt")
            child = [sys.executable, os.path.abspath(__file__),
                     "--variant", variant, "--grad_out", grad_out]
            child += argv if argv is not None else sys.argv[1:]
            done = subprocess.run(child, capture_output=True, text=True,
                                  check=False)
            if done.returncode != 0:
                raise RuntimeError(f"the {variant} step failed "
                                   f"(exit {done.returncode}):\n"
                                   f"{done.stderr[-4000:]}")
            results[variant] = json.loads(done.stdout.strip().splitlines()[-1])
            grads[variant] = torch.load(grad_out)

    rows = args.batch * args.anchors * args.block
    name = {"dflash": f"OnlineDFlashModel ({args.loss_type})",
            "dspark": "OnlineDSparkModel (Markov rank 32, confidence head, "
                      "target states)",
            "domino": "OnlineDominoModel (lambda_base 0.3)"}[args.model]
    lines = [
        f"One SpecForge 0.2.0 {name} step, gamma {args.gamma}, up to "
        f"{rows} rows (B={args.batch}, "
        f"S={args.seq}, {args.anchors} anchors of {args.block}), "
        f"H={args.hidden}, V={args.vocab}, float32 on the CPU, "
        f"objective_chunk_blocks {args.chunk_blocks}; torch "
        f"{torch.__version__}, {os.cpu_count()} CPUs; best of "
        f"{args.repeats} after a warm-up, each variant in its own process.",
        "",
        "| variant | seconds | / GEMM floor | peak MiB | loss |",
        "|---|---|---|---|---|",
    ]
    for variant in VARIANTS:
        r = results[variant]
        lines.append(
            f"| {variant} | {r['seconds']:.3f} | "
            f"{r['seconds'] / r['floor_seconds']:.2f} | "
            f"{r['peak_bytes'] / 2**20:.0f} | {r['loss']:.6f} |")
    shipped, applied = results["shipped"], results["applied"]
    for message in applied["fallbacks"]:
        lines.append(f"\nThe applied step fell back: {message}")
    loss_error = abs(applied["loss"] - shipped["loss"]) / abs(shipped["loss"])
    want = grads["shipped"].double()
    grad_error = ((grads["applied"].double() - want).norm()
                  / want.norm()).item()
    lines += [
        "",
        f"applied / shipped: time {applied['seconds'] / shipped['seconds']:.2f}"
        f", peak memory {applied['peak_bytes'] / shipped['peak_bytes']:.2f}.",
        f"Loss relative difference {loss_error:.1e}; hidden_states gradient "
        f"|g - g_shipped| / |g_shipped| {grad_error:.1e}.",
        f"GEMM floor (hidden @ W^T and d_logits @ W): "
        f"{shipped['floor_seconds']:.3f} s and "
        f"{applied['floor_seconds']:.3f} s in the two processes.",
    ]
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "w") as out:
            out.write(table + "\n")
    return table


if __name__ == "__main__":
    main()
