#ifndef DFLASH_PYTHON_NATIVE_OBJECTIVE_H_
#define DFLASH_PYTHON_NATIVE_OBJECTIVE_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "heads/cpu_head.h"
#include "heads/prepared_projection.h"
#include "losses/chunk_loss.h"
#include "losses/vocab_shard.h"
#include "proto/objective.pb.h"
#include "python/native/tensor_arg.h"

namespace dflash::python {

// The tensors of one dflash_objective call: SpecForge's chunk-terms inputs,
// rows [B, N, K] (row b*N*K + n*K + k: target, position k, mask, block
// b*N + n), read in place.
struct ObjectiveTensors {
  // [B, N, K, H], contiguous: float32 or float64 on the CPU, float32 or
  // bfloat16 on CUDA.
  TensorArg hidden;
  TensorArg weight;  // [V, H], contiguous, hidden's dtype and device.
  // [B, N, K], any strides: int64 or int32, and float32, float64 or bool.
  // On the CPU (RowsOf reads them there), or with CUDA hidden on hidden's
  // device, where the CUDA head builds the rows (BuildCudaRows,
  // heads/cuda_head.h) and a bad element gets RowsOf's error (the metadata
  // is read back on failure only). One on the device beside one on the CPU
  // is copied to the host.
  TensorArg target_ids;
  TensorArg weight_mask;
  std::optional<TensorArg> bias;               // [V], like weight.
  std::optional<TensorArg> teacher_hidden;     // [B, N, K, H], like hidden.
  // [B, N, K], contiguous: float64 for float64 hidden, else float32
  // (ConfidenceOf, losses/chunk_loss.h: the loss reads confidence logits
  // and their gradient is written in that dtype).
  std::optional<TensorArg> confidence_logits;
  // A low-rank logit correction z @ M^T: z [B, N, K, r] like hidden, M
  // [V, r] like the weight; both or neither.
  std::optional<TensorArg> correction_inputs;
  std::optional<TensorArg> correction_weight;
};

// Buffers the caller allocated for the results, contiguous, on hidden's
// device. Gradients are of loss_num / loss_den; grad_hidden is required,
// grad_weight and grad_bias exactly when the head trains, grad_confidence
// with confidence logits, the correction's with a correction; a
// forward-only run (ObjectiveOptions::forward_only) takes none of them.
struct ObjectiveOutputs {
  std::optional<TensorArg> grad_hidden;  // Like hidden.
  std::optional<TensorArg> grad_weight, grad_bias;
  std::optional<TensorArg> grad_confidence;  // Like confidence_logits.
  std::optional<TensorArg> neg_log_q;        // [B, N, K] float64.
  std::optional<TensorArg> argmax;           // [B, N, K] int32.
  // [B, N, K] int32: domino's base logits' argmax, -1 for other families.
  std::optional<TensorArg> base_argmax;
  // [B, N, K] int32: the teacher's logits' argmax (with teacher_hidden),
  // -1 without a teacher.
  std::optional<TensorArg> teacher_argmax;
  std::optional<TensorArg> top_k;            // [B, N, K, k] int32.
  // [B, N, K, k] with top_k: float64 for float64 hidden (the head writes
  // float32 values, so a float64 run computes them again in float64 at its
  // ids), else float32.
  std::optional<TensorArg> top_k_values;
  std::optional<TensorArg> loss_weight;      // [B, N, K] float64.
  // With a correction: d/dz and d/dM, like z and M.
  std::optional<TensorArg> grad_correction_inputs, grad_correction_weight;
};

struct ObjectiveOptions {
  bool trainable = false;  // The weight (and bias) get gradients.
  // CUDA tensors: torch's current stream on their device
  // (torch.cuda.current_stream().cuda_stream); the run is ordered on it.
  uintptr_t cuda_stream = 0;
  // A frozen float32 CPU weight laid out once (PreparedProjection), or none.
  const PreparedProjection* prepared_projection = nullptr;
  // Stops a CPU run, or a split run's forward on CUDA (StartObjective),
  // before its next GEMM once set (HeadOptions::interrupt); the run then
  // fails with Cancelled.
  const std::atomic<bool>* interrupt = nullptr;
  // The forward pass alone (HeadOptions::forward_only): no gradient is
  // computed and no gradient buffer given; `trainable` must be false.
  bool forward_only = false;
  // A vocab-parallel run (HeadOptions::vocab_shard): the weight (bias,
  // correction weight) holds this process's rows [offset, offset + rows) of
  // vocab_shard->vocab classes; target and top-k ids are global. On CUDA,
  // the families CudaChunkLoss runs vocab-parallel (losses/cuda_chunk_loss.h).
  // Borrowed; null: the whole vocabulary.
  const VocabShard* vocab_shard = nullptr;
  // With head.device_results (required then, refused otherwise): float64
  // [DeviceResultsSize(K)] (losses/device_results.h), contiguous, on
  // hidden's CUDA device, where the run writes its terms; the run then
  // reads nothing back and never waits (the returned HeadResult is NaN).
  // CheckObjectiveResults turns its status words into the run's error.
  std::optional<TensorArg> device_results;
};

// A PreparedProjection of a torch weight and bias: CPU, float32,
// contiguous, [V, H] and [V]. Errors name the argument.
absl::StatusOr<std::unique_ptr<PreparedProjection>> PrepareProjection(
    const TensorArg& weight, const std::optional<TensorArg>& bias,
    int threads);

// `config` with what the tensors decide written in: layout (K, N), head
// sizes (V, H), dtype, backend, trainable, bias; then defaults resolved and
// validated. A teacher or confidence tensor the loss does not read, or one
// it needs and lacks, is an error naming it.
absl::StatusOr<v1::ObjectiveConfig> BindConfig(
    const v1::ObjectiveConfig& config, const ObjectiveTensors& tensors,
    bool trainable);

// The rows' metadata. `vocab` is the whole vocabulary (a vocab-parallel
// run's VocabShard::vocab, not its shard's rows). Masks must be finite,
// >= 0, and sum to what the terms' dtype holds (float64 with `float64_terms`, a float64 run, which
// keeps them exactly; else float32, to which they are rounded); where a mask is > 0, a target must lie in [0, vocab) or equal
// ignore_index, whose row carries nothing (mask 0) unless `count_ignored`
// (loss.cross_entropy.ignored_target_weight COUNT: it keeps its mask and
// target). Errors name the element, e.g. "target_ids[1, 0, 3]".
absl::StatusOr<std::vector<RowMeta>> RowsOf(const TensorArg& target_ids,
                                            const TensorArg& weight_mask,
                                            int64_t vocab,
                                            int64_t ignore_index,
                                            bool count_ignored = false,
                                            bool float64_terms = false);

// Checks every tensor (dtype, device, shape, contiguity; errors name the
// argument), binds `config` to them and runs the head once, forward and
// backward (forward alone with options.forward_only): RunHead on the CPU,
// RunCudaHead on CUDA. Holds no reference to
// any tensor afterwards.
absl::StatusOr<HeadResult> RunObjective(const v1::ObjectiveConfig& config,
                                        const ObjectiveTensors& tensors,
                                        const ObjectiveOutputs& outputs,
                                        const ObjectiveOptions& options);

// A forward pass kept for its backward (SplitHeadRun, heads/head_backend.h):
// non-FUSED modes with gradients wanted and no vocab shard, on the CPU
// (StartHead) or CUDA (StartCudaHead, ordered on torch's streams). It
// borrows the memory of the tensors it was started with, which the caller
// keeps alive and unchanged until it is destroyed. A CUDA state frees its
// device memory through the lent torch allocator where one is, which takes
// the GIL: destroy it without the GIL held. Destroyed on a thread inside a
// run that holds the lock it frees under (the CPU head's; its CUDA
// stream's), as from a callback that run makes, it is freed when that run
// lets go of the lock.
class SavedObjective {
 public:
  virtual ~SavedObjective() = default;
  // The bytes the state holds between the passes (docs/heads.md): what
  // its forward left live in the backend's allocator (what its mode keeps
  // and the per-row state; the host allocator on the CPU, the device's on
  // CUDA) plus the backend's memory outside it: on the CPU the per-row
  // vectors and a frozen FLOAT32 head's own laid-out weight (no
  // PreparedProjection given); on CUDA the device rows made from device
  // metadata.
  virtual int64_t saved_bytes() const = 0;
  // d(upstream * loss_num / loss_den)/d(.) into `gradients`' grad_* buffers
  // (the rest unused; overwritten; checked as RunObjective checks them).
  // CUDA: ordered on `cuda_stream`, torch's current stream now (it need not
  // be the forward's); unused on the CPU. Repeatable. Refused in a child of
  // fork() of the process that made the state (FailedPrecondition), and
  // after a failed or cancelled call. Returns this pass's stats, peak_bytes
  // above the level before Forward.
  virtual absl::StatusOr<HeadStats> Backward(
      double upstream, const ObjectiveOutputs& gradients,
      uintptr_t cuda_stream, const std::atomic<bool>* interrupt) = 0;
  // Backward of a CUDA state started with device_results, its upstream a
  // float32 or float64 one-element tensor on hidden's device, read there
  // (never on the host): d(objective)/d(loss_num) with `of_loss_num` (the
  // head multiplies it by the loss denominator on the device, as callers
  // of Backward do on the host), else d(objective)/d(loss).
  virtual absl::StatusOr<HeadStats> BackwardFromDevice(
      const TensorArg& upstream, bool of_loss_num,
      const ObjectiveOutputs& gradients, uintptr_t cuda_stream,
      const std::atomic<bool>* interrupt) = 0;
};

// After a run with options.device_results: the error RunObjective (or
// StartObjective) would have returned had it run without them, word for
// word (a bad label named as RowsOf names it, a non-finite input named by
// ExplainFailure), from the buffer's status words, read after the work
// queued on `cuda_stream` (one wait); OK where the run latched none.
// `config` and `tensors` as the run was given them.
absl::Status CheckObjectiveResults(const v1::ObjectiveConfig& config,
                                   const ObjectiveTensors& tensors,
                                   const TensorArg& device_results,
                                   uintptr_t cuda_stream);

struct StartedObjective {
  HeadResult forward;
  std::unique_ptr<SavedObjective> saved;
};

// RunObjective's checks and forward pass (StartHead on the CPU;
// StartOnTorchStream on CUDA, ordered on options.cuda_stream), its row
// outputs written, no gradient buffer given (`outputs`' grad_* must be
// empty); options.forward_only and options.vocab_shard must be unset.
absl::StatusOr<StartedObjective> StartObjective(
    const v1::ObjectiveConfig& config, const ObjectiveTensors& tensors,
    const ObjectiveOutputs& outputs, const ObjectiveOptions& options);

// The backward of the top-k values (AddTopKValueGradients, or its CUDA
// version): adds d(objective)/d(values) to grad_hidden (and grad_weight,
// grad_bias when `trainable`), on hidden's device. `config` is the one the
// forward ran (its logit transform), its sizes taken from the tensors.
struct TopKBackwardTensors {
  TensorArg hidden, weight;
  std::optional<TensorArg> bias;
  TensorArg top_k;  // [B, N, K, k] int32, from the forward.
  // [B, N, K, k], contiguous, in the forward's top_k_values dtype (float64
  // for float64 hidden, else float32).
  TensorArg values;  // From the forward.
  TensorArg grad_values;
  TensorArg grad_hidden;  // Like hidden.
  std::optional<TensorArg> grad_weight, grad_bias;
  // The forward's correction, whose logits the values hold: z [B, N, K, r]
  // and M [V, r], both or neither, like hidden; d/dz and d/dM to add to
  // where they are wanted (contiguous, like z and M).
  std::optional<TensorArg> correction_inputs, correction_weight;
  std::optional<TensorArg> grad_correction_inputs, grad_correction_weight;
};
absl::Status RunTopKValueBackward(const v1::ObjectiveConfig& config,
                                  const TopKBackwardTensors& tensors,
                                  const ObjectiveOptions& options);

// CPU runs keep their freed workspaces for the next call, as PyTorch's
// caching allocator does (fresh pages cost a first step ~0.6 ns a byte);
// this returns them to the system.
void ReleaseCachedHostMemory();

}  // namespace dflash::python

#endif  // DFLASH_PYTHON_NATIVE_OBJECTIVE_H_
