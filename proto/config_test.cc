#include "proto/config.h"

#include <string>

#include "google/protobuf/util/message_differencer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dflash {
namespace {

using ::google::protobuf::util::MessageDifferencer;
using ::testing::HasSubstr;

constexpr char kMinimal[] =
    "head { vocab_size: 100 hidden_size: 8 } loss { dflash {} }";

class ShippedConfigTest : public ::testing::TestWithParam<std::string> {};

TEST_P(ShippedConfigTest, LoadsValidatesAndRoundTrips) {
  absl::StatusOr<v1::ObjectiveConfig> config =
      LoadObjectiveConfigFromFile("configs/" + GetParam());
  ASSERT_TRUE(config.ok()) << config.status();
  absl::StatusOr<v1::ObjectiveConfig> again =
      LoadObjectiveConfigFromString(ToTextFormat(*config));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(MessageDifferencer::Equals(*config, *again))
      << ToTextFormat(*config) << "\nvs\n" << ToTextFormat(*again);
}

INSTANTIATE_TEST_SUITE_P(Configs, ShippedConfigTest,
                         ::testing::Values("dflash_default.textproto",
                                           "specforge_checkpoint.textproto",
                                           "selective_frozen_projection.textproto",
                                           "fused_budget.textproto"));

TEST(ConfigTest, DflashDefaultHasTheDocumentedPolicy) {
  absl::StatusOr<v1::ObjectiveConfig> config =
      LoadObjectiveConfigFromFile("configs/dflash_default.textproto");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->loss().dflash().gamma(), 7.0);
  EXPECT_EQ(config->chunking().blocks_per_chunk(), 128);
  EXPECT_EQ(config->layout().block_size(), 16);
  EXPECT_EQ(config->head().mode(), v1::HeadConfig::FUSED);
  EXPECT_FALSE(config->head().trainable());
}

TEST(ConfigTest, DefaultsAreWrittenOut) {
  absl::StatusOr<v1::ObjectiveConfig> config =
      LoadObjectiveConfigFromString(kMinimal);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_TRUE(config->layout().has_block_size());
  EXPECT_EQ(config->layout().block_size(), 16);
  EXPECT_EQ(config->layout().num_anchors(), 512);
  EXPECT_EQ(config->chunking().blocks_per_chunk(), 128);
  EXPECT_TRUE(config->chunking().has_align_to_blocks());
  EXPECT_TRUE(config->chunking().align_to_blocks());
  EXPECT_EQ(config->checkpoint().segment_chunks(), 1);
  EXPECT_FALSE(config->checkpoint().has_memory_budget_bytes());
  EXPECT_EQ(config->checkpoint().default_action(), v1::PREFER_RECOMPUTE);
  EXPECT_EQ(config->head().dtype(), v1::HeadConfig::FLOAT32);
  EXPECT_EQ(config->head().backend(), v1::HeadConfig::CPU);
  EXPECT_EQ(config->head().mode(), v1::HeadConfig::FUSED);
  EXPECT_TRUE(config->head().has_logit_scale());
  EXPECT_FALSE(config->head().has_logit_softcap());
  EXPECT_EQ(config->loss().cross_entropy().ignore_index(), -100);
  // gamma has no default: absent means "no decay", unlike 0 written out.
  EXPECT_FALSE(config->loss().dflash().has_gamma());
  EXPECT_FALSE(config->loss().has_dpace());
}

TEST(ConfigTest, ExplicitValuesSurviveDefaults) {
  absl::StatusOr<v1::ObjectiveConfig> config = LoadObjectiveConfigFromString(
      "layout { block_size: 4 } chunking { rows_per_chunk: 12 } "
      "head { vocab_size: 100 hidden_size: 8 mode: CHECKPOINT } "
      "loss { dpace { alpha: 0.25 } }");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->layout().block_size(), 4);
  EXPECT_EQ(config->chunking().rows_per_chunk(), 12);
  EXPECT_FALSE(config->chunking().has_blocks_per_chunk());
  EXPECT_EQ(config->head().mode(), v1::HeadConfig::CHECKPOINT);
  EXPECT_EQ(config->loss().dpace().alpha(), 0.25);
  EXPECT_EQ(config->loss().dpace().variant(), v1::DPaceLoss::DPACE);
}

