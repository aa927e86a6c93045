#ifndef DFLASH_HEADS_HEAD_BACKEND_H_
#define DFLASH_HEADS_HEAD_BACKEND_H_

#include <cstdint>
#include <memory>
#include <optional>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "base/tracking_allocator.h"
#include "heads/head_types.h"
#include "heads/projection.h"
#include "losses/chunk_loss.h"
#include "losses/vocab_shard.h"
#include "proto/objective.pb.h"

namespace dflash {

// One run's tensors, as RunHeadOn hands them to a backend. Every span is in
// the backend's memory; `active` (host) lists the rows the head projects:
// the weighted ones, ascending. Chunk ranges below index into `active`.
template <typename T>
struct HeadRunSpec {
  const v1::ObjectiveConfig* config = nullptr;
  // The config's loss, resolved once by the run for every part of it.
  const LossParams* params = nullptr;
  const HeadInputs<T>* inputs = nullptr;
  const HeadGradients<T>* gradients = nullptr;
  const HeadRowOutputs* row_outputs = nullptr;
  absl::Span<const int64_t> active;
  const PreparedProjection* prepared_projection = nullptr;  // Or none.
  // HeadOptions::vocab_shard: the chunk loss's (ChunkLossOptions).
  const VocabShard* vocab_shard = nullptr;
};

// What the head needs from the device it runs on: memory, the projection,
// row movement and the chunk loss. RunHeadOn holds the execution modes, the
// chunk plan and the checkpoint logic once for every backend; the CPU
// backend (CBLAS, //losses:chunk_loss with threads) and the CUDA backend
// (cuBLAS, //losses:cuda_chunk_loss) implement this.
template <typename T>
class HeadBackend {
 public:
  virtual ~HeadBackend() = default;

  virtual Device device() const = 0;
  // Memory on the backend's device, counted (peak bytes of a run).
  virtual TrackingAllocator& allocator() = 0;
  // Valid after Start.
  virtual VocabProjection<T>& projection() = 0;
  // The correction's projection (weight M [V, r]) with head.correction_rank,
  // else null. Valid after Start.
  virtual VocabProjection<T>* correction() = 0;

  // Before the first chunk: zeroes the gradients and resets the per-row
  // outputs (neg_log_q 0, argmax and top-k -1).
  virtual absl::Status Start(const HeadRunSpec<T>& spec) = 0;

  // out[i, :] = source[active[begin + i], :] for rows of `width` values.
  // The status is the launch's where the work is queued (CUDA).
  virtual absl::Status GatherRows(const T* source, int64_t width, int64_t begin,
                                  int64_t count, T* out) = 0;
  // out[active[begin + i], :] = rows[i, :].
  virtual absl::Status ScatterRows(const T* rows, int64_t width, int64_t begin,
                                   int64_t count, T* out) = 0;

  // The loss of chunk `chunk`, active rows [begin, begin + count), on
  // `logits` [count, V] (and `teacher` [count, V] or null; `correction`
  // [count, V], the correction's logits apart, or null); the logits (and
  // correction) are overwritten with d(loss_num)/d(logits). With `record`,
  // the chunk's terms join the run's and its per-row outputs and confidence
  // gradient are written; a recomputation passes false.
  virtual absl::Status ChunkLoss(int64_t chunk, int64_t begin, int64_t count,
                                 T* logits, const T* teacher, T* correction,
                                 bool record) = 0;

  // Waits for the work issued so far; the head times its phases with it.
  virtual absl::Status Synchronize() = 0;

  // After all chunks: waits for the device and returns the run's terms.
  virtual absl::StatusOr<ChunkTerms> Terms() = 0;

  // Multiplies the confidence gradient by upstream *
  // finished.confidence_scale and every other by upstream *
  // finished.gradient_scale, each row's hidden-state gradient also by
  // LkDeferredFactor(kl_w, q of the row) when finished.lk_kl_weight is set
  // (the batch-level LK lambda; the loss recorded each row's q). Returns
  // when the gradients are final.
  virtual absl::Status ScaleGradients(double upstream,
                                      const FinishedLoss& finished) = 0;

  // Whether the backend folds upstream x the final gradient scale into its
  // input-gradient products (rounding a BF16 gradient once). The run tells
  // it the scale through InputGradientScale after Start where the rows
  // alone decide it, or between the forward and the backward pass where
  // the logits do (D-PACE, non-fused modes); ScaleGradients then leaves
  // those gradients alone.
  virtual bool folds_gradient_scale() const { return false; }
  virtual void InputGradientScale(double scale) {}

  // Host seconds spent in the loss so far (0 where it runs asynchronously).
  virtual double loss_seconds() const = 0;
  // The host threads its CPU work runs on (known after Start).
  virtual int threads() const { return 1; }
  // Seconds Start spent laying the weight out (0 where it did not).
  virtual double prepare_seconds() const { return 0; }
  // What runs the projection's GEMMs.
  virtual std::string gemm_library() const = 0;
};

// A RowError about batch row r named by its (b, n, k) (or (block, k) when
// layout.num_anchors is unset); other errors unchanged.
absl::Status NameBatchRowError(const absl::Status& error,
                               const v1::BatchLayout& layout);

// A loss error of chunk `chunk` as the caller should read it: an error
// about the chunk's row i (losses/row_error.h) names batch row
// chunk_rows[i] by its (b, n, k) (or (block, k) when layout.num_anchors is
// unset); other errors are prefixed with the chunk.
absl::Status NameChunkLossError(const absl::Status& error,
                                const v1::BatchLayout& layout, int64_t chunk,
                                absl::Span<const int64_t> chunk_rows);

// A vocab-parallel head's own checks of options.vocab_shard against the
// config: an exchange, this process's classes within the vocabulary.
absl::Status CheckVocabShard(const v1::ObjectiveConfig& config,
                             const VocabShard& shard);

// The config's head.backend and head.dtype against what `call` runs, e.g.
// "head.dtype: this call takes FLOAT32 tensors (CPU heads run FLOAT32 or
// FLOAT64), got BFLOAT16".
absl::Status CheckHeadTarget(const v1::HeadConfig& head,
                             v1::HeadConfig::Backend backend,
                             v1::HeadConfig::DType dtype, const char* call,
                             const char* dtypes);

// RunHead's work on any backend; see RunHead for the modes. The caller has
// checked the config's backend and dtype against `backend`.
template <typename T>
absl::StatusOr<HeadResult> RunHeadOn(const v1::ObjectiveConfig& config,
                                     const HeadInputs<T>& inputs,
                                     const HeadGradients<T>& gradients,
                                     HeadBackend<T>& backend,
                                     const HeadRowOutputs& row_outputs,
                                     const HeadOptions& options);

}  // namespace dflash

#endif  // DFLASH_HEADS_HEAD_BACKEND_H_
