#ifndef DFLASH_HEADS_CPU_HEAD_BACKEND_H_
#define DFLASH_HEADS_CPU_HEAD_BACKEND_H_

// The CPU head's backend (internal to //heads:cpu_head).

#include <memory>

#include "base/tracking_allocator.h"
#include "heads/head_backend.h"
#include "proto/objective.pb.h"

namespace dflash {

// The CPU backend for one objective: CBLAS projection, ChunkLoss split over
// head.threads at block boundaries, host memory from `allocator`.
template <typename T>
std::unique_ptr<HeadBackend<T>> CreateCpuHeadBackend(
    const v1::ObjectiveConfig& config, TrackingAllocator& allocator);

}  // namespace dflash

#endif  // DFLASH_HEADS_CPU_HEAD_BACKEND_H_
