"""Times one training step of the DFlash objective on one batch, in one
process: dflash_objective (the fused C++ head) against the same objective
in torch three ways, and reports seconds, peak memory and how far each
one's loss and hidden-state gradient are from a float64 reference.

- dflash fused: dflash_objective, fused mode (gradients computed chunk by
  chunk in forward, never recomputed).
- torch, materialised logits: hidden @ W^T for every row at once, then
  cross-entropy, weights, sums (SpecForge's chunk terms with one chunk).
- torch, chunked_reduce + checkpoint: SpecForge's chunk terms over chunks of
  blocks, each chunk recomputed in backward (checkpointed_chunk_reduce).
- torch, F.linear_cross_entropy: torch's chunked path (torch >= 2.15) over
  the same chunks, reduction='none' then the weights (torch has no per-row
  weights; its 'sum'/'mean' paths, which compute gradients in forward,
  would need one call per block position: 64-row calls, 6x slower here),
  recomputed in backward.

With --eval, also an evaluation call of dflash_objective (under
torch.no_grad(): the head's forward pass alone, no gradient GEMM or buffer)
and its time over the training step's.

Peak memory is the step's resident-set high-water mark above where it
started (CPU) or torch's peak allocated bytes (CUDA), plus the dflash head's
own peak (its workspaces, kept between steps). The objective is DFlash's:
gamma 7, the anchor position and ~10% of the others unsupervised.

    python3 examples/pytorch/benchmark.py [--vocab 151936] [--out table.md]
"""

import argparse
import ctypes
import gc
import os
import time

import torch
import torch.nn.functional as F

import dflash
from dflash.torch import chunked_reduce, dflash_objective

GAMMA = 7.0


def decay_weights(weight_mask):
    k = torch.arange(weight_mask.shape[-1], device=weight_mask.device)
    decay = torch.exp(-(k - 1).clamp(min=0).double() / GAMMA)
    return weight_mask * decay.to(weight_mask.dtype)


def chunk_terms(lm_head_weight):
    """SpecForge's _dflash_objective_chunk_terms for the dflash loss."""

    def terms(hidden, target_ids, weight_mask):
        b, n, k, h = hidden.shape
        logits = F.linear(hidden.reshape(b, n * k, h), lm_head_weight)
        logits = logits.reshape(b, n, k, -1)
        neg_log_q = F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                    target_ids.reshape(-1),
                                    reduction="none").reshape_as(target_ids)
        weights = decay_weights(weight_mask)
        loss_num = (neg_log_q * weights).sum()
        loss_den = weights.sum()
        with torch.no_grad():
            correct = ((logits.argmax(-1) == target_ids)
                       & (weight_mask > 0.5)).sum().float()
        return loss_num, loss_den, correct, weight_mask.sum()

    return terms


def dflash_fused(hidden, weight, target_ids, weight_mask, chunk_blocks):
    terms = dflash_objective(hidden, weight, target_ids, weight_mask,
                             loss_type="dflash", gamma=GAMMA, mode="fused",
                             chunk_blocks=chunk_blocks)
    return (terms.loss_num / terms.loss_den,
            terms.diagnostics.stats["peak_bytes"])


def torch_materialised(hidden, weight, target_ids, weight_mask, chunk_blocks):
    num, den, _, _ = chunk_terms(weight)(hidden, target_ids, weight_mask)
    return num / den, 0


def torch_chunked_checkpoint(hidden, weight, target_ids, weight_mask,
                             chunk_blocks):
    num, den, _, _ = chunked_reduce(chunk_terms(weight), hidden, target_ids,
                                    weight_mask, chunk_size=chunk_blocks, dim=1)
    return num / den, 0


def torch_linear_cross_entropy(hidden, weight, target_ids, weight_mask,
                               chunk_blocks):
    rows_per_chunk = chunk_blocks * hidden.shape[2]
    options = torch.nn.LinearCrossEntropyOptions(
        batch_chunk_size=rows_per_chunk)
    neg_log_q = F.linear_cross_entropy(
        hidden.reshape(-1, hidden.shape[-1]), weight, target_ids.reshape(-1),
        reduction="none", options=options)
    weights = decay_weights(weight_mask)
    return (neg_log_q * weights.reshape(-1)).sum() / weights.sum(), 0


VARIANTS = [
    ("dflash fused (dflash_objective)", dflash_fused),
    ("torch, materialised logits", torch_materialised),
    ("torch, chunked_reduce + checkpoint (SpecForge)",
     torch_chunked_checkpoint),
    ("torch, F.linear_cross_entropy (chunked)", torch_linear_cross_entropy),
]


class PeakMemory:
    """Peak bytes of one step above its start: the resident set's
    high-water mark on the CPU (reset through /proc/self/clear_refs), torch's
    allocator on CUDA; plus the dflash head's own peak, whose workspaces its
    allocator keeps between steps (as torch's caching allocator does), so
    that a warm step's resident set does not show them."""

    def __init__(self, device):
        self.device = device
        if device.type == "cpu":
            # Fixed mmap threshold: large buffers go back to the system when
            # freed, so one variant's leftovers do not hide the next's peak.
            libc = ctypes.CDLL("libc.so.6")
            libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD

    @staticmethod
    def _status(field):
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
        raise RuntimeError(f"no {field} in /proc/self/status")

    def start(self):
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            with open("/proc/self/clear_refs", "w") as clear:
                clear.write("5")
            self.base = self._status("VmRSS:")

    def stop(self, dflash_bytes):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return (torch.cuda.max_memory_allocated(self.device) - self.base
                    + dflash_bytes)
        return self._status("VmHWM:") - self.base + dflash_bytes


