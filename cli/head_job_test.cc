#include "cli/head_job.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "io/npy.h"
#include "proto/metrics.pb.h"

namespace dflash {
namespace {

std::string TempDir(const std::string& name) {
  const char* root = std::getenv("TEST_TMPDIR");
  const std::string dir = std::string(root ? root : "/tmp") + "/" + name;
  std::string command = "mkdir -p " + dir;
  EXPECT_EQ(std::system(command.c_str()), 0);
  return dir;
}

HeadJobOptions Small(const std::string& loss) {
  HeadJobOptions options;
  options.loss = loss;
  options.shape = {2, 64, 5};
  options.block = 4;
  options.hidden = 16;
  options.vocab = 97;
  options.chunk_blocks = 3;
  options.threads = 1;
  options.seed = 5;
  return options;
}

// The --inputs path reproduces the in-process run of the same batch, and
// the outputs are what the report says.
TEST(HeadJobTest, InputsFromNpyReproduceTheInProcessRun) {
  for (const char* loss : {"dflash", "dspark", "jsd"}) {
    SCOPED_TRACE(loss);
    const HeadJobOptions options = Small(loss);
    auto config = JobConfig(options);
    ASSERT_TRUE(config.ok()) << config.status();
    auto batch = MakeSyntheticBatch<float>(*config, options.shape, options.seed);
    ASSERT_TRUE(batch.ok());
    const std::string dir = TempDir(std::string("inputs_") + loss);
    ASSERT_TRUE(SaveInputs(*batch, *config, 2, 64, dir).ok());

    std::ostringstream report;
    auto direct = RunHeadJob(options, report);
    ASSERT_TRUE(direct.ok()) << direct.status();
    HeadJobOptions from_files = options;
    from_files.inputs_dir = dir;
    from_files.out_dir = TempDir(std::string("out_") + loss);
    auto loaded = RunHeadJob(from_files, report);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    EXPECT_EQ(loaded->metrics.loss(), direct->metrics.loss());
    EXPECT_EQ(loaded->metrics.accuracy(), direct->metrics.accuracy());
    EXPECT_EQ(loaded->grad_hidden, direct->grad_hidden);
    EXPECT_GT(direct->metrics.loss(), 0);

    std::ifstream json_file(from_files.out_dir + "/metrics.json");
    std::stringstream json;
    json << json_file.rdbuf();
    v1::HeadMetrics parsed;
    ASSERT_TRUE(
        google::protobuf::util::JsonStringToMessage(json.str(), &parsed).ok())
        << json.str();
    EXPECT_EQ(parsed.loss(), loaded->metrics.loss());
    EXPECT_EQ(parsed.mode(), "FUSED");
    EXPECT_EQ(parsed.accuracy_per_position_size(), 4);
    EXPECT_GT(parsed.peak_bytes(), 0);
    EXPECT_DOUBLE_EQ(parsed.gemms(), std::string(loss) == "dflash" ? 2 : 3);
    auto grad = ReadNpy(from_files.out_dir + "/grad_hidden.npy");
    ASSERT_TRUE(grad.ok()) << grad.status();
    EXPECT_EQ(grad->shape, (std::vector<int64_t>{2, 5, 4, 16}));
    EXPECT_EQ(NpyToFloat(*grad), loaded->grad_hidden);
  }
}

TEST(HeadJobTest, DefaultsComeFromTheBuiltInConfig) {
  auto config = DefaultObjectiveConfig();
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->head().vocab_size(), 32768);
  EXPECT_EQ(config->loss().dflash().gamma(), 7);
  HeadJobOptions options;
  options.loss = "dpace-continuation-value-only";
  options.mode = "selective";
  auto changed = JobConfig(options);
  ASSERT_TRUE(changed.ok()) << changed.status();
  EXPECT_EQ(changed->loss().dpace().variant(),
            v1::DPaceLoss::CONTINUATION_VALUE_ONLY);
  EXPECT_EQ(changed->checkpoint().preset(),
            v1::CheckpointPolicy::SELECTIVE_FROZEN_PROJECTION);
}

TEST(HeadJobTest, CompareModesPrintsEveryMode) {
  HeadJobOptions options = Small("dflash");
  options.compare_modes = true;
  std::ostringstream report;
  ASSERT_TRUE(RunHeadJob(options, report).ok());
  for (const char* mode :
       {"materialize", "save", "checkpoint", "selective", "fused"}) {
    EXPECT_NE(report.str().find(std::string("  ") + mode), std::string::npos)
        << report.str();
  }
}

// A trainable head with a bias, from a config file: the job sizes the bias
// gradient and writes the weight gradient as grad_lm_head.npy (its values
// are checked against the reference in //heads:fused_head_test).
TEST(HeadJobTest, TrainableHeadWritesTheWeightGradient) {
  const std::string dir = TempDir("trainable");
  {
    std::ofstream file(dir + "/trainable.textproto");
    file << "layout { block_size: 4 } chunking { blocks_per_chunk: 2 } "
            "head { vocab_size: 31 hidden_size: 8 trainable: true bias: true "
            "mode: CHECKPOINT threads: 1 } loss { dflash { gamma: 7 } }";
  }
  HeadJobOptions options;
  options.config_path = dir + "/trainable.textproto";
  options.shape = {1, 40, 4};
  options.out_dir = dir;
  std::ostringstream report;
  auto job = RunHeadJob(options, report);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_DOUBLE_EQ(job->metrics.gemms(), 4);  // Checkpoint 3 + grad W.
  auto grad = ReadNpy(dir + "/grad_lm_head.npy");
  ASSERT_TRUE(grad.ok()) << grad.status();
  EXPECT_EQ(grad->shape, (std::vector<int64_t>{31, 8}));
  EXPECT_EQ(NpyToFloat(*grad), job->grad_weight);
  double norm = 0;
  for (float g : job->grad_weight) norm += std::abs(g);
  EXPECT_GT(norm, 0);
}

TEST(HeadJobTest, BadFlagsAndFilesAreClearErrors) {
  HeadJobOptions options = Small("focal");
  EXPECT_EQ(JobConfig(options).status().message(),
            "--loss: must be one of dflash, dpace, "
            "dpace-cumulative-confidence-only, dpace-continuation-value-only, "
            "tv, lk-lambda, dspark, kl, reverse-kl, jsd, got 'focal'");
  options = Small("dpace");
  options.gamma = 7;
  EXPECT_EQ(JobConfig(options).status().message(),
            "--gamma: D-PACE has no decay, got 7");
  options = Small("dflash");
  options.mode = "lazy";
  EXPECT_NE(JobConfig(options).status().message().find("--mode: must be one"),
            std::string::npos);

  // A directory with a mis-shaped lm_head.
  options = Small("dflash");
  auto config = JobConfig(options);
  ASSERT_TRUE(config.ok());
  auto batch = MakeSyntheticBatch<float>(*config, options.shape, options.seed);
  ASSERT_TRUE(batch.ok());
  const std::string dir = TempDir("bad_inputs");
  ASSERT_TRUE(SaveInputs(*batch, *config, 2, 64, dir).ok());
  const std::vector<float> wrong(97 * 15, 0.0f);
  ASSERT_TRUE(
      WriteNpy(dir + "/lm_head.npy", MakeNpy<float>(wrong, {97, 15})).ok());
  options.inputs_dir = dir;
  std::ostringstream report;
  EXPECT_EQ(RunHeadJob(options, report).status().message(),
            dir + "/lm_head.npy: expected shape [*, 16] of <f4 or <f8, got "
                  "[97, 15] of <f4");
  std::remove((dir + "/keep.npy").c_str());
  ASSERT_TRUE(
      WriteNpy(dir + "/lm_head.npy", MakeNpy<float>(batch->weight, {97, 16}))
          .ok());
  EXPECT_EQ(RunHeadJob(options, report).status().message(),
            dir + "/keep.npy: cannot open");
}

}  // namespace
}  // namespace dflash
