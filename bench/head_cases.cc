#include "bench/head_cases.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "proto/config.h"

namespace dflash {

constexpr int64_t kBlock = 16;

const std::vector<v1::HeadConfig::ExecutionMode>& BenchModes() {
  static const std::vector<v1::HeadConfig::ExecutionMode> modes = {
      v1::HeadConfig::MATERIALIZE, v1::HeadConfig::SAVE_CHUNKS,
      v1::HeadConfig::CHECKPOINT, v1::HeadConfig::SELECTIVE,
      v1::HeadConfig::FUSED};
  return modes;
}

absl::StatusOr<v1::ObjectiveConfig> HeadBenchConfig(
    const HeadShape& shape, v1::HeadConfig::ExecutionMode mode) {
  const std::string checkpoint =
      mode == v1::HeadConfig::SELECTIVE
          ? "checkpoint { preset: SELECTIVE_FROZEN_PROJECTION }"
          : "";
  return LoadObjectiveConfigFromString(absl::StrCat(
      "layout { block_size: ", kBlock, " num_anchors: ", shape.anchors,
      " } chunking { blocks_per_chunk: ", shape.blocks_per_chunk, " } ",
      checkpoint, " head { vocab_size: ", shape.vocab, " hidden_size: ",
      shape.hidden, " mode: ", v1::HeadConfig::ExecutionMode_Name(mode),
      " pack_weight: ", shape.pack_weight ? "true" : "false",
      " threads: ", shape.threads,
      shape.gradient_filter > 0
          ? absl::StrCat(" gradient_filter: ", shape.gradient_filter)
          : "",
      shape.peaked ? " bias: true logit_scale: 2" : "",
      " } loss { dflash { gamma: 7 } }"));
}

absl::StatusOr<HeadBatch<float>> HeadBenchBatch(
    const v1::ObjectiveConfig& config, const HeadShape& shape) {
  // Sequences long enough that every anchor finds a valid position.
  return MakeSyntheticBatch<float>(
      config,
      {1, std::max<int64_t>(8192, 4 * kBlock * shape.anchors), shape.anchors,
       shape.peaked},
      /*seed=*/1);
}

absl::StatusOr<std::unique_ptr<PreparedProjection>> PrepareHeadCase(
    const v1::ObjectiveConfig& config, const HeadBatch<float>& batch) {
  const v1::HeadConfig& head = config.head();
  if (!head.pack_weight() || head.trainable()) {
    return std::unique_ptr<PreparedProjection>();
  }
  const HeadInputs<float> inputs = batch.Inputs(config);
  return PreparedProjection::Create(inputs.weight, inputs.bias,
                                    head.vocab_size(), head.hidden_size(),
                                    head.threads());
}

absl::StatusOr<HeadResult> RunHeadCase(const v1::ObjectiveConfig& config,
                                       const HeadBatch<float>& batch,
                                       TrackingAllocator& allocator,
                                       const PreparedProjection* prepared,
                                       std::vector<float>* grad_hidden) {
  std::vector<float> grad(batch.hidden.size());
  const HeadGradients<float> gradients{absl::MakeSpan(grad), {}, {}, {}};
  HeadOptions options;
  options.prepared_projection = prepared;
  absl::StatusOr<HeadResult> result = RunHead<float>(
      config, batch.Inputs(config), gradients, allocator, {}, options);
  if (grad_hidden != nullptr) *grad_hidden = std::move(grad);
  return result;
}

}  // namespace dflash
