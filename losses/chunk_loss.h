#ifndef DFLASH_LOSSES_CHUNK_LOSS_H_
#define DFLASH_LOSSES_CHUNK_LOSS_H_

// CpuChunkLoss: the additive loss terms (ChunkTerms), the logits gradient
// and optional per-row outputs of one chunk of logits, on the CPU, for every
// loss family (dflash, dpace, tv, lk_lambda, dspark, distillation, with the
// cross_entropy options); sum the terms over chunks, then divide. Created
// once from resolved LossParams and run per chunk, as CudaChunkLoss is.
// ChunkLoss runs one chunk straight from a v1::LossConfig. Also the input
// checks shared with the CUDA loss (ValidateChunkLoss*).

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "base/bfloat16.h"
#include "losses/accepted_length.h"
#include "losses/loss_params.h"
#include "losses/row_meta.h"
#include "proto/loss.pb.h"

namespace dflash {

// Additive terms of one chunk; sum them over chunks, then divide. The
// fields and what each sums: losses/chunk_terms.inc.
struct ChunkTerms {
#define DFLASH_SUMMED_TERM(field, slot, dict, key) double field = 0;
#define DFLASH_POSITION_TERM(field, slot, dict, key) std::vector<double> field;
#include "losses/chunk_terms.inc"
  // Over whole blocks, so not from a chunk: a head sets them after its last
  // chunk (losses/accepted_length.h).
  AcceptedLengthTerms accepted_length;

  // Zero terms for blocks of `block_size` positions.
  static ChunkTerms Zero(int64_t block_size);
  // Adds `other` (same K) term by term.
  void Add(const ChunkTerms& other);
};

// The type of DSpark's confidence logits and of their gradient beside
// logits of type T: double for double (the exact path: SpecForge's float64
// run is matched to rounding), float for float and BFloat16 (the
// confidence head's output in float, as SpecForge's `.float()` reads it).
template <typename T>
struct ConfidenceOfT {
  using type = float;
};
template <>
struct ConfidenceOfT<double> {
  using type = double;
};
template <typename T>
using ConfidenceOf = typename ConfidenceOfT<T>::type;

// One chunk: `rows.size()` rows of `vocab` logits. T is float, double (the
// exact reference path) or BFloat16 (computed in float, gradient rounded to
// bfloat16 once).
template <typename T>
struct ChunkLossInputs {
  // [rows x row stride]; overwritten with d(loss_num)/d(logits).
  absl::Span<T> logits;
  // [rows x row stride], no gradient: the frozen teacher projection, for
  // dspark and distillation; with another loss, for the teacher
  // diagnostics.
  absl::Span<const T> teacher_logits;
  // [rows], dspark's confidence head output, when confidence_weight > 0.
  absl::Span<const ConfidenceOf<T>> confidence_logits;
  absl::Span<const RowMeta> rows;
  int64_t vocab = 0;
  // [rows x row stride] for a loss that reads the head's correction apart
  // (domino): its logits, overwritten with d(loss_num)/d(correction). The
  // loss's logits are then base + correction at positions >= suffix_start.
  absl::Span<T> correction_logits;
  // Values from one row's start to the next in the three logit tensors: 0
  // for vocab, or more for padded rows (the CUDA head pads them to 16 bytes
  // for vector loads); the padding is neither read as logits nor changed.
  int64_t row_stride = 0;
  // True where the caller has already checked every row's block position,
  // mask and target id as ValidateChunkLossInputs would (a head does, once
  // per run, for all its rows): the per-chunk checks then skip them and
  // check only what the chunk itself decides (sizes, the rows' order).
  bool rows_checked = false;

