// Fuzzes the text-format policy loader and validator: any text is parsed or
// rejected with a message; a config that validates can always be planned,
// opens a checkpoint context, and survives a text round trip unchanged.
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>

#include "base/tracking_allocator.h"
#include "checkpoint/checkpoint_context.h"
#include "checkpoint/checkpoint_policy.h"
#include "chunking/chunk_plan.h"
#include "chunking/chunking_policy.h"
#include "fuzz/fuzz_input.h"
#include "heads/config/head_facts.h"
#include "losses/loss_family.h"
#include "proto/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace dflash;  // NOLINT
  const std::string text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<v1::ObjectiveConfig> parsed = ParseObjectiveConfig(text);
  if (!parsed.ok()) {
    FUZZ_CHECK(!parsed.status().message().empty(), "an empty parse error");
    return 0;
  }
  const v1::ObjectiveConfig config = ResolveDefaults(*parsed);
  const absl::Status valid = ValidateObjectiveConfig(config);
  if (!valid.ok()) {
    FUZZ_CHECK(!valid.message().empty(), "an empty validation error");
    return 0;
  }
  absl::StatusOr<v1::ObjectiveConfig> again =
      ParseObjectiveConfig(ToTextFormat(config));
  FUZZ_CHECK(
      again.ok() && again->SerializeAsString() == config.SerializeAsString(),
      "text round trip changed a valid config");

  TrackingAllocator allocator;
  absl::StatusOr<std::unique_ptr<CheckpointContext>> context =
      CheckpointContext::Create(
          CheckpointOptionsFromPolicy(config.checkpoint()), allocator);
  FUZZ_CHECK(context.ok(), "a valid config's checkpoint policy failed: %s",
             std::string(context.status().message()).c_str());

  const int64_t block = config.layout().block_size();
  const int64_t anchors = config.layout().num_anchors();
  const int64_t vocab = config.head().vocab_size();
  const int64_t buffers = LogitsBuffers(config);
  // Sizes whose products stay within 64 bits must plan.
  constexpr int64_t kLimit = int64_t{1} << 30;
  if (block <= kLimit && anchors <= kLimit && vocab <= kLimit) {
    absl::StatusOr<ChunkPlan> plan = PlanChunks(
        ChunkingOptionsFromPolicy(config.chunking()), {anchors * block, block, vocab,
                            BytesPerLogit(config.head().dtype()), buffers});
    FUZZ_CHECK(plan.ok(), "a valid config failed to plan: %s",
               std::string(plan.status().message()).c_str());
  }
  return 0;
}
