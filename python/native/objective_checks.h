#ifndef DFLASH_PYTHON_NATIVE_OBJECTIVE_CHECKS_H_
#define DFLASH_PYTHON_NATIVE_OBJECTIVE_CHECKS_H_

// The argument checks of objective.cc (dtype, device, shape, contiguity and
// what the loss reads), apart from the binding and the run; errors name the
// argument. Private to //python/native:objective.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "heads/prepared_projection.h"
#include "proto/objective.pb.h"
#include "python/native/objective.h"
#include "python/native/tensor_arg.h"

namespace dflash::python {

// "<t's name>: <what>", invalid argument.
absl::Status Invalid(const TensorArg& t, const std::string& what);

// The dtype of the top-k values and of their gradient: hidden's on the
// CPU (float64 or float32), float32 on CUDA (bfloat16 hidden included).
absl::string_view TopKValueDType(const TensorArg& hidden);

// hidden decides the dtype, the device and B, N, K, H for the rest.
absl::Status CheckHidden(const TensorArg& hidden);

// A tensor read in place next to hidden: its dtype (or `dtype`), device,
// `shape` and contiguity.
absl::Status CheckBeside(const TensorArg& t, const TensorArg& hidden,
                         const std::vector<int64_t>& shape,
                         absl::string_view dims, absl::string_view dtype = "");

// The projection's weight: [V, H] with hidden's H, beside hidden.
absl::Status CheckWeight(const TensorArg& w, const TensorArg& hidden);

// A correction's inputs z [B, N, K, r] and weight M [V, r] beside hidden
// and the weight w: both or neither.
absl::Status CheckCorrection(const std::optional<TensorArg>& z,
                             const std::optional<TensorArg>& m,
                             const TensorArg& hidden, const TensorArg& w);

// Every input tensor of a dflash_objective call.
absl::Status CheckTensors(const ObjectiveTensors& t);

// The output buffers, against the tensors and the bound config (which
// gradients it needs; none when `forward_only`).
absl::Status CheckOutputs(const ObjectiveOutputs& o, const ObjectiveTensors& t,
                          const v1::ObjectiveConfig& config,
                          bool forward_only);

// The teacher and confidence tensors against what the bound loss reads.
absl::Status CheckLossInputs(const v1::ObjectiveConfig& config,
                             const ObjectiveTensors& t);

// A prepared projection serves the frozen float32 CPU weight and bias it
// was made from; none passes.
absl::Status CheckPrepared(const PreparedProjection* prepared,
                           const ObjectiveTensors& t,
                           const v1::ObjectiveConfig& bound);

// A vocab-parallel run's shard against the tensors: CPU only, rows
// [offset, offset + the weight's rows) inside [0, vocab), an exchange of
// at least one process with this one's rank in it.
absl::Status CheckVocabShard(const VocabShard& shard,
                             const ObjectiveTensors& t);

// Every tensor of RunTopKValueBackward; the weight's and bias's gradients
// exactly when `trainable`.
absl::Status CheckTopKBackward(const TopKBackwardTensors& t, bool trainable);

}  // namespace dflash::python

#endif  // DFLASH_PYTHON_NATIVE_OBJECTIVE_CHECKS_H_