def make_batch(args, device, dtype):
    g = torch.Generator().manual_seed(args.seed)
    b, n, k = args.batch, args.anchors, args.block
    h, v = args.hidden, args.vocab
    weight = torch.randn(v, h, generator=g) / h**0.5
    target_ids = torch.randint(0, v, (b, n, k), generator=g)
    # Draft states leaning towards their targets less and less along the
    # block, as a trained draft's do: the target's logit is lifted by about
    # 6 - 0.25 k over logits of order 1.
    lift = (6 - 0.25 * torch.arange(k)).view(1, 1, k, 1)
    hidden = torch.randn(b, n, k, h, generator=g) + lift * weight[target_ids]
    weight_mask = (torch.rand(b, n, k, generator=g) > 0.1).float()
    weight_mask[..., 0] = 0
    to = lambda t: t.to(device)
    mask_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    return (to(hidden.to(dtype)), to(weight.to(dtype)), to(target_ids),
            to(weight_mask.to(mask_dtype)))


def reference(hidden, weight, target_ids, weight_mask):
    """The objective's loss and hidden gradient in float64."""
    hidden = hidden.detach().double().requires_grad_()
    num, den, _, _ = chunk_terms(weight.double())(hidden, target_ids,
                                                  weight_mask.double())
    loss = num / den
    loss.backward()
    return loss.item(), hidden.grad


def timed(step, args, peak):
    """step() args.repeats + 1 times, the first an untimed warm-up: the best
    seconds and the largest peak bytes, and the last step's result. step
    returns (loss, bytes it owns, result)."""
    seconds, peaks = [], []
    for i in range(args.repeats + 1):
        peak.start()
        start = time.perf_counter()
        loss, own, result = step()
        if loss.is_cuda:
            torch.cuda.synchronize(loss.device)
        elapsed = time.perf_counter() - start
        if i > 0:
            seconds.append(elapsed)
            peaks.append(peak.stop(own))
    return min(seconds), max(peaks), result


def measure(run, batch, args, peak):
    hidden, weight, target_ids, weight_mask = batch

    def step():
        x = hidden.detach().requires_grad_()
        loss, own = run(x, weight, target_ids, weight_mask, args.chunk_blocks)
        loss.backward()
        return loss, own, x.grad

    seconds, peak_bytes, grad = timed(step, args, peak)
    return seconds, peak_bytes, loss_value(run, batch, args), grad


def measure_eval(batch, args, peak):
    """dflash_fused under torch.no_grad(): best seconds, peak bytes, loss."""

    def step():
        with torch.no_grad():
            loss, own = dflash_fused(*batch, args.chunk_blocks)
        return loss, own, loss

    seconds, peak_bytes, loss = timed(step, args, peak)
    return seconds, peak_bytes, loss.item()


def loss_value(run, batch, args):
    with torch.no_grad():
        loss, _ = run(*batch, args.chunk_blocks)
    return loss.item()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--anchors", type=int, default=64)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--chunk_blocks", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32",
                        choices=["float32", "float64", "bfloat16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="also write the table here")
    parser.add_argument("--eval", action="store_true",
                        help="also time dflash_objective's evaluation call "
                        "(torch.no_grad(), forward only) and its ratio to "
                        "the training step")
    args = parser.parse_args(argv)

    # Debian's torch starts with one thread: give every variant every core,
    # as the dflash head takes them.
    torch.set_num_threads(os.cpu_count())
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    batch = make_batch(args, device, dtype)
    want_loss, want_grad = reference(*batch)
    peak = PeakMemory(device)
    rows = args.batch * args.anchors * args.block
    lines = [
        f"One step, {rows} rows (B={args.batch}, N={args.anchors}, "
        f"K={args.block}), H={args.hidden}, V={args.vocab}, {args.dtype} on "
        f"{args.device}, chunks of {args.chunk_blocks} blocks; torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads, dflash "
        f"{dflash.__version__}; best of {args.repeats} after a warm-up.",
        "",
        "| variant | seconds | peak MiB | loss - reference "
        "| hidden gradient error |",
        "|---|---|---|---|---|",
    ]
    for name, run in VARIANTS:
        if run is torch_linear_cross_entropy and not hasattr(
                F, "linear_cross_entropy"):
            lines.append(f"| {name} | - | - | - | (torch {torch.__version__} "
                         "has no F.linear_cross_entropy) |")
            continue
        seconds, peak_bytes, loss, grad = measure(run, batch, args, peak)
        error = ((grad.double() - want_grad).norm() / want_grad.norm()).item()
        lines.append(f"| {name} | {seconds:.3f} | {peak_bytes / 2**20:.0f} | "
                     f"{loss - want_loss:+.1e} | {error:.1e} |")
        print(lines[-1], flush=True)
        if run is dflash_fused:
            train_seconds = seconds
            if args.eval:
                seconds, peak_bytes, loss = measure_eval(batch, args, peak)
                lines.append(
                    f"| dflash fused, evaluation (torch.no_grad()) | "
                    f"{seconds:.3f} | {peak_bytes / 2**20:.0f} | "
                    f"{loss - want_loss:+.1e} | (no gradient) |")
                print(lines[-1], flush=True)
                ratio = seconds / train_seconds
    if args.eval:
        lines.append("")
        lines.append(f"dflash evaluation / training step: {ratio:.2f}")
    lines.append("")
    lines.append(
        "Hidden gradient error: |g - g_ref| / |g_ref| against float64.")
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "w") as out:
            out.write(table + "\n")
    return table


if __name__ == "__main__":
    main()