  int64_t stride() const { return row_stride > 0 ? row_stride : vocab; }
};

// Optional per-row results; leave a span empty to skip it. Rows without
// weight get neg_log_q 0, argmax -1 and top-k -1. The per-row values are
// double whatever T: the loss computes them in double, and a float64 run's
// consumers (D-PACE's weights in a selector's loss) need them unrounded.
struct ChunkLossOutputs {
  // [rows], d(loss_num)/d(confidence) for dspark's confidence term.
  absl::Span<double> confidence_grad;
  absl::Span<double> neg_log_q;       // [rows], of the loss's logits z'.
  absl::Span<int32_t> argmax;         // [rows]
  absl::Span<int32_t> top_k;          // [rows x k], largest first.
  int32_t k = 0;
  // [rows], q = exp(-neg_log_q) in double, 0 where the row has no mask.
  // Required by the batch-level LK lambda, whose gradients FinishTerms'
  // LkDeferredFactor(kl_w, q) scales.
  absl::Span<double> target_probability;
  // [rows], with options.metric_top_k: the target's place among the
  // metric_top_k largest z' (0 for the largest), -1 where it is not among
  // them or the row has no mask.
  absl::Span<int32_t> target_rank;
  // [rows x k], with top_k: z' at those ids (DFlash2's unary logits), 0
  // where the row has no mask.
  absl::Span<float> top_k_values;
  // [rows], the row's loss weight w (D-PACE's block weight), 0 where none.
  absl::Span<double> loss_weight;
  // [rows], with the teacher diagnostics: clamp(1 - |p - t|_1 / 2, 0, 1),
  // 0 where the row has no mask.
  absl::Span<double> teacher_acceptance;
  // [rows], domino: the base logits' argmax (-1 where the row has no mask).
  absl::Span<int32_t> base_argmax;
  // [rows], with teacher logits: the argmax of the teacher's logits
  // (transformed as the draft's; TeacherAgrees compares it with argmax),
  // global with a vocab shard; -1 where the row has no mask or there are
  // no teacher logits.
  absl::Span<int32_t> teacher_argmax;
};

// The loss terms of one chunk for any loss family (docs/semantics.md
// sections 3 to 6), with the cross-entropy options:
// - dflash: CE weighted by the row weight (RowLossWeight, loss_math.h).
// - dpace and its variants: block-level weights from q without gradient.
// - tv: (1 - q), weighted as dflash.
// - the LK composition of dflash and dpace (SpecForge's lk_loss_type): tv
//   as the tv family; lambda kl_w * CE + (1 - kl_w) * tv with kl_w from the
//   whole batch's acc = sum(q m) / max(sum(m), 1), so loss_num is composed
//   by FinishTerms after the last chunk.
// - lk_lambda: the same mix with acc taken per anchor block (without
//   gradient), so that a block's loss does not depend on the others.
// For dpace and lk_lambda, each block's rows must be together in position
// order, and a chunk must hold every weighted row of its blocks (rows
// without weight may be left out).
// - dspark: decay m * exp(-k / gamma) from k = 0; CE + l1_weight * L1 +
//   confidence_weight * BCE-with-logits(confidence, accept), L1 = sum|p - t|
//   of draft and teacher softmax, accept = clamp(1 - L1 / 2, 0, 1) without
//   gradient.
//   ce_weight scales CE. With objective DPARD: credit * R + confidence
//   term, R = -2 log sum sqrt(p t) (Renyi order 1/2), credit D-PACE's
//   weights (alpha = dpard_alpha) over accept, without gradient.
// - domino: (1 - lambda_base) * CE(final) + lambda_base * CE(base), final =
//   base + correction at block positions >= suffix_start.
// - distillation: D(p_teacher, p_draft) at temperature T, weighted as
//   dflash; forward KL(t || s), reverse KL(s || t), or the generalised
//   JSD beta * KL(t || M) + (1 - beta) * KL(s || M), M = beta * t +
//   (1 - beta) * s. Not multiplied by T^2.
// - cross_entropy: a row whose target is ignore_index carries nothing,
//   or, with ignored_target_weight COUNT (SpecForge's), keeps its mask
//   with -log q = 0 and q = 1, no loss and no gradient of its own (DSpark's
//   L1 and confidence terms stay); label smoothing eps turns CE into
//   (1 - eps) * CE + eps * (lse - mean(z')); z_loss_scale adds
//   w * z_loss_scale * lse^2.
// loss_den is sum(w) (for dpace the effective weight; with the
// SEQUENCE_BALANCED denominator w carries RowMeta::sequence_share, and the
// batch's loss_den is WeightedSequences). Accumulation in
// double. A row whose weight is 0 gets a zero gradient and no other work.
// Uses O(vocab) scratch for BFloat16, softcaps and teacher rows.
//
// Vocab-parallel (options.vocab_shard set): each process of the shard's
// group holds classes [offset, offset + inputs.vocab) of the whole
// vocabulary shard->vocab (the logits' width, teacher's alike) and calls Run
// on the same chunk (the same rows, k and outputs) at the same time; Run
// exchanges per-row records through shard->exchange (a few AllGathers per
// chunk, the same calls on every process) and merges them in rank order.
// Then: target ids are checked against the whole vocabulary; argmax, top-k
// ids (ties to the lower global id) and every id output are global; the
// terms and every per-row output equal the single-process run's (up to
// rounding: the row sums are added shard by shard) and are bitwise equal on
// every process; the logits are overwritten with this range's part of
// d(loss_num)/d(logits). The ranges must tile [0, vocab) in rank order, one
// class at least each, with agreeing vocab and chunk shapes: else an
// InvalidArgument on every process. An error on one process (a non-finite
// logit, ...) is an error on every process (the others' names the process
// and, where it has one, the row), never a hang. Domino's correction
// logits are the same range's (its final and base logits' stats travel in
// one record).
template <typename T>
class CpuChunkLoss {
 public:
  // `params` as ResolveLoss (loss_family.h) makes them; the options are
  // checked here.
  static absl::StatusOr<CpuChunkLoss> Create(const LossParams& params,
                                             const ChunkLossOptions& options);

  // One chunk's terms; the logits are overwritten with d(loss_num)/d(logits).
  // Const and thread-safe: threads may run parts of a chunk at once (at
  // block boundaries) and add their terms in a fixed order. Unlike the CUDA
  // loss, the terms come back per chunk: the host has them at once.
  absl::StatusOr<ChunkTerms> Run(const ChunkLossInputs<T>& inputs,
                                 const ChunkLossOutputs& outputs = {}) const;

