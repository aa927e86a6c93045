#ifndef DFLASH_CHUNKING_CHUNKING_POLICY_H_
#define DFLASH_CHUNKING_CHUNKING_POLICY_H_

// ChunkingOptionsFromPolicy reads a chunk plan's options from the protobuf
// policy (v1::ChunkingPolicy), for code that is given a config;
// //chunking:chunk_plan itself needs no protobuf.

#include "chunking/chunk_plan.h"
#include "proto/chunking.pb.h"

namespace dflash {

ChunkingOptions ChunkingOptionsFromPolicy(const v1::ChunkingPolicy& policy);

}  // namespace dflash

#endif  // DFLASH_CHUNKING_CHUNKING_POLICY_H_
