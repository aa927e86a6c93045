#ifndef DFLASH_HEADS_CUDA_HEAD_H_
#define DFLASH_HEADS_CUDA_HEAD_H_

// RunCudaHead: RunHead on a CUDA device, with cuBLAS projections and the
// CUDA loss, on device-resident tensors and a CublasHandle's stream. Reach
// for it when the hidden states and the head's weight live on the GPU; it
// returns the same HeadResult as the CPU head.

#include <memory>
#include <optional>

#include "absl/status/statusor.h"
#include "base/tracking_allocator.h"
#include "heads/cuda_head_kernels.h"
#include "heads/cuda_projection.h"
#include "heads/head_backend.h"
#include "heads/head_types.h"
#include "proto/objective.pb.h"

namespace dflash {

// RunHead on a CUDA device: head.backend CUDA, T = float for FLOAT32 or
// BFloat16 for BFLOAT16. The same modes, chunk plan, checkpoint logic and
// results as RunHead (both are RunHeadOn), with cuBLAS projections and the
// CUDA loss (//losses:cuda_chunk_loss).
//
// Every tensor span in `inputs`, `gradients` and `row_outputs` is device
// memory; the rows' metadata is `inputs.rows` on the host, or
// `inputs.device_rows` (BuildCudaRows) with `inputs.rows` empty: under
// head.row_selection COMPACT the run reads device rows back once before
// its first chunk (Plan waits for the build, before any chunk's work is
// queued); under ALL_ROWS once after its last forward chunk (for the
// terms), nothing of them reaching the host before the head's work is
// queued. A bad element the build found is reported then, as a
// RowError about its row (InvalidArgument, "row (b, n, k) = (...):
// weight_mask: must be finite and >= 0" and the like). So under COMPACT
// such a run fails before it writes anything, but under ALL_ROWS only once
// its forward chunks have run: `row_outputs` then hold every row's values
// from its chunk, and `gradients` (overwritten by any run: zeroed at its
// start) hold, under FUSED, the chunks' gradient products unscaled, else
// zeros; take them as unspecified. Work goes on
// `blas`'s stream, and device memory comes from that stream's allocator, so
// HeadStats.peak_bytes are the run's device bytes, measured as on the CPU.
// The chunk loop never waits for the device: the run synchronises once at
// the end of forward and once at the end of backward, where it reads the
// terms; gradients are scaled on the device. With head.device_results it
// never waits nor reads: see CheckDeviceResults below. GEMM and loss seconds are not
// measured (0); forward and backward seconds are.
template <typename T>
absl::StatusOr<HeadResult> RunCudaHead(const v1::ObjectiveConfig& config,
                                       const HeadInputs<T>& inputs,
                                       const HeadGradients<T>& gradients,
                                       CublasHandle& blas,
                                       const HeadRowOutputs& row_outputs = {},
                                       const HeadOptions& options = {});

// Row metadata made on the device (BuildCudaRows); owns its memory, from
// the stream's allocator. view() goes into HeadInputs::device_rows. The
// build's tile sums of the masks are not kept: nothing reads them after the
// build, so they go back to the allocator, in stream order, as it returns.
struct CudaRows {
  TrackedBuffer<RowMeta> rows;
  TrackedBuffer<unsigned long long> error;
  // The device bytes held: what a run keeping the rows holds with them.
  int64_t bytes() const { return rows.bytes() + error.bytes(); }
  DeviceRows view() const { return {rows.data(), rows.size(), error.data()}; }
};

// The rows of a [B, N, K] batch from its target_ids (int32 or int64) and
// weight_mask (float32, float64 or bool) in device memory, at any strides
// (K = layout.block_size), by RowsOf's rules (python/native/objective.cc)
// for a float32-terms run: a mask must be finite and >= 0 and is rounded
// to float32, the masks' sum must stay within float32, a target with
// weight must lie in [0, head.vocab_size) or be loss.cross_entropy's
// ignore_index (kept with ignored_target_weight COUNT, else the row
// carries nothing); the rows of D-PACE's SEQUENCE_BALANCED denominator get
// their sequence shares (sequences of layout.num_anchors blocks, all rows
// without it). Queued on `stream`, no wait: the first bad element (RowsOf's
// order) lands in the error word, which the head reads (RunCudaHead) or
// ReadCudaRowsError does. `config` validated, defaults resolved.
absl::StatusOr<CudaRows> BuildCudaRows(const v1::ObjectiveConfig& config,
                                       const cuda::RowsTensor& target_ids,
                                       const cuda::RowsTensor& weight_mask,
                                       int64_t batch, int64_t anchors,
                                       CudaStream& stream);

// The first bad element BuildCudaRows found (one wait for the device):
// its linear index b N K + n K + k and kind; nullopt where there is none.
struct CudaRowsError {
  int64_t element = 0;
  cuda::RowsErrorKind kind = cuda::kRowsMaskInvalid;
};
absl::StatusOr<std::optional<CudaRowsError>> ReadCudaRowsError(
    const DeviceRows& rows, CudaStream& stream);

// head.device_results (docs/cuda.md, "Results on the device"): the run
// writes its results into HeadOptions::device_results
// (losses/device_results.h) on the device and never reads them. These read
// them back (one wait for `stream`, which must be ordered after the run's):
// CheckDeviceResults returns the Status the synchronous run would have
// returned (the status words: a bad row BuildCudaRows found, then a
// non-finite logit or the like, each naming its batch row with the same
// message, or a split run's non-finite device upstream, with
// SplitHeadRun::Backward's refusal); ReadDeviceResults that error, else
// the loss, terms, accuracy and kl_w as RunCudaHead's HeadResult has them
// (no plan or stats). Where it is an error, the terms and gradients are
// NaN, and so are a failed forward's row outputs (neg_log_q, top_k_values,
// loss_weight; argmax, top_k and teacher_argmax -1). The status words are
// bit patterns (no error reads as a NaN double): these, not isfinite or a
// sum across ranks, are how the buffer is checked.
absl::Status CheckDeviceResults(const v1::ObjectiveConfig& config,
                                const double* results, CudaStream& stream);
// The same from the buffer's two status words already on the host
// (`words`: its first two doubles, kResultRowsStatus and kResultLossStatus).
absl::Status DeviceResultsStatus(const v1::ObjectiveConfig& config,
                                 const double* words);
absl::StatusOr<HeadResult> ReadDeviceResults(const v1::ObjectiveConfig& config,
                                             const double* results,
                                             CudaStream& stream);

// RunCudaHead with its forward and backward passes apart (SplitHeadRun,
// heads/head_backend.h; StartHead's twin): the same checks, every mode but
// FUSED. `config`, `blas` (its stream and allocator) and the device memory
// of `inputs` are borrowed until the run is destroyed; Backward's work goes
// on `blas`'s stream and returns when the gradients are final. The FP32
// sums of BF16 weight gradients live from Backward's start to its end.
template <typename T>
absl::StatusOr<std::unique_ptr<SplitHeadRun<T>>> StartCudaHead(
    const v1::ObjectiveConfig& config, const HeadInputs<T>& inputs,
    CublasHandle& blas, const HeadRowOutputs& row_outputs = {},
    const HeadOptions& options = {});

// AddTopKValueGradients (heads/top_k_gradient.h) on a CUDA device: every
// span is device memory, work goes on `stream`. The ids are copied to the
// host and checked first (rows x k int32, small). A trainable head's weight
// and bias gradients take atomic adds: FP32 for float, and for bfloat16 a
// compare-and-swap with the sum rounded to bfloat16 at each add.
template <typename T>
absl::Status AddCudaTopKValueGradients(
    const v1::ObjectiveConfig& config, const HeadInputs<T>& inputs,
    absl::Span<const int32_t> ids, absl::Span<const float> values,
    absl::Span<const float> grad_values, int32_t k,
    const HeadGradients<T>& gradients, CudaStream& stream);

}  // namespace dflash

#endif  // DFLASH_HEADS_CUDA_HEAD_H_
