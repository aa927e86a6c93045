#include "tests/specforge_golden.h"

#include <algorithm>
#include <cmath>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "io/npy.h"
#include "losses/batch_layout.h"
#include "losses/loss_family.h"
#include "proto/config.h"

namespace dflash {
namespace {

NpyArray Read(const std::string& dir, const std::string& name) {
  absl::StatusOr<NpyArray> array = ReadNpy(absl::StrCat(dir, "/", name, ".npy"));
  EXPECT_TRUE(array.ok()) << array.status();
  return array.ok() ? *std::move(array) : NpyArray{};
}

std::vector<uint8_t> ToBytes(const NpyArray& array) {
  std::vector<uint8_t> out;
  for (int64_t v : NpyToInt64(array)) out.push_back(static_cast<uint8_t>(v));
  return out;
}

}  // namespace

std::vector<double> ReadGoldenValues(const std::string& dir,
                                     const std::string& name) {
  return NpyToFloat64(Read(dir, name));
}

std::vector<double> ReadOptionalGoldenValues(const std::string& dir,
                                             const std::string& name) {
  if (!std::filesystem::exists(absl::StrCat(dir, "/", name, ".npy"))) {
    return {};
  }
  return ReadGoldenValues(dir, name);
}

SpecForgeBatch LoadSpecForgeBatch(const std::string& dir) {
  SpecForgeBatch g;
  g.name = std::filesystem::path(dir).filename().string();
  absl::StatusOr<v1::ObjectiveConfig> config =
      LoadObjectiveConfigFromFile(dir + "/config.textproto");
  EXPECT_TRUE(config.ok()) << config.status();
  if (config.ok()) g.config = *config;
  const NpyArray ids = Read(dir, "input_ids");
  const NpyArray anchors = Read(dir, "anchors");
  if (ids.shape.size() == 2 && anchors.shape.size() == 2) {
    g.batch = ids.shape[0];
    g.seq_len = ids.shape[1];
    g.num_anchors = anchors.shape[1];
  }
  g.input_ids = NpyToInt64(ids);
  g.anchors = NpyToInt64(anchors);
  g.loss_mask = ToBytes(Read(dir, "loss_mask"));
  g.keep = ToBytes(Read(dir, "keep"));
  g.hidden = ReadGoldenValues(dir, "hidden");
  g.weight = ReadGoldenValues(dir, "weight");
  g.grad_hidden = ReadGoldenValues(dir, "grad_hidden");
  return g;
}

double SpecForgeTolerance(const v1::ObjectiveConfig& config) {
  return LossParamsOf(config.loss()).gamma > 0 ? 3e-7 : 1e-12;
}

void ExpectNear(double actual, double expected, double tolerance,
                const std::string& what) {
  EXPECT_NEAR(actual, expected, tolerance * std::max(1.0, std::abs(expected)))
      << what;
}

absl::StatusOr<std::vector<RowMeta>> LabelSpecForgeBatch(
    const SpecForgeBatch& g, const v1::ObjectiveConfig& config) {
  const TokenBatch tokens{g.batch, g.seq_len, g.input_ids, g.loss_mask};
  return LabelRows(tokens, g.anchors, g.keep, g.num_anchors,
                   config.layout().block_size(), config.head().vocab_size(),
                   LossTraitsOf(config.loss()).labeling);
}

std::vector<SpecForgeMainGolden> LoadSpecForgeMainGoldens(
    const std::string& dir) {
  std::vector<SpecForgeMainGolden> goldens;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (!entry.is_directory()) continue;
    const std::string d = entry.path().string();
    SpecForgeMainGolden g;
    g.name = entry.path().filename().string();
    absl::StatusOr<v1::ObjectiveConfig> config =
        LoadObjectiveConfigFromFile(d + "/config.textproto");
    EXPECT_TRUE(config.ok()) << config.status();
    if (config.ok()) g.config = *config;
    const std::vector<int64_t> targets = NpyToInt64(Read(d, "target_ids"));
    const std::vector<double> mask = ReadGoldenValues(d, "weight_mask");
    EXPECT_EQ(targets.size(), mask.size()) << d;
    const int64_t k = std::max<int64_t>(g.config.layout().block_size(), 1);
    for (size_t r = 0; r < targets.size() && r < mask.size(); ++r) {
      RowMeta meta;
      meta.target = static_cast<int32_t>(targets[r]);
      meta.position = static_cast<int32_t>(static_cast<int64_t>(r) % k);
      meta.mask = static_cast<float>(mask[r]);
      meta.block = static_cast<int64_t>(r) / k;
      g.rows.push_back(meta);
    }
    g.hidden = ReadGoldenValues(d, "hidden");
    g.weight = ReadGoldenValues(d, "weight");
    g.terms = ReadGoldenValues(d, "terms");
    g.grad_hidden = ReadGoldenValues(d, "grad_hidden");
    g.loss_weight = ReadOptionalGoldenValues(d, "loss_weight");
    goldens.push_back(std::move(g));
  }
  return goldens;
}

}  // namespace dflash
