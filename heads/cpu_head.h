#ifndef DFLASH_HEADS_CPU_HEAD_H_
#define DFLASH_HEADS_CPU_HEAD_H_

// RunHead: forward and backward of a vocabulary-projection head and its loss
// over one batch on the CPU, chunked and checkpointed per the execution mode
// of a v1::ObjectiveConfig; the entry point for a head's loss and gradients
// on the host. Its types are in heads/head_types.h, shared with the CUDA
// head (//heads:cuda_head).

#include <memory>

#include "absl/status/statusor.h"
#include "base/tracking_allocator.h"
#include "heads/head_backend.h"
#include "heads/head_types.h"
#include "proto/objective.pb.h"

namespace dflash {

// Runs forward and backward of `config` (validated and with defaults
// resolved, see //proto:config) over one batch on the CPU (T = float for
// FLOAT32, double for FLOAT64), in the config's execution mode:
// - MATERIALIZE: one chunk of all rows, logits gradient kept.
// - SAVE_CHUNKS: the chunk plan, every chunk's logits gradient kept.
// - CHECKPOINT / SELECTIVE: the chunk plan under config.checkpoint: each
//   chunk's logits gradient, and the teacher logits, are kept or dropped by
//   its rules and budget; backward recomputes dropped ones a segment at a
//   time.
// - FUSED: grad_hidden is computed per chunk in forward; backward scales.
// StartHead runs the passes of the other modes apart.
// Rows without weight are never projected. Every buffer comes from
// `allocator`. head.threads splits each chunk's loss at block boundaries.
// The same run on a CUDA device is RunCudaHead (//heads:cuda_head); both
// are RunHeadOn (head_backend.h) with their backend.
template <typename T>
absl::StatusOr<HeadResult> RunHead(const v1::ObjectiveConfig& config,
                                   const HeadInputs<T>& inputs,
                                   const HeadGradients<T>& gradients,
                                   TrackingAllocator& allocator,
                                   const HeadRowOutputs& row_outputs = {},
                                   const HeadOptions& options = {});

// RunHead with its forward and backward passes apart (SplitHeadRun,
// heads/head_backend.h): the forward pass now, with the checks and the
// backend RunHead makes; Backward later, once or more, into gradients the
// caller gives then. For every mode but FUSED (SplitsBackward); between
// the passes only what the mode keeps is held (docs/heads.md, "Split
// forward and backward"). `config`, `allocator` and the memory of
// `inputs` (and options.prepared_projection) are borrowed until the run is
// destroyed.
template <typename T>
absl::StatusOr<std::unique_ptr<SplitHeadRun<T>>> StartHead(
    const v1::ObjectiveConfig& config, const HeadInputs<T>& inputs,
    TrackingAllocator& allocator, const HeadRowOutputs& row_outputs = {},
    const HeadOptions& options = {});

// The bytes RunHead holds outside `allocator` for `config` (validated, with
// defaults resolved), to add to PredictPeakBytes: the frozen FLOAT32
// weight laid out for oneDNN when head.pack_weight and no
// PreparedProjection is given (with head.gradient_filter, its tile copy
// too); 0 for the other heads.
absl::StatusOr<int64_t> PredictProjectionBytes(
    const v1::ObjectiveConfig& config);

}  // namespace dflash

#endif  // DFLASH_HEADS_CPU_HEAD_H_
