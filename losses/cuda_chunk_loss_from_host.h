#ifndef DFLASH_LOSSES_CUDA_CHUNK_LOSS_FROM_HOST_H_
#define DFLASH_LOSSES_CUDA_CHUNK_LOSS_FROM_HOST_H_

// CudaChunkLossFromHost: one chunk through CudaChunkLoss from host tensors,
// for tests.

#include "absl/status/statusor.h"
#include "base/cuda_stream.h"
#include "losses/chunk_loss.h"
#include "proto/loss.pb.h"

namespace dflash {

// One chunk through CudaChunkLoss with host tensors: copies them to the
// device, runs, and copies the gradient and outputs back. The drop-in twin
// of ChunkLoss, for tests (not for speed).
template <typename T>
absl::StatusOr<ChunkTerms> CudaChunkLossFromHost(
    const v1::LossConfig& config, const ChunkLossOptions& options,
    const ChunkLossInputs<T>& inputs, const ChunkLossOutputs& outputs,
    CudaStream& stream);

}  // namespace dflash

#endif  // DFLASH_LOSSES_CUDA_CHUNK_LOSS_FROM_HOST_H_
