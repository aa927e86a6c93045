#ifndef DFLASH_HEADS_HEAD_TYPES_H_
#define DFLASH_HEADS_HEAD_TYPES_H_

// What a caller of a head fills and gets back, for the CPU head (RunHead,
// heads/cpu_head.h) and the CUDA head (RunCudaHead, heads/cuda_head.h)
// alike: HeadInputs, HeadGradients, HeadRowOutputs and HeadOptions in;
// HeadResult (terms, accuracy, plan, HeadStats) out.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/types/span.h"
#include "checkpoint/checkpoint_context.h"
#include "chunking/chunk_plan.h"
#include "losses/chunk_loss.h"
#include "losses/vocab_shard.h"
#include "proto/objective.pb.h"

namespace dflash {

class PreparedProjection;  // heads/prepared_projection.h

// A CUDA head's row metadata in device memory (BuildCudaRows,
// heads/cuda_head.h, makes it from target_ids and weight_mask on the
// device): `count` RowMeta, checked and with their sequence shares, and the
// word where the build recorded the first bad element (kNoRowsError when
// none; DecodeRowsError). The head reads the word once, before it reports
// anything: at its start with head.row_selection COMPACT, at the end of
// its forward pass with ALL_ROWS. Borrowed.
struct DeviceRows {
  const RowMeta* rows = nullptr;
  int64_t count = 0;
  const unsigned long long* error = nullptr;
};

// One batch through the head. Rows are the DFlash draft positions
// [B, N, K] flattened (see //losses:batch_layout); K = layout.block_size.
template <typename T>
struct HeadInputs {
  absl::Span<const T> hidden;          // [rows, H] draft hidden states.
  absl::Span<const T> teacher_hidden;  // [rows, H]; dspark, distillation.
  // [rows]; dspark. ConfidenceOf<T> (losses/chunk_loss.h): double beside
  // double, else float.
  absl::Span<const ConfidenceOf<T>> confidence_logits;
  // On the host; or empty, with device_rows (a CUDA head).
  absl::Span<const RowMeta> rows;
  absl::Span<const T> weight;  // [V, H]
  absl::Span<const T> bias;    // [V] when head.bias.
  // With head.correction_rank r > 0: logits += z @ M^T, z [rows, r] from
  // the caller's module (DSpark's Markov head, Domino's projection), M
  // [V, r] trainable. Domino adds it at positions >= its suffix_start only.
  absl::Span<const T> correction_inputs;  // z [rows, r]
  absl::Span<const T> correction_weight;  // M [V, r]
  // The rows on the device where `rows` is empty (last, so that callers
  // listing the spans above need not name it).
  DeviceRows device_rows;
};

// The rows of `inputs`: the host rows', else the device rows' count.
template <typename T>
int64_t RowCount(const HeadInputs<T>& inputs) {
  return inputs.rows.empty() ? inputs.device_rows.count
                             : static_cast<int64_t>(inputs.rows.size());
}

// Where gradients of loss * upstream land, at the rows' original positions.
template <typename T>
struct HeadGradients {
  absl::Span<T> hidden;          // [rows, H]; required.
  absl::Span<T> weight;          // [V, H] when head.trainable; overwritten.
  absl::Span<T> bias;            // [V] when trainable with a bias.
  // [rows] for dspark's confidence term, in ConfidenceOf<T>.
  absl::Span<ConfidenceOf<T>> confidence;
  // With head.correction_rank: d/dz [rows, r] and d/dM [V, r] (overwritten;
  // summed over chunks in T, float or double on the CPU).
  absl::Span<T> correction_inputs;
  absl::Span<T> correction_weight;
};

// Optional per-row results at the rows' original positions (see
// ChunkLossOutputs; rows without weight get 0 / -1). neg_log_q and
// loss_weight are double whatever T, as the loss computes them.
struct HeadRowOutputs {
  absl::Span<double> neg_log_q;
  absl::Span<int32_t> argmax;
  absl::Span<int32_t> top_k;  // [rows, k]
  int32_t k = 0;
  // [rows, k] with top_k: the loss's logits z' at those ids, the unary
  // logits a DFlash2 candidate selector scores (gradients back through
  // AddTopKValueGradients, heads/top_k_gradient.h).
  absl::Span<float> top_k_values;
  absl::Span<double> loss_weight;  // [rows]: w, SpecForge's loss_weights.
  // [rows], domino: the base logits' argmax (SpecForge main's base-head
  // greedy ids); -1 for the other families and rows without a mask.
  absl::Span<int32_t> base_argmax;
  // [rows], with teacher_hidden: the teacher's logits' argmax (the loss's
  // TeacherAgrees compares it with argmax); -1 without a teacher and for
  // rows without a mask.
  absl::Span<int32_t> teacher_argmax;
};

struct HeadStats {
  int64_t chunks = 0;
  // The rows with weight, the others skipped (head.row_selection COMPACT);
  // every row (ALL_ROWS).
  int64_t projected_rows = 0;
  int64_t gemm_calls = 0;
  double gemm_flops = 0;
  // gemm_flops in units of one projection of the projected rows
  // (2 * projected_rows * H * V): the count in the cost table of
  // docs/semantics.md section 8.
  double gemm_passes = 0;
  int64_t segment_recomputes = 0;
  int64_t peak_bytes = 0;  // Tracking allocator, above its level at entry.
  // A split run's forward (SplitHeadRun::saved_bytes): the bytes of the
  // backend's device it holds until the run is destroyed; 0 for RunHead and
  // a backward pass.
  int64_t saved_bytes = 0;
  double forward_seconds = 0;
  double backward_seconds = 0;
  double gemm_seconds = 0;     // Of which in GEMMs,
  double loss_seconds = 0;     // and in the loss row kernels.
  // Laying the frozen weight out for this run (0 when it was given and
  // unchanged since).
  double prepare_seconds = 0;
  // What ran the projection's GEMMs, e.g. "oneDNN (brg:avx512_core), the
  // weight laid out once" or "OpenBLAS 0.3.21 (SkylakeX kernels)".
  std::string gemm_library;
  // With head.gradient_filter: vocabulary tiles of the input-gradient
  // GEMMs, and those skipped.
  int64_t filter_tiles = 0;
  int64_t filter_skipped_tiles = 0;
  // The threads the CPU work ran on: head.threads (0: every usable CPU),
  // at most the CPUs this process may use, 1 in a forked child.
  int threads = 1;
  CheckpointStats checkpoint;  // Empty in FUSED mode (no context).
};

struct HeadResult {
  // The family's loss (FinishTerms: loss_num / loss_den for most); 0 when
  // nothing carries weight.
  double loss = 0;
  // loss = terms.loss_num / loss_denominator (the floored loss_den for
  // most families, loss_den + 1e-6 for domino).
  double loss_denominator = 1;
  // What the family adds to the summed loss_den before dividing (Domino's
  // 1e-6; 0 for the rest): LossDenOffset.
  double loss_den_offset = 0;
  ChunkTerms terms;
  // The batch-level LK lambda's CE weight kl_w (FinishTerms); unset for
  // other compositions.
  std::optional<double> lk_kl_weight;
  double accuracy = 0;  // correct / accuracy_den (FinishTerms).
  std::vector<double> accuracy_per_position;  // Size K; 0 where no mask.
  v1::HeadConfig::ExecutionMode mode = v1::HeadConfig::FUSED;
  ChunkPlan plan;
  HeadStats stats;
};

// What the head adds to its loss: the layout's block size, the head's logit
// transform and its metric_top_k (capped at the vocabulary; none for
// domino, whose loss reports SpecForge's own telemetry instead).
// With a vocab_shard, metric_top_k is capped at the whole vocabulary.
inline ChunkLossOptions ChunkLossOptionsOf(
    const v1::ObjectiveConfig& config,
    const VocabShard* vocab_shard = nullptr) {
  const v1::HeadConfig& head = config.head();
  const int64_t vocab =
      vocab_shard != nullptr ? vocab_shard->vocab : head.vocab_size();
  const int64_t top_k = config.loss().has_domino()
                            ? 0
                            : std::min<int64_t>(head.metric_top_k(), vocab);
  return {config.layout().block_size(), head.logit_scale(),
          head.logit_softcap(), static_cast<int32_t>(top_k), vocab_shard};
}

struct HeadOptions {
  // d(objective)/d(loss) from the caller; gradients are scaled by it.
  double upstream_gradient = 1.0;
  // Called after each chunk's forward and each chunk's backward step with
  // (steps done, steps in all).
  std::function<void(int64_t, int64_t)> progress;
  // A frozen FLOAT32 CPU head's weight, laid out once by the caller and
  // kept across runs (a training loop's frozen lm_head). It must have been
  // prepared from inputs.weight and inputs.bias themselves; borrowed.
  const PreparedProjection* prepared_projection = nullptr;
  // Set (by a signal handler, another thread) to stop the run: checked
  // before each of its GEMMs, it then returns Cancelled with the gradients
  // and row outputs partly written. Borrowed; null: the run completes.
  const std::atomic<bool>* interrupt = nullptr;
  // The forward pass alone (an evaluation, a call under torch.no_grad()):
  // the terms, stats and row outputs as a training run gives them, but no
  // gradient GEMM, no checkpoint context (every mode runs its chunks once,
  // as FUSED does) and no gradient written. The HeadGradients may then be
  // empty (any given are left alone, confidence's included).
  bool forward_only = false;
  // A vocab-parallel head (borrowed; null: the whole vocabulary here):
  // head.vocab_size is this process's number of classes (the rows of
  // inputs.weight, inputs.bias and inputs.correction_weight here), classes
  // [offset, offset + head.vocab_size) of vocab_shard->vocab. Every process
  // of the exchange's group calls the head with the same config (but
  // vocab_size), rows, hidden states and options, at the same time.
  // Target ids are checked against the whole vocabulary; row_outputs'
  // argmax and top-k ids are global; the loss, terms and row outputs equal
  // the single-process run's (float64 within 1e-12 relative, float32 1e-6)
  // and are bitwise equal on every process. gradients.weight, .bias and
  // .correction_weight are this shard's rows of the single-process
  // gradients; gradients.hidden and .correction_inputs are this process's
  // partial sums: the caller sums them over the group (an all-reduce) to
  // get the single-process gradients. gradients.confidence is whole on
  // every process. An error on one process is an error on every process
  // (but HeadOptions::interrupt: set it on every process or none). The
  // chunk plan is made for the widest process's logits, so that all run
  // the same chunks; a checkpoint.memory_budget_bytes must keep every
  // chunk's intermediates (a recomputed chunk exchanges again, so every
  // process must recompute the same ones). The CUDA head too (its loss
  // merges each chunk's records on the host), but not with
  // head.device_results or device rows.
  const VocabShard* vocab_shard = nullptr;
  // With head.device_results (required then, refused otherwise): the
  // caller's device buffer of DeviceResultsSize(layout.block_size) doubles
  // (losses/device_results.h) that the run's finish writes on the device;
  // borrowed. ReadDeviceResults (heads/cuda_head.h) reads it.
  double* device_results = nullptr;
};

// A split run's upstream gradient in device memory (SplitHeadRun::Backward
// under head.device_results): one float or double that the backward reads
// on its stream, never on the host.
struct DeviceUpstream {
  const void* value = nullptr;
  bool is_float = false;  // float32, else float64.
  // `value` is d(objective)/d(terms.loss_num) (an autograd grad of the
  // terms): the head multiplies it by the finished loss denominator, as
  // the binding does on the host. Else d(objective)/d(loss).
  bool of_loss_num = false;
};

}  // namespace dflash

#endif  // DFLASH_HEADS_HEAD_TYPES_H_
