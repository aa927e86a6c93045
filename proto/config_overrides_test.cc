// Overrides by name: what they change, and what they refuse, named as the
// binding's keywords and the command's flags spell them.
#include "proto/config_overrides.h"

#include "absl/status/statusor.h"
#include "configs/default_config.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/config.h"

namespace dflash {
namespace {

using ::testing::HasSubstr;

absl::StatusOr<v1::ObjectiveConfig> Default() {
  return ParseObjectiveConfig(DefaultObjectiveConfigText(),
                              kDefaultConfigSource);
}

TEST(OverridesTest, ChangeTheFamilyKeepingCrossEntropyOptions) {
  absl::StatusOr<v1::ObjectiveConfig> config = Default();
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->loss().dflash().gamma(), 7);
  ConfigOverrides overrides;
  overrides.label_smoothing = 0.1;
  ASSERT_TRUE(ApplyOverrides(overrides, OverrideNames::kKeywords, *config).ok());
  overrides = {};
  overrides.loss = "lk-lambda";
  overrides.gamma = 3;
  overrides.mode = "selective";
  overrides.chunk_blocks = 2;
  overrides.segment_chunks = 4;
  ASSERT_TRUE(ApplyOverrides(overrides, OverrideNames::kKeywords, *config).ok());
  EXPECT_EQ(config->loss().lk_lambda().gamma(), 3);
  EXPECT_EQ(config->loss().cross_entropy().label_smoothing(), 0.1);
  EXPECT_EQ(config->head().mode(), v1::HeadConfig::SELECTIVE);
  EXPECT_EQ(config->checkpoint().preset(),
            v1::CheckpointPolicy::SELECTIVE_FROZEN_PROJECTION);
  EXPECT_EQ(config->chunking().blocks_per_chunk(), 2);
  EXPECT_EQ(config->checkpoint().segment_chunks(), 4);
}

// SpecForge's lk_loss_type, kl_scale and kl_decay, on dflash and dpace only.
TEST(OverridesTest, LkCompositionAsSpecForgeNamesIt) {
  absl::StatusOr<v1::ObjectiveConfig> config = Default();
  ASSERT_TRUE(config.ok()) << config.status();
  ConfigOverrides overrides;
  overrides.loss = "dpace";
  overrides.lk = "lambda";
  overrides.kl_scale = 0.5;
  overrides.kl_decay = 3;
  ASSERT_TRUE(ApplyOverrides(overrides, OverrideNames::kKeywords, *config).ok());
  const v1::LkComposition& lk = config->loss().dpace().lk();
  EXPECT_EQ(lk.type(), v1::LkComposition::LAMBDA);
  EXPECT_EQ(lk.kl_scale(), 0.5);
  EXPECT_EQ(lk.kl_decay(), 3);
  overrides = {};
  overrides.lk = "tv";
  ASSERT_TRUE(ApplyOverrides(overrides, OverrideNames::kKeywords, *config).ok());
  EXPECT_EQ(config->loss().dpace().lk().type(), v1::LkComposition::TV);

  overrides = {};
  overrides.lk = "beta";
  EXPECT_EQ(ApplyOverrides(overrides, OverrideNames::kKeywords, *config).message(),
            "lk_loss_type: must be one of alpha, tv, lambda, got 'beta'");
  overrides = {};
  overrides.kl_scale = 2;
  EXPECT_EQ(ApplyOverrides(overrides, OverrideNames::kKeywords, *config).message(),
            "kl_scale, kl_decay: set with lk_loss_type='lambda', got no "
            "lk_loss_type");
  overrides = {};
  overrides.loss = "kl";
  overrides.lk = "tv";
  EXPECT_EQ(ApplyOverrides(overrides, OverrideNames::kKeywords, *config).message(),
            "lk_loss_type: applies to the dflash and dpace loss families, got "
            "distillation");
}

TEST(OverridesTest, UnknownNamesAndDPaceGammaAreErrors) {
  v1::ObjectiveConfig config;
  ConfigOverrides overrides;
  overrides.loss = "ce";
  EXPECT_THAT(ApplyOverrides(overrides, OverrideNames::kKeywords, config).message(),
              HasSubstr("loss_type: must be one of dflash, dpace"));
  overrides.loss = "dpace";
  overrides.gamma = 7;
  EXPECT_EQ(ApplyOverrides(overrides, OverrideNames::kKeywords, config).message(),
            "gamma: D-PACE has no decay, got 7");
  overrides = {};
  overrides.mode = "eager";
  EXPECT_THAT(ApplyOverrides(overrides, OverrideNames::kKeywords, config).message(),
              HasSubstr("mode: must be one of materialize, save, checkpoint, "
                        "selective, fused, got 'eager'"));
}

TEST(OverridesTest, FlagsNameTheFlag) {
  v1::ObjectiveConfig config;
  ConfigOverrides overrides;
  overrides.loss = "ce";
  EXPECT_THAT(ApplyOverrides(overrides, OverrideNames::kFlags, config).message(),
              HasSubstr("--loss: must be one of dflash, dpace"));
  overrides = {};
  overrides.chunk_blocks = 0;
  EXPECT_EQ(ApplyOverrides(overrides, OverrideNames::kFlags, config).message(),
            "--chunk_blocks: must be > 0 (chunking.blocks_per_chunk), got 0");
  overrides = {};
  overrides.threads = 5000;
  EXPECT_EQ(ApplyOverrides(overrides, OverrideNames::kFlags, config).message(),
            "--threads: must lie in [0, 1024] (0: every usable CPU), got 5000");
  overrides = {};
  overrides.kl_decay = 2;
  EXPECT_EQ(ApplyOverrides(overrides, OverrideNames::kFlags, config).message(),
            "--kl_scale, --kl_decay: set with --lk=lambda, got no --lk");
  overrides = {};
  overrides.gamma = -1;
  EXPECT_EQ(ApplyOverrides(overrides, OverrideNames::kFlags, config).message(),
            "--gamma: must be finite and >= 0 (the loss family's gamma), got -1");
}

}  // namespace
}  // namespace dflash