TEST(ConfigTest, SelectivePresetKeepsFrozenProjections) {
  const auto rules =
      PresetRules(v1::CheckpointPolicy::SELECTIVE_FROZEN_PROJECTION);
  ASSERT_EQ(rules.size(), 3u);
  EXPECT_EQ(rules[0].action(), v1::MUST_SAVE);
  EXPECT_EQ(rules[0].kind(), v1::PROJECTION);
  EXPECT_TRUE(rules[0].weight_frozen());
  EXPECT_FALSE(rules[0].input_requires_grad());
  EXPECT_EQ(rules[1].action(), v1::PREFER_SAVE);
  EXPECT_FALSE(rules[1].has_input_requires_grad());
  EXPECT_EQ(rules[2].action(), v1::MUST_RECOMPUTE);
  EXPECT_FALSE(rules[2].has_kind());
  EXPECT_EQ(PresetRules(v1::CheckpointPolicy::SAVE_ALL)[0].action(),
            v1::MUST_SAVE);
  EXPECT_EQ(PresetRules(v1::CheckpointPolicy::FULL_RECOMPUTE)[0].action(),
            v1::MUST_RECOMPUTE);
}

TEST(ConfigTest, MissingFileIsNotFound) {
  absl::StatusOr<v1::ObjectiveConfig> config =
      LoadObjectiveConfigFromFile("configs/no_such_file.textproto");
  EXPECT_EQ(config.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(config.status().message(),
            "config file configs/no_such_file.textproto: cannot open: No such "
            "file or directory");
}

// A directory, FIFO or device is refused before it is read (a FIFO would
// block the reader forever).
TEST(ConfigTest, OnlyRegularFilesAreLoaded) {
  EXPECT_EQ(LoadObjectiveConfigFromFile("configs").status().message(),
            "config file configs: is a directory, expected a regular file");
  EXPECT_EQ(LoadObjectiveConfigFromFile("/dev/zero").status().message(),
            "config file /dev/zero: is a character device, expected a regular "
            "file");
}

TEST(ConfigTest, ProblemsAreAllReported) {
  absl::StatusOr<v1::ObjectiveConfig> config = LoadObjectiveConfigFromString(
      "head { vocab_size: -1 hidden_size: 0 } loss { dflash { gamma: -2 } }",
      "two.textproto");
  ASSERT_FALSE(config.ok());
  EXPECT_THAT(config.status().message(), HasSubstr("two.textproto"));
  EXPECT_THAT(config.status().message(), HasSubstr("head.vocab_size"));
  EXPECT_THAT(config.status().message(),
              HasSubstr("head.hidden_size: must lie in [1, 2147483647] (the GEMMs take int32 sizes), got 0"));
  EXPECT_THAT(config.status().message(),
              HasSubstr("loss.dflash.gamma: must be >= 0, got -2"));
}

struct BadConfig {
  std::string name;
  std::string text;
  std::string message;
};

class BadConfigTest : public ::testing::TestWithParam<BadConfig> {};

TEST_P(BadConfigTest, IsRejectedWithItsMessage) {
  absl::StatusOr<v1::ObjectiveConfig> config =
      LoadObjectiveConfigFromString(GetParam().text, "bad.textproto");
  ASSERT_FALSE(config.ok()) << ToTextFormat(*config);
  EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(config.status().message(), HasSubstr(GetParam().message));
}

const std::string kHead = "head { vocab_size: 100 hidden_size: 8 } ";
const std::string kLoss = "loss { dflash {} } ";

INSTANTIATE_TEST_SUITE_P(
    Rejected, BadConfigTest,
    ::testing::Values(
        BadConfig{"NegativeRowsPerChunk",
                  "chunking { rows_per_chunk: -3 } " + kHead + kLoss,
                  "chunking.rows_per_chunk: must be > 0, got -3"},
        BadConfig{"RowsNotBlockAligned",
                  "chunking { rows_per_chunk: 20 } " + kHead + kLoss,
                  "chunking.rows_per_chunk: must be a multiple of "
                  "layout.block_size (16) when chunking.align_to_blocks is "
                  "true, got 20"},
        BadConfig{"ZeroBlocksPerChunk",
                  "chunking { blocks_per_chunk: 0 } " + kHead + kLoss,
                  "chunking.blocks_per_chunk: must be > 0, got 0"},
        BadConfig{"BudgetBelowOneBlock",
                  "chunking { logits_budget_bytes: 1000 } " + kHead + kLoss,
                  "chunking.logits_budget_bytes: must hold one block (16 rows "
                  "x 100 vocab x 4 bytes x 1 buffer(s) = 6400 bytes), got "
                  "1000"},
        BadConfig{"ZeroBlockSize", "layout { block_size: 0 } " + kHead + kLoss,
                  "layout.block_size: must be > 0, got 0"},
        BadConfig{"NegativeSegment",
                  "checkpoint { segment_chunks: -1 } " + kHead + kLoss,
                  "checkpoint.segment_chunks: must be >= 0, got -1"},
        BadConfig{"PreferSaveWithZeroBudget",
                  "checkpoint { memory_budget_bytes: 0 rules { kind: "
                  "PROJECTION action: PREFER_SAVE } } " +
                      kHead + kLoss,
                  "checkpoint.memory_budget_bytes: is 0, so PREFER_SAVE in "
                  "checkpoint.rules[0] could never save"},
        BadConfig{"SelectivePresetWithZeroBudget",
                  "checkpoint { preset: SELECTIVE_FROZEN_PROJECTION "
                  "memory_budget_bytes: 0 } " +
                      kHead + kLoss,
                  "PREFER_SAVE in checkpoint.preset "
                  "SELECTIVE_FROZEN_PROJECTION rule[1] could never save"},
        BadConfig{"RuleWithoutAction",
                  "checkpoint { rules { kind: PROJECTION } } " + kHead + kLoss,
                  "checkpoint.rules[0].action: must be set, got "
                  "ACTION_UNSPECIFIED"},
        BadConfig{"PresetAndRules",
                  "checkpoint { preset: SAVE_ALL rules { action: MUST_SAVE } "
                  "} " +
                      kHead + kLoss,
                  "checkpoint.rules: must be empty when checkpoint.preset is "
                  "set, got 1 rule(s) with preset SAVE_ALL"},
        BadConfig{"NeverRecomputeButMustRecompute",
                  "checkpoint { preset: FULL_RECOMPUTE segment_chunks: 0 } " +
                      kHead + kLoss,
                  "checkpoint.segment_chunks: 0 (never recompute) contradicts "
                  "MUST_RECOMPUTE in checkpoint.preset FULL_RECOMPUTE "
                  "rule[0], got 0"},
        BadConfig{"NegativeBudget",
                  "checkpoint { memory_budget_bytes: -5 } " + kHead + kLoss,
                  "checkpoint.memory_budget_bytes: must be >= 0, got -5"},
        BadConfig{"MissingVocab", "head { hidden_size: 8 } " + kLoss,
                  "head.vocab_size: is required"},
        BadConfig{"VocabTooLarge",
                  "head { vocab_size: 3000000000 hidden_size: 8 } " + kLoss,
                  "head.vocab_size: must lie in [1, 2147483647] (target ids "
                  "are int32), got 3000000000"},
        BadConfig{"NegativeSoftcap",
                  "head { vocab_size: 100 hidden_size: 8 logit_softcap: -1 } " +
                      kLoss,
                  "head.logit_softcap: must be >= 0, got -1"},
        BadConfig{
            "ZeroLogitScale",
            "head { vocab_size: 100 hidden_size: 8 logit_scale: 0 } " + kLoss,
            "head.logit_scale: must be > 0, got 0"},
        BadConfig{"Float64OnCuda",
                  "head { vocab_size: 100 hidden_size: 8 backend: CUDA dtype: "
                  "FLOAT64 } " +
                      kLoss,
                  "head.dtype: FLOAT64 is not supported on the CUDA backend"},
        BadConfig{
            "BFloat16OnCpu",
            "head { vocab_size: 100 hidden_size: 8 dtype: BFLOAT16 } " + kLoss,
            "head.dtype: BFLOAT16 is not supported on the CPU backend "
            "(FLOAT32 or FLOAT64), got BFLOAT16"},
        BadConfig{
            "SelectiveWithoutPolicy",
            "head { vocab_size: 100 hidden_size: 8 mode: SELECTIVE } " + kLoss,
            "head.mode: SELECTIVE needs checkpoint.preset or "
            "checkpoint.rules"},
        BadConfig{"DpaceAlphaAboveOne", kHead + "loss { dpace { alpha: 1.5 } }",
                  "loss.dpace.alpha: must lie in [0, 1], got 1.5"},
        BadConfig{"DpaceAlphaNaN", kHead + "loss { dpace { alpha: nan } }",
                  "loss.dpace.alpha: must lie in [0, 1], got nan"},
        BadConfig{"DpaceWithoutBlockAlignment",
                  "chunking { rows_per_chunk: 5 align_to_blocks: false } " +
                      kHead + "loss { dpace {} }",
                  "chunking.align_to_blocks: must be true for loss.dpace"},
        BadConfig{"LkLambdaWithoutBlockAlignment",
                  "chunking { rows_per_chunk: 5 align_to_blocks: false } " +
                      kHead + "loss { lk_lambda {} }",
                  "chunking.align_to_blocks: must be true for loss.lk_lambda"},
        BadConfig{"LkTypeUnspecified",
                  kHead + "loss { dflash { lk { type: TYPE_UNSPECIFIED } } }",
                  "loss.dflash.lk.type: must be set, got TYPE_UNSPECIFIED"},
        BadConfig{"LkNegativeKlScale",
                  kHead + "loss { dpace { lk { type: LAMBDA kl_scale: -1 } } }",
                  "loss.dpace.lk.kl_scale: must be >= 0, got -1"},
        BadConfig{
            "LkNegativeKlDecay",
            kHead + "loss { dflash { lk { type: LAMBDA kl_decay: -2 } } }",
            "loss.dflash.lk.kl_decay: must be >= 0, got -2"},
        BadConfig{"LkTvWithLabelSmoothing",
                  kHead + "loss { dflash { lk { type: TV } } cross_entropy { "
                          "label_smoothing: 0.1 } }",
                  "loss.cross_entropy.label_smoothing: does not apply with "
                  "loss.dflash.lk.type TV (the LK composition is defined on "
                  "plain cross-entropy), got 0.1"},
        BadConfig{"LkLambdaWithLabelSmoothing",
                  kHead + "loss { dpace { lk { type: LAMBDA } } cross_entropy "
                          "{ label_smoothing: 0.2 } }",
                  "loss.cross_entropy.label_smoothing: does not apply with "
                  "loss.dpace.lk.type LAMBDA"},
        BadConfig{"LkLambdaWithZLoss",
                  kHead + "loss { dflash { lk { type: LAMBDA } } cross_entropy "
                          "{ z_loss_scale: 0.1 } }",
                  "loss.cross_entropy.z_loss_scale: does not apply with "
                  "loss.dflash.lk.type LAMBDA"},
        BadConfig{"LkLambdaTrainable",
                  "head { vocab_size: 100 hidden_size: 8 trainable: true } "
                  "loss { dflash { lk { type: LAMBDA } } }",
                  "head.trainable: must be false with an lk composition of "
                  "type LAMBDA"},
        BadConfig{"TeacherDiagnosticsWithATeacherLoss",
                  "head { vocab_size: 100 hidden_size: 8 teacher_diagnostics: "
                  "true } loss { distillation {} }",
                  "head.teacher_diagnostics: applies to losses that read no "
                  "teacher; loss.distillation projects the teacher already, "
                  "got true"},
        BadConfig{"DPardWithCrossEntropy",
                  kHead + "layout { num_anchors: 4 } loss { dspark { "
                          "objective: DPARD ce_weight: 0.1 l1_weight: 0 } }",
                  "loss.dspark.ce_weight: must be 0 with objective DPARD "
                  "(D-PARD replaces CE and L1), got 0.1"},
        BadConfig{"DPardWithDefaultL1",
                  kHead + "layout { num_anchors: 4 } loss { dspark { "
                          "objective: DPARD ce_weight: 0 } }",
                  "loss.dspark.l1_weight: must be 0 with objective DPARD "
                  "(D-PARD replaces CE and L1), got 0.9"},
        BadConfig{"DPardAlphaOne",
                  kHead + "loss { dspark { dpard_alpha: 1 } }",
                  "loss.dspark.dpard_alpha: must lie in (0, 1), got 1"},
        BadConfig{"DSparkNegativeCeWeight",
                  kHead + "loss { dspark { ce_weight: -1 } }",
                  "loss.dspark.ce_weight: must be >= 0, got -1"},
        BadConfig{"DSparkObjectiveUnspecified",
                  kHead + "loss { dspark { objective: OBJECTIVE_UNSPECIFIED } "
                          "}",
                  "loss.dspark.objective: must be set"},
        BadConfig{"DominoWithoutSuffix",
                  kHead + "layout { block_size: 4 } loss { domino { "
                          "pure_draft_prefix_len: 3 } }",
                  "loss.domino.pure_draft_prefix_len: leaves no corrected "
                  "suffix: suffix_start = 4 must be < layout.block_size = 4, "
                  "got 3"},
        BadConfig{"DominoLambdaAboveOne",
                  kHead + "loss { domino { lambda_base: 1.5 } }",
                  "loss.domino.lambda_base: must lie in [0, 1], got 1.5"},
        BadConfig{"DominoNegativePrefix",
                  kHead + "loss { domino { pure_draft_prefix_len: -1 } }",
                  "loss.domino.pure_draft_prefix_len: must be >= 0, got -1"},
        BadConfig{"DominoZLoss",
                  kHead + "loss { domino {} cross_entropy { z_loss_scale: 0.1 "
                          "} }",
                  "loss.cross_entropy.z_loss_scale: does not apply to "
                  "loss.domino, got 0.1"},
        BadConfig{"DominoLabelSmoothing",
                  kHead + "loss { domino {} cross_entropy { label_smoothing: "
                          "0.1 } }",
                  "loss.cross_entropy.label_smoothing: does not apply to "
                  "loss.domino, got 0.1"},
        BadConfig{"NegativeCorrectionRank",
                  "head { vocab_size: 100 hidden_size: 8 correction_rank: -2 "
                  "} " + kLoss,
                  "head.correction_rank: must be >= 0, got -2"},
        BadConfig{"CorrectionWithBatchLkLambda",
                  "head { vocab_size: 100 hidden_size: 8 correction_rank: 4 } "
                  "loss { dflash { lk { type: LAMBDA } } }",
                  "head.correction_rank: must be 0 with an lk composition of "
                  "type LAMBDA"},
        BadConfig{
            "MetricTopKAbove64",
            "head { vocab_size: 100 hidden_size: 8 metric_top_k: 65 } " + kLoss,
            "head.metric_top_k: must lie in [0, 64], got 65"},
        BadConfig{"NoLossFamily", kHead + "loss { cross_entropy {} }",
                  "loss: one loss family must be set"},
        BadConfig{"UnknownLossType", kHead + "loss { focal {} }",
                  "bad.textproto:1:54: Message type \"dflash.v1.LossConfig\" "
                  "has no field named \"focal\""},
        BadConfig{"LabelSmoothingOne",
                  kHead + "loss { dflash {} cross_entropy { label_smoothing: "
                          "1 } }",
                  "loss.cross_entropy.label_smoothing: must lie in [0, 1), "
                  "got 1"},
        BadConfig{"ZeroTemperature",
                  kHead + "loss { distillation { temperature: 0 } }",
                  "loss.distillation.temperature: must be > 0, got 0"},
        BadConfig{
            "JsdBetaNegative",
            kHead + "loss { distillation { divergence: JSD beta: -0.1 } }",
            "loss.distillation.beta: must lie in (0, 1) for JSD (use "
            "FORWARD_KL or REVERSE_KL for the end points), got -0.1"},
        BadConfig{"JsdBetaOne",
                  kHead + "loss { distillation { divergence: JSD beta: 1 } }",
                  "loss.distillation.beta: must lie in (0, 1) for JSD"},
        BadConfig{"KlBetaAboveOne",
                  kHead + "loss { distillation { beta: 1.5 } }",
                  "loss.distillation.beta: must lie in [0, 1], got 1.5"},
        BadConfig{"LabelSmoothingOnTv",
                  kHead + "loss { tv {} cross_entropy { label_smoothing: "
                          "0.1 } }",
                  "loss.cross_entropy.label_smoothing: applies to "
                  "cross-entropy terms, which loss.tv does not have, got 0.1"},
        BadConfig{"ZLossOnDistillation",
                  kHead + "loss { distillation {} cross_entropy { "
                          "z_loss_scale: 1e-4 } }",
                  "loss.cross_entropy.z_loss_scale: does not apply to "
                  "loss.distillation, got 0.0001"},
        BadConfig{"NegativeKlDecay",
                  kHead + "loss { lk_lambda { kl_decay: -1 } }",
                  "loss.lk_lambda.kl_decay: must be >= 0, got -1"},
        BadConfig{"TeacherBudgetCountsTwoBuffers",
                  "chunking { logits_budget_bytes: 6400 } " + kHead +
                      "loss { dspark {} }",
                  "x 2 buffer(s) = 12800 bytes), got 6400"},
        BadConfig{"SyntaxError", "head { vocab_size: }",
                  "bad.textproto:1:20: Expected integer"}),
    [](const ::testing::TestParamInfo<BadConfig>& info) {
      return info.param.name;
    });

}  // namespace
}  // namespace dflash
