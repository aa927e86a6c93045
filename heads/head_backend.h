#ifndef DFLASH_HEADS_HEAD_BACKEND_H_
#define DFLASH_HEADS_HEAD_BACKEND_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

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
  // The most rows a chunk projects (HeadPlan::max_chunk_rows): what a
  // backend's per-chunk scratch is sized for once.
  int64_t max_chunk_rows = 0;
  // Whether the backend keeps each row's confidence gradient (in its
  // per-row state, for ScaleGradients): a loss with one whose gradients
  // come later (a split run) or are asked for (gradients->confidence).
  bool keeps_confidence_gradient = false;
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

  // Before the first chunk: resets the per-row outputs (neg_log_q 0, argmax
  // and top-k -1). The gradients are not touched: StartGradients does.
  virtual absl::Status Start(const HeadRunSpec<T>& spec) = 0;

  // Before the first gradient product (after Start): makes `gradients` the
  // run's (kept by pointer, alive until ScaleGradients returns), zeroes
  // them, allocates what sums them (CUDA's FP32 sums of BF16 weight
  // gradients) and forgets a folded scale (InputGradientScale). RunHeadOn
  // calls it right after Start; a split run (SplitHeadRun) at each
  // Backward, so the gradients are not held between the passes.
  virtual absl::Status StartGradients(const HeadGradients<T>& gradients) = 0;

  // Before a split run's backward pass: restores the process-wide settings
  // another call may have changed since Start (OpenBLAS's threads).
  virtual absl::Status Resume() { return absl::OkStatus(); }

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

  // Device rows (HeadInputs::device_rows) on the host, after one wait for
  // the device; the build's first bad element, where it found one, as a
  // RowError about that row (InvalidArgument). Backends without device
  // memory have none to read.
  virtual absl::StatusOr<std::vector<RowMeta>> ReadRows(
      const DeviceRows& rows) {
    return absl::InvalidArgumentError(
        "inputs.device_rows: this backend reads its rows on the host "
        "(inputs.rows)");
  }

  // Waits for the work issued so far; the head times its phases with it.
  virtual absl::Status Synchronize() = 0;

  // After all chunks: waits for the device and returns the run's terms.
  virtual absl::StatusOr<ChunkTerms> Terms() = 0;

  // head.device_results, after all chunks instead of Terms(): queues the
  // finish on the device into `results` (HeadOptions::device_results),
  // keeping the scales for ScaleGradients there; no wait, nothing read.
  virtual absl::Status FinishOnDevice(int64_t sequences, double* results) {
    return absl::InvalidArgumentError(
        "head.device_results: this backend finishes its terms on the host");
  }

  // Multiplies the confidence gradient by upstream *
  // finished.confidence_scale and every other by upstream *
  // finished.gradient_scale, each row's hidden-state gradient also by
  // LkDeferredFactor(kl_w, q of the row) when finished.lk_kl_weight is set
  // (the batch-level LK lambda; the loss recorded each row's q). Returns
  // when the gradients are final. After FinishOnDevice the scales are the
  // device's (`finished` unused) and `device_upstream` (or null) multiplies
  // upstream on the device; the work is queued, not waited for.
  virtual absl::Status ScaleGradients(double upstream,
                                      const DeviceUpstream* device_upstream,
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
  // Bytes of the backend's device memory it holds from Start to its end
  // outside allocator() (the CPU backend's per-row state and its own
  // laid-out weight); a split run adds them to the allocator's bytes it
  // holds. Host memory of a device backend is not its device's.
  virtual int64_t unallocated_bytes() const { return 0; }
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

// Whether `config`'s mode, with `options`, can run its forward and backward
// passes apart (SplitHeadRun): not FUSED (its gradients are made in
// forward), not forward only, not vocab-parallel.
bool SplitsBackward(const v1::ObjectiveConfig& config,
                    const HeadOptions& options);

template <typename T>
class HeadRun;  // head_run.cc.

// RunHeadOn with its forward and backward passes apart, for an autograd
// function whose backward runs later: between the passes only what the
// execution mode keeps is held (docs/heads.md, "Split forward and
// backward"), no gradient.
//   MATERIALIZE, SAVE_CHUNKS: every chunk's logits gradient (active rows x
//     the logits' stride x sizeof(T); twice with a split correction);
//   CHECKPOINT, SELECTIVE: what config.checkpoint keeps (nothing under
//     FULL_RECOMPUTE; SELECTIVE: the teacher logits);
// plus the backend's per-row state (q, ranks, argmaxes, the confidence
// gradient; on CUDA also the active-row list and ALL_ROWS's row copies) and
// a frozen FLOAT32 CPU head's own laid-out weight when none is given.
// Not thread-safe: one call at a time.
template <typename T>
class SplitHeadRun {
 public:
  // The forward pass: the loss, terms, accuracy, plan and forward stats as
  // RunHeadOn gives them, `row_outputs` written, the confidence gradient
  // computed (kept for Backward), no gradient product. Takes `backend`;
  // borrows `config` (validated, defaults resolved) and the memory of
  // `inputs` and options.prepared_projection, which the caller keeps alive
  // and unchanged until the run is destroyed; `row_outputs` are written
  // by this call only. Refuses (InvalidArgument, naming it) FUSED,
  // options.forward_only, options.vocab_shard and an
  // options.upstream_gradient other than 1 (upstream comes at Backward).
  static absl::StatusOr<std::unique_ptr<SplitHeadRun>> Forward(
      const v1::ObjectiveConfig& config, const HeadInputs<T>& inputs,
      std::unique_ptr<HeadBackend<T>> backend,
      const HeadRowOutputs& row_outputs, const HeadOptions& options);
  ~SplitHeadRun();

  // Its stats.saved_bytes is saved_bytes() after Forward.
  const HeadResult& forward() const { return forward_; }
  // Bytes of the backend's device this run holds now, from Forward until
  // it is destroyed (Backward frees what it allocates): the backend
  // allocator's bytes the forward pass left live, plus the backend's
  // unallocated_bytes() (which grow by the tile copy of a frozen FLOAT32
  // CPU head's own weight where head.gradient_filter makes it, at the
  // first Backward). Measured, so the allocator must serve no other thread
  // during Forward (as RunHeadOn's peak_bytes needs).
  int64_t saved_bytes() const;

  // d(upstream * loss)/d(.) into `gradients` (overwritten; sized as for
  // RunHeadOn), recomputing what the mode dropped and freeing it again, so
  // a second call gives the same gradients. Cancelled once *interrupt is
  // set (null: never). A failed or cancelled call breaks the run: the next
  // one is FailedPrecondition. The stats are this pass's (GEMMs, seconds,
  // checkpoint counts so far), peak_bytes the allocator's peak during it
  // above its level before Forward (what the forward pass left live
  // included, as in RunHeadOn; saved_bytes' memory outside the allocator
  // is not).
  absl::StatusOr<HeadStats> Backward(double upstream,
                                     const HeadGradients<T>& gradients,
                                     const std::atomic<bool>* interrupt);
  // Backward with the upstream in device memory, under head.device_results
  // (refused, naming it, otherwise): read and folded into the gradients'
  // scale on the backend's stream, so the pass neither reads the device nor
  // waits for it; the gradients are final once its stream's work is.
  absl::StatusOr<HeadStats> Backward(const DeviceUpstream& upstream,
                                     const HeadGradients<T>& gradients,
                                     const std::atomic<bool>* interrupt);

 private:
  SplitHeadRun() = default;
  absl::StatusOr<HeadStats> BackwardWith(double upstream,
                                         const DeviceUpstream* device_upstream,
                                         const HeadGradients<T>& gradients,
                                         const std::atomic<bool>* interrupt);

  HeadInputs<T> inputs_;
  HeadRowOutputs row_outputs_;
  std::unique_ptr<HeadBackend<T>> backend_;
  std::unique_ptr<HeadRun<T>> run_;  // Refers to the members above.
  HeadResult forward_;
  // The allocator's bytes the forward pass left live.
  int64_t allocated_bytes_ = 0;
  bool broken_ = false;
};

}  // namespace dflash

#endif  // DFLASH_HEADS_HEAD_BACKEND_H_
