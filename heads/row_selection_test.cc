// head.row_selection on the CPU and the plans it gives: a CPU head refuses
// ALL_ROWS (validation, naming the field) and device rows; PlanAllRows
// plans every row from the count alone. The CUDA head's ALL_ROWS runs are
// checked by //tests:cuda_device_rows_test.
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/tracking_allocator.h"
#include "gtest/gtest.h"
#include "heads/cpu_head.h"
#include "heads/head_plan.h"
#include "proto/config.h"

namespace dflash {
namespace {

std::string Config(const std::string& head) {
  return absl::StrCat(
      "layout { block_size: 4 num_anchors: 3 } chunking { blocks_per_chunk: "
      "2 } head { vocab_size: 11 hidden_size: 8 dtype: FLOAT64 threads: 1 ",
      head, " } loss { dflash {} }");
}

TEST(RowSelectionTest, CpuHeadRefusesAllRows) {
  absl::StatusOr<v1::ObjectiveConfig> config =
      LoadObjectiveConfigFromString(Config("row_selection: ALL_ROWS"));
  ASSERT_FALSE(config.ok());
  EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(config.status().message().find(
                "head.row_selection: ALL_ROWS is CUDA only"),
            std::string::npos)
      << config.status();
}

TEST(RowSelectionTest, RefusesUnspecified) {
  absl::StatusOr<v1::ObjectiveConfig> config = LoadObjectiveConfigFromString(
      Config("row_selection: ROW_SELECTION_UNSPECIFIED"));
  ASSERT_FALSE(config.ok());
  EXPECT_NE(config.status().message().find(
                "head.row_selection: must be set, got "
                "ROW_SELECTION_UNSPECIFIED"),
            std::string::npos)
      << config.status();
}

TEST(RowSelectionTest, DefaultsToCompact) {
  absl::StatusOr<v1::ObjectiveConfig> config =
      LoadObjectiveConfigFromString(Config(""));
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->head().row_selection(), v1::HeadConfig::COMPACT);
  // CUDA takes ALL_ROWS.
  absl::StatusOr<v1::ObjectiveConfig> cuda = LoadObjectiveConfigFromString(
      absl::StrCat("layout { block_size: 4 num_anchors: 3 } chunking { "
                   "blocks_per_chunk: 2 } head { vocab_size: 11 hidden_size: "
                   "8 backend: CUDA row_selection: ALL_ROWS } loss { dflash "
                   "{} }"));
  EXPECT_TRUE(cuda.ok()) << cuda.status();
}

TEST(RowSelectionTest, CpuHeadRefusesDeviceRows) {
  absl::StatusOr<v1::ObjectiveConfig> config =
      LoadObjectiveConfigFromString(Config(""));
  ASSERT_TRUE(config.ok()) << config.status();
  const int64_t rows = 24;
  std::vector<double> hidden(rows * 8, 0.5), weight(11 * 8, 0.25);
  std::vector<double> grad_hidden(hidden.size()), grad_weight(weight.size());
  HeadInputs<double> inputs;
  inputs.hidden = hidden;
  inputs.weight = weight;
  // Not dereferenced: the CPU head refuses device rows before reading any.
  static const RowMeta kNowhere[1] = {};
  static const unsigned long long kNoError = ~0ull;
  inputs.device_rows = {kNowhere, rows, &kNoError};
  TrackingAllocator allocator;
  absl::StatusOr<HeadResult> result = RunHead<double>(
      *config, inputs,
      {absl::MakeSpan(grad_hidden), absl::MakeSpan(grad_weight)}, allocator);
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(result.status().message().find("inputs.device_rows"),
            std::string::npos)
      << result.status();
}

TEST(RowSelectionTest, AllRowsPlansEveryRowFromTheCount) {
  for (const char* mode : {"FUSED", "CHECKPOINT", "MATERIALIZE"}) {
    SCOPED_TRACE(mode);
    absl::StatusOr<v1::ObjectiveConfig> config = LoadObjectiveConfigFromString(
        absl::StrCat("layout { block_size: 4 num_anchors: 3 } chunking { "
                     "blocks_per_chunk: 2 } head { vocab_size: 11 "
                     "hidden_size: 8 backend: CUDA row_selection: ALL_ROWS "
                     "mode: ",
                     mode, " } loss { dflash {} }"));
    ASSERT_TRUE(config.ok()) << config.status();
    absl::StatusOr<HeadPlan> plan = PlanAllRows(*config, 24, 4);
    ASSERT_TRUE(plan.ok()) << plan.status();
    std::vector<int64_t> all(24);
    for (int64_t r = 0; r < 24; ++r) all[r] = r;
    EXPECT_EQ(plan->active, all);
    const bool one_chunk = std::string(mode) == "MATERIALIZE";
    ASSERT_EQ(plan->chunks.chunks.size(), one_chunk ? 1u : 3u);
    for (size_t c = 0; c < plan->chunks.chunks.size(); ++c) {
      EXPECT_EQ(plan->chunk_begin[c], plan->chunks.chunks[c].begin);
    }
    EXPECT_EQ(plan->chunk_begin.back(), 24);
    EXPECT_EQ(plan->max_chunk_rows, one_chunk ? 24 : 8);
    // PlanHead gives the same plan, whatever the rows say.
    std::vector<RowMeta> rows(24);
    absl::StatusOr<HeadPlan> planned = PlanHead(*config, rows, 4);
    ASSERT_TRUE(planned.ok()) << planned.status();
    EXPECT_EQ(planned->active, all);
  }
}

}  // namespace
}  // namespace dflash