  const LossParams& params() const { return params_; }
  const ChunkLossOptions& options() const { return options_; }

 private:
  CpuChunkLoss(const LossParams& params, const ChunkLossOptions& options)
      : params_(params), options_(options) {}

  LossParams params_;
  ChunkLossOptions options_;
};

// The loss of a batch and the factors its gradients take, from the terms
// summed over every chunk (FinishTerms).
struct FinishedLoss {
  double loss = 0;
  // loss = loss_num / denominator once finished.
  double denominator = 1;
  double accuracy = 0;
  // d(loss)/d(loss_num) for every gradient the logits carry (hidden,
  // weight, bias, correction), and for the confidence logits'.
  double gradient_scale = 0;
  double confidence_scale = 0;
  // The batch-level LK lambda's CE weight kl_w (BatchLkKlWeight); each
  // row's gradient, written as w (p - onehot), is then to be multiplied by
  // LkDeferredFactor(kl_w, q) (loss_math.h). Unset for other compositions.
  std::optional<double> lk_kl_weight;
};

// After the reduction over every chunk of a batch (SpecForge's forward
// call): composes loss_num where it needs the whole batch (the LK lambda's
// kl_w * ce_num + (1 - kl_w) * tv_num; D-PARD's), and divides as the family
// does: by FlooredLossDen(loss_den) for most; by loss_den + 1e-6 for domino
// (accuracy too); D-PARD's part by `sequences`, its confidence part by
// loss_den. Afterwards loss_num / loss_den is the loss wherever
// loss_den > 0.
FinishedLoss FinishTerms(const LossParams& params, ChunkTerms& terms,
                         int64_t sequences);

// The gradient_scale FinishTerms will give, known before any logit where
// the rows alone decide it (so a head can fold it into its input-gradient
// GEMM and round a BF16 gradient once; D-PACE's SEQUENCE_BALANCED
// WeightedSequences); nullopt where the logits decide it (D-PACE's block
// weights, the batch-level LK lambda's row factors).
std::optional<double> RowsGradientScale(const LossParams& params,
                                        absl::Span<const RowMeta> rows,
                                        int64_t sequences);

// D-PACE's SEQUENCE_BALANCED denominator (SpecForge main's): sets each
// row's sequence_share to 1 / A, A the anchor blocks of `block_size` rows
// with an effective mask > 0 among its sequence's `sequence_rows` rows (at
// least 1). Rows are whole sequences, in order.
void SetSequenceShares(const LossParams& params, int64_t block_size,
                       int64_t sequence_rows, absl::Span<RowMeta> rows);

// The sum over anchor blocks (runs of one block id) with an effective mask
// > 0 of their sequence_share: with the shares SetSequenceShares sets, the
// number of sequences with weight, the SEQUENCE_BALANCED loss_den. The
// chunks' loss_den is their sum of w, for loss_weight_per_position; a
// head replaces the batch's total by this before FinishTerms.
double WeightedSequences(const LossParams& params,
                         absl::Span<const RowMeta> rows);

// ResolveLoss (loss_family.h) with its errors prefixed "chunk loss: ".
absl::StatusOr<LossParams> ResolveChunkLoss(const v1::LossConfig& config);

// One chunk from a loss config: ResolveChunkLoss, CpuChunkLoss::Create, Run. For
// tests and tools; a head creates its loss once.
template <typename T>
absl::StatusOr<ChunkTerms> ChunkLoss(const v1::LossConfig& config,
                                     const ChunkLossOptions& options,
                                     const ChunkLossInputs<T>& inputs,
                                     const ChunkLossOutputs& outputs = {});

// The options' checks: block_size >= 1, logit_scale finite and > 0,
// logit_softcap finite and >= 0; a vocab_shard's fields (its offset >= 0,
// vocab in [1, 2^31), an exchange).
absl::Status ValidateChunkLossOptions(const ChunkLossOptions& options);

// Before each vocab-parallel chunk (options.vocab_shard set), on every
// process: one gather of `valid` (this process's checks of its inputs) and
// of the chunk's shape: the ranges [offset, offset + width) must tile the
// vocabulary, and rows, k (0: no top-k), options.metric_top_k and whether
// teacher logits are given must agree. Returns the group's first error,
// the same on every process, or OK. The CPU and CUDA losses both call it.
absl::Status ChunkShardHandshake(const ChunkLossOptions& options,
                                 const absl::Status& valid, int64_t width,
                                 int64_t rows, int32_t k, bool teacher);

// The checks CpuChunkLoss::Run makes before any work: span sizes, block
// positions and masks (unless inputs.rows_checked), and, for block-coupled
// families, row order. The options
// are checked once, by Create (ValidateChunkLossOptions). Only sizes
// and `rows` are read, so a backend whose spans are device memory (the CUDA
// loss) runs the same checks.
template <typename T>
absl::Status ValidateChunkLossInputs(const LossParams& params,
                                     const ChunkLossOptions& options,
                                     const ChunkLossInputs<T>& inputs,
                                     const ChunkLossOutputs& outputs);

}  // namespace dflash

#endif  // DFLASH_LOSSES_CHUNK_LOSS_H_
