#include "cli/head_job.h"

#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "base/immutable_file.h"
#include "cli/job_inputs.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "io/npy.h"
#include "proto/metrics.pb.h"

namespace dflash {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

std::string TempDir(const std::string& name) {
  const char* root = std::getenv("TEST_TMPDIR");
  const std::string dir = std::string(root ? root : "/tmp") + "/" + name;
  std::string command = "rm -rf " + dir + " && mkdir -p " + dir;
  EXPECT_EQ(std::system(command.c_str()), 0);
  return dir;
}

std::string Contents(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  std::stringstream bytes;
  bytes << file.rdbuf();
  return bytes.str();
}

bool Exists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0;
}

// Names in `dir` starting with '.': temporaries left behind.
int HiddenEntries(const std::string& dir) {
  const std::string list = dir + ".hidden";
  const std::string command =
      "ls -A " + dir + " | grep -c '^\\.' > " + list + "; true";
  EXPECT_EQ(std::system(command.c_str()), 0);
  return std::atoi(Contents(list).c_str());
}

HeadJobOptions Small(const std::string& loss) {
  HeadJobOptions options;
  options.overrides.loss = loss;
  options.batch = 2;
  options.seq = 64;
  options.anchors = 5;
  options.block = 4;
  options.hidden = 16;
  options.vocab = 97;
  options.overrides.chunk_blocks = 3;
  options.overrides.threads = 1;
  options.seed = 5;
  return options;
}

// The same job reading the synthetic batch from `dir` (written there).
HeadJobOptions FromFiles(const HeadJobOptions& synthetic,
                         const std::string& dir) {
  auto config = JobConfig(synthetic);
  EXPECT_TRUE(config.ok()) << config.status();
  auto batch = MakeSyntheticBatch<float>(
      *config, {*synthetic.batch, *synthetic.seq, *synthetic.anchors},
      *synthetic.seed);
  EXPECT_TRUE(batch.ok()) << batch.status();
  EXPECT_TRUE(
      SaveInputs(*batch, *config, *synthetic.batch, *synthetic.seq, dir).ok());
  HeadJobOptions options;
  options.overrides.loss = synthetic.overrides.loss;
  options.overrides.chunk_blocks = synthetic.overrides.chunk_blocks;
  options.overrides.threads = synthetic.overrides.threads;
  options.inputs_dir = dir;
  return options;
}

const std::vector<float>& Floats(const JobTensor& tensor) {
  return std::get<std::vector<float>>(tensor);
}

// The --inputs path reproduces the in-process run of the same batch, and
// the outputs are what the report says.
TEST(HeadJobTest, InputsFromNpyReproduceTheInProcessRun) {
  for (const char* loss : {"dflash", "dspark", "jsd"}) {
    SCOPED_TRACE(loss);
    const HeadJobOptions options = Small(loss);
    HeadJobOptions from_files =
        FromFiles(options, TempDir(std::string("inputs_") + loss));
    from_files.out_dir = TempDir(std::string("out_") + loss);

    std::ostringstream report;
    auto direct = RunHeadJob(options, report);
    ASSERT_TRUE(direct.ok()) << direct.status();
    auto loaded = RunHeadJob(from_files, report);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    EXPECT_EQ(loaded->metrics.loss(), direct->metrics.loss());
    EXPECT_EQ(loaded->metrics.accuracy(), direct->metrics.accuracy());
    EXPECT_EQ(Floats(loaded->grad_hidden), Floats(direct->grad_hidden));
    EXPECT_GT(direct->metrics.loss(), 0);
    EXPECT_TRUE(loaded->notes.empty());

    v1::HeadMetrics parsed;
    const std::string json = Contents(from_files.out_dir + "/metrics.json");
    ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(json, &parsed).ok())
        << json;
    EXPECT_EQ(parsed.loss(), loaded->metrics.loss());
    EXPECT_EQ(parsed.mode(), "FUSED");
    EXPECT_EQ(parsed.accuracy_per_position_size(), 4);
    EXPECT_GT(parsed.peak_bytes(), 0);
    EXPECT_GT(parsed.weighted_rows(), 0);
    // A mean of probabilities over the supervised rows.
    EXPECT_GT(parsed.target_probability(), 0);
    EXPECT_LE(parsed.target_probability(), 1);
    // The diagnostics: per position, and accepted lengths in [1, K].
    EXPECT_EQ(parsed.metric_top_k(), 16);
    EXPECT_EQ(parsed.top_k_recall_per_position_size(), 4);
    EXPECT_EQ(parsed.top_k_mass_per_position_size(), 4);
    EXPECT_EQ(parsed.target_probability_per_position_size(), 4);
    double share = 0;
    for (double s : parsed.loss_weight_share_per_position()) share += s;
    EXPECT_NEAR(share, 1, 1e-12);
    // DSpark's labels supervise the anchor's slot too: one more to accept.
    const double longest = std::string(loss) == "dspark" ? 5 : 4;
    EXPECT_GE(parsed.expected_accepted_length(), 1);
    EXPECT_LE(parsed.expected_accepted_length(), longest);
    EXPECT_GE(parsed.oracle_accepted_length(), 1);
    EXPECT_LE(parsed.oracle_accepted_length(), longest);
    EXPECT_DOUBLE_EQ(parsed.gemms(), std::string(loss) == "dflash" ? 2 : 3);
    auto grad = ReadNpy(from_files.out_dir + "/grad_hidden.npy");
    ASSERT_TRUE(grad.ok()) << grad.status();
    EXPECT_EQ(grad->shape, (std::vector<int64_t>{2, 5, 4, 16}));
    EXPECT_EQ(NpyToFloat(*grad), Floats(loaded->grad_hidden));
    EXPECT_EQ(HiddenEntries(from_files.out_dir), 0);
  }
}

TEST(HeadJobTest, DefaultsComeFromTheBuiltInConfig) {
  auto config = DefaultObjectiveConfig();
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->head().vocab_size(), 32768);
  EXPECT_EQ(config->loss().dflash().gamma(), 7);
  HeadJobOptions options;
  options.overrides.loss = "dpace-continuation-value-only";
  options.overrides.mode = "selective";
  auto changed = JobConfig(options);
  ASSERT_TRUE(changed.ok()) << changed.status();
  EXPECT_EQ(changed->loss().dpace().variant(),
            v1::DPaceLoss::CONTINUATION_VALUE_ONLY);
  EXPECT_EQ(changed->checkpoint().preset(),
            v1::CheckpointPolicy::SELECTIVE_FROZEN_PROJECTION);
  EXPECT_EQ(changed->layout().num_anchors(), 128);
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

std::string WriteConfig(const std::string& dir, const std::string& text) {
  const std::string path = dir + "/config.textproto";
  std::ofstream(path) << text;
  return path;
}

// A trainable head with a bias, from a config file: the job sizes the bias
// gradient and writes the weight gradient as grad_lm_head.npy (its values
// are checked against the reference in //tests:head_parity_test); a frozen
// run into the same directory then removes it.
TEST(HeadJobTest, TrainableHeadWritesTheWeightGradient) {
  const std::string dir = TempDir("trainable");
  HeadJobOptions options;
  options.config_path = WriteConfig(
      dir,
      "layout { block_size: 4 } chunking { blocks_per_chunk: 2 } "
      "head { vocab_size: 31 hidden_size: 8 trainable: true bias: true "
      "mode: CHECKPOINT threads: 1 } loss { dflash { gamma: 7 } }");
  options.batch = 1;
  options.seq = 40;
  options.anchors = 4;
  options.out_dir = dir + "/out";
  std::ostringstream report;
  auto job = RunHeadJob(options, report);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_DOUBLE_EQ(job->metrics.gemms(), 4);  // Checkpoint 3 + grad W.
  auto grad = ReadNpy(options.out_dir + "/grad_lm_head.npy");
  ASSERT_TRUE(grad.ok()) << grad.status();
  EXPECT_EQ(grad->shape, (std::vector<int64_t>{31, 8}));
  EXPECT_EQ(NpyToFloat(*grad), Floats(job->grad_weight));
  double norm = 0;
  for (float g : Floats(job->grad_weight)) norm += std::abs(g);
  EXPECT_GT(norm, 0);

  options.config_path = WriteConfig(
      dir,
      "layout { block_size: 4 } chunking { blocks_per_chunk: 2 } "
      "head { vocab_size: 31 hidden_size: 8 } loss { dflash { gamma: 7 } }");
  ASSERT_TRUE(RunHeadJob(options, report).ok());
  EXPECT_FALSE(Exists(options.out_dir + "/grad_lm_head.npy"));
  EXPECT_TRUE(Exists(options.out_dir + "/grad_hidden.npy"));
}

// A FLOAT64 head runs in double from float64 files, and a bias comes from
// lm_head_bias.npy: what check_config accepts, dflash_head runs.
TEST(HeadJobTest, Float64HeadsAndBiasesRunFromFiles) {
  const std::string dir = TempDir("float64");
  const std::string config_path = WriteConfig(
      dir,
      "layout { block_size: 4 } chunking { blocks_per_chunk: 2 } "
      "head { vocab_size: 31 hidden_size: 8 bias: true dtype: FLOAT64 "
      "threads: 1 } loss { dflash { gamma: 7 } }");
  HeadJobOptions synthetic;
  synthetic.config_path = config_path;
  synthetic.batch = 1;
  synthetic.seq = 40;
  synthetic.anchors = 4;
  auto config = JobConfig(synthetic);
  ASSERT_TRUE(config.ok()) << config.status();
  auto batch = MakeSyntheticBatch<double>(*config, {1, 40, 4}, 3);
  ASSERT_TRUE(batch.ok());
  ASSERT_EQ(batch->bias.size(), 31u);
  ASSERT_TRUE(SaveInputs(*batch, *config, 1, 40, dir).ok());
  HeadJobOptions options;
  options.config_path = config_path;
  options.inputs_dir = dir;
  std::ostringstream report;
  auto job = RunHeadJob(options, report);
  ASSERT_TRUE(job.ok()) << job.status();
  ASSERT_TRUE(std::holds_alternative<std::vector<double>>(job->grad_hidden));
  synthetic.seed = 3;
  auto direct = RunHeadJob(synthetic, report);
  ASSERT_TRUE(direct.ok()) << direct.status();
  EXPECT_EQ(job->metrics.loss(), direct->metrics.loss());
  EXPECT_EQ(std::get<std::vector<double>>(job->grad_hidden),
            std::get<std::vector<double>>(direct->grad_hidden));
  // Without the bias file the run says which file it needs.
  std::remove((dir + "/lm_head_bias.npy").c_str());
  EXPECT_EQ(RunHeadJob(options, report).status().message(),
            dir + "/lm_head_bias.npy: cannot open: No such file or directory");
}

TEST(HeadJobTest, BadFlagsAreClearErrors) {
  HeadJobOptions options = Small("focal");
  EXPECT_EQ(JobConfig(options).status().message(),
            "--loss: must be one of dflash, dpace, "
            "dpace-cumulative-confidence-only, dpace-continuation-value-only, "
            "tv, lk-lambda, dspark, dpard, domino, kl, reverse-kl, jsd, got "
            "'focal'");
  options = Small("dpace");
  options.overrides.gamma = 7;
  EXPECT_EQ(JobConfig(options).status().message(),
            "--gamma: D-PACE has no decay, got 7");
  options = Small("dflash");
  options.overrides.mode = "lazy";
  EXPECT_THAT(std::string(JobConfig(options).status().message()),
              StartsWith("--mode: must be one"));
  options = Small("dflash");
  options.config_path = TempDir("config_dir");
  EXPECT_EQ(JobConfig(options).status().message(),
            "--config: " + options.config_path +
                ": is a directory, expected a regular file");
  options = Small("dflash");
  options.block = 0;
  EXPECT_THAT(JobConfig(options).status().message(),
              HasSubstr("layout.block_size: must be > 0, got 0"));
  options = Small("tv");
  options.overrides.lk = "lambda";
  EXPECT_EQ(JobConfig(options).status().message(),
            "--lk: applies to the dflash and dpace loss families, got tv");
  options = Small("dflash");
  options.overrides.kl_decay = 2;
  EXPECT_EQ(JobConfig(options).status().message(),
            "--kl_scale, --kl_decay: set with --lk=lambda, got no --lk");
}

// --lk, --kl_scale and --kl_decay: SpecForge's lk_loss_type and its weights.
TEST(HeadJobTest, LkFlagsSetTheComposition) {
  HeadJobOptions options = Small("dflash");
  options.overrides.lk = "lambda";
  options.overrides.kl_scale = 0.7;
  absl::StatusOr<v1::ObjectiveConfig> config = JobConfig(options);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->loss().dflash().lk().type(), v1::LkComposition::LAMBDA);
  EXPECT_EQ(config->loss().dflash().lk().kl_scale(), 0.7);
  EXPECT_EQ(config->loss().dflash().lk().kl_decay(), 1);

  // The run reports SpecForge's LK metrics, and the fused head still makes
  // two GEMM passes: the batch's CE weight scales rows after the last chunk.
  std::ostringstream report;
  auto run = RunHeadJob(options, report);
  ASSERT_TRUE(run.ok()) << run.status();
  const v1::HeadMetrics& m = run->metrics;
  EXPECT_EQ(m.loss_family(), "dflash/lk-lambda");
  EXPECT_DOUBLE_EQ(m.gemms(), 2);
  EXPECT_NEAR(m.lk_kl_weight(), 0.7 * std::exp(-m.target_probability()), 1e-12);
  EXPECT_NEAR(m.loss_num(),
              m.lk_kl_weight() * m.ce_loss_num() +
                  (1 - m.lk_kl_weight()) * m.tv_loss_num(),
              1e-9 * m.loss_num());
  EXPECT_GT(m.tv_loss_num(), 0);
}

// With --inputs the files give the shapes: the synthetic batch's flags are
// errors, and the config is validated against the files' V and H.
TEST(HeadJobTest, InputsReplaceTheSyntheticShapes) {
  const std::string dir = TempDir("shapes");
  HeadJobOptions options = FromFiles(Small("dflash"), dir);
  options.vocab = 1000;
  EXPECT_EQ(JobConfig(options).status().message(),
            "--vocab: shapes the synthetic batch, which --inputs replaces "
            "(the files give the shapes), got 1000");
  options.vocab.reset();
  options.seed = 9;
  EXPECT_EQ(JobConfig(options).status().message(),
            "--seed: seeds the synthetic batch, which --inputs replaces, got "
            "9");
  options.seed.reset();
  // A logits budget that holds a block of the files' V = 97, not of the
  // config's own 1000000.
  options.config_path = WriteConfig(
      TempDir("shapes_config"),
      "layout { block_size: 4 } chunking { logits_budget_bytes: 4000 } "
      "head { vocab_size: 1000000 hidden_size: 3 threads: 1 } "
      "loss { dflash { gamma: 7 } }");
  options.overrides.chunk_blocks.reset();
  auto config = JobConfig(options);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->head().vocab_size(), 97);
  EXPECT_EQ(config->head().hidden_size(), 16);
  std::ostringstream report;
  EXPECT_TRUE(RunHeadJob(options, report).ok());
}

TEST(HeadJobTest, BadFilesAreClearErrors) {
  const std::string dir = TempDir("bad_inputs");
  HeadJobOptions options = FromFiles(Small("dflash"), dir);
  std::ostringstream report;
  const std::vector<float> wrong(97 * 15, 0.0f);
  ASSERT_TRUE(
      WriteNpy(dir + "/lm_head.npy", MakeNpy<float>(wrong, {97, 15})).ok());
  EXPECT_EQ(RunHeadJob(options, report).status().message(),
            dir +
                "/lm_head.npy: expected shape [*, 16] of <f4 or <f8, got "
                "[97, 15] of <f4");
  std::remove((dir + "/lm_head.npy").c_str());
  EXPECT_EQ(RunHeadJob(options, report).status().message(),
            dir + "/lm_head.npy: cannot open: No such file or directory");
  ASSERT_EQ(::mkdir((dir + "/lm_head.npy").c_str(), 0777), 0);
  EXPECT_EQ(RunHeadJob(options, report).status().message(),
            dir + "/lm_head.npy: is a directory, expected a regular file");
}

// A FIFO would block a plain open forever.
TEST(HeadJobTest, AFifoIsRefusedWithoutWaiting) {
  const std::string dir = TempDir("fifo");
  HeadJobOptions options = FromFiles(Small("dflash"), dir);
  std::remove((dir + "/keep.npy").c_str());
  ASSERT_EQ(::mkfifo((dir + "/keep.npy").c_str(), 0600), 0);
  std::ostringstream report;
  EXPECT_EQ(RunHeadJob(options, report).status().message(),
            dir + "/keep.npy: is a FIFO (named pipe), expected a regular file");
}

// Each extent in range, the element count beyond 64 bits, no data: refused
// from the header, before the batch layout sees it.
TEST(HeadJobTest, AnOverflowingShapeIsRefusedFromTheHeader) {
  const std::string dir = TempDir("overflow");
  HeadJobOptions options = FromFiles(Small("dflash"), dir);
  std::string header =
      "{'descr': '<f4', 'fortran_order': False, "
      "'shape': (4294967296, 4294967296, 4, 16), }";
  header.append(118 - header.size(), ' ');
  header.push_back('\n');
  std::ofstream(dir + "/hidden.npy", std::ios::binary)
      << std::string("\x93NUMPY\x01\x00", 8) << char(118) << '\0' << header;
  std::ostringstream report;
  EXPECT_EQ(RunHeadJob(options, report).status().message(),
            dir +
                "/hidden.npy: shape [4294967296, 4294967296, 4, 16] of <f4 "
                "holds more than 2^63 bytes");
}

// Non-finite inputs are found when loading and named by file and index.
TEST(HeadJobTest, NonFiniteInputsNameTheirElement) {
  const std::string dir = TempDir("nan");
  HeadJobOptions options = FromFiles(Small("dflash"), dir);
  auto hidden = ReadNpy(dir + "/hidden.npy");
  ASSERT_TRUE(hidden.ok());
  std::vector<float> values = NpyToFloat(*hidden);
  values[((1 * 5 + 3) * 4 + 2) * 16 + 7] = NAN;  // b 1, n 3, k 2, h 7.
  ASSERT_TRUE(
      WriteNpy(dir + "/hidden.npy", MakeNpy<float>(values, {2, 5, 4, 16}))
          .ok());
  std::ostringstream report;
  EXPECT_EQ(RunHeadJob(options, report).status().message(),
            dir +
                "/hidden.npy: value nan at (b, n, k, h) = (1, 3, 2, 7) is "
                "not finite; inputs must be finite");
  // float64 beyond float32's range, for a FLOAT32 head.
  std::vector<double> wide(values.begin(), values.end());
  wide[((1 * 5 + 3) * 4 + 2) * 16 + 7] = 1e300;
  ASSERT_TRUE(
      WriteNpy(dir + "/hidden.npy", MakeNpy<double>(wide, {2, 5, 4, 16})).ok());
  EXPECT_EQ(RunHeadJob(options, report).status().message(),
            dir +
                "/hidden.npy: value 1e+300 at (b, n, k, h) = (1, 3, 2, 7) "
                "overflows float32, the head's dtype (FLOAT32); rescale it "
                "or use head.dtype FLOAT64");
}

// Sizes beyond the memory available are refused before allocation.
TEST(HeadJobTest, RunsThatCannotFitAreRefusedBeforeAllocating) {
  HeadJobOptions options = Small("dflash");
  options.vocab = 1000000;
  options.hidden = 8192;
  options.memory_limit = int64_t{8} << 30;
  std::ostringstream report;
  absl::Status status = RunHeadJob(options, report).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(status.message(),
              HasSubstr("8589934592 bytes (8.0 GiB) are available "
                        "(--memory_limit)"));
  options = Small("dflash");
  options.batch = 1000000000;
  options.seq = 1099511627776;
  status = RunHeadJob(options, report).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  // The batch fits a tight limit, the head's buffers do not.
  options = Small("dflash");
  options.memory_limit = 40000;
  options.overrides.mode = "materialize";
  status = RunHeadJob(options, report).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(status.message(), HasSubstr("head buffers"));
}

TEST(HeadJobTest, TheOutputDirectoryIsMadeAndCheckedFirst) {
  const std::string dir = TempDir("out_checks");
  HeadJobOptions options = Small("dflash");
  options.out_dir = dir + "/made/for/us";
  std::ostringstream report;
  ASSERT_TRUE(RunHeadJob(options, report).ok());
  EXPECT_TRUE(Exists(options.out_dir + "/metrics.json"));
  std::ofstream(dir + "/plain") << "x";
  options.out_dir = dir + "/plain";
  options.vocab = 1000000;  // Would be refused later: the check comes first.
  EXPECT_EQ(
      RunHeadJob(options, report).status().message(),
      "--out: " + dir + "/plain: is a regular file, expected a directory");
}

// A directory where metrics.json goes, and a disk that fills up: the run
// fails naming the file, and the previous run's outputs stay as they were.
TEST(HeadJobTest, OutputsAreAllOrNothing) {
  const std::string dir = TempDir("all_or_nothing");
  HeadJobOptions options = Small("dflash");
  options.hidden = 64;  // grad_hidden.npy of 40 KiB.
  options.out_dir = dir;
  std::ostringstream report;
  ASSERT_TRUE(RunHeadJob(options, report).ok());
  const std::string metrics = Contents(dir + "/metrics.json");
  const std::string grad = Contents(dir + "/grad_hidden.npy");
  options.seed = 6;  // Different outputs.

  struct rlimit saved;
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &saved), 0);
  ::signal(SIGXFSZ, SIG_IGN);
  struct rlimit small = saved;
  small.rlim_cur = 4096;  // metrics.json fits, grad_hidden.npy does not.
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  const absl::Status full = RunHeadJob(options, report).status();
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &saved), 0);
  EXPECT_EQ(full.message(),
            dir + "/grad_hidden.npy: cannot write: File too large");
  EXPECT_TRUE(Contents(dir + "/metrics.json") == metrics);
  EXPECT_TRUE(Contents(dir + "/grad_hidden.npy") == grad);
  EXPECT_EQ(HiddenEntries(dir), 0);

  std::remove((dir + "/metrics.json").c_str());
  ASSERT_EQ(::mkdir((dir + "/metrics.json").c_str(), 0777), 0);
  EXPECT_EQ(RunHeadJob(options, report).status().message(),
            dir + "/metrics.json: is a directory, cannot replace it");
  EXPECT_TRUE(Contents(dir + "/grad_hidden.npy") == grad);
  EXPECT_EQ(HiddenEntries(dir), 0);
}

// A batch where nothing carries weight is valid: exit 0, but said.
TEST(HeadJobTest, ABatchWithoutWeightIsReported) {
  const std::string dir = TempDir("no_weight");
  HeadJobOptions options = FromFiles(Small("dflash"), dir);
  const std::vector<uint8_t> none(2 * 64, 0);
  ASSERT_TRUE(
      WriteNpy(dir + "/loss_mask.npy", MakeNpy<uint8_t>(none, {2, 64})).ok());
  options.out_dir = TempDir("no_weight_out");
  std::ostringstream report;
  auto job = RunHeadJob(options, report);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->metrics.weighted_rows(), 0);
  EXPECT_EQ(job->metrics.loss(), 0);
  ASSERT_EQ(job->notes.size(), 1u);
  EXPECT_THAT(job->notes[0], HasSubstr("no row of the batch carries weight"));
  EXPECT_THAT(Contents(options.out_dir + "/metrics.json"),
              HasSubstr("\"weighted_rows\": \"0\""));
}

// Mask values other than 0 and 1 (a -1 padding sentinel, 2, 255) are
// refused naming the file and the index, whatever the integer type; bool
// masks stay accepted.
TEST(HeadJobTest, MasksHoldOnlyZeroAndOne) {
  const std::string dir = TempDir("masks");
  const HeadJobOptions options = FromFiles(Small("dflash"), dir);
  const auto original = ReadNpy(dir + "/loss_mask.npy");
  const auto keep = ReadNpy(dir + "/keep.npy");
  ASSERT_TRUE(original.ok() && keep.ok());
  const std::vector<int64_t> mask = NpyToInt64(*original);
  const std::vector<int64_t> kept = NpyToInt64(*keep);
  struct Case {
    const char* file;
    NpyType type;
    int64_t value, row, column;
  };
  for (const Case& c : std::vector<Case>{
           {"loss_mask.npy", NpyType::kInt32, -1, 1, 9},
           {"loss_mask.npy", NpyType::kInt64, 2, 0, 63},
           {"loss_mask.npy", NpyType::kUint8, 255, 0, 0},
           {"keep.npy", NpyType::kInt64, -1, 1, 4},
           {"keep.npy", NpyType::kInt32, 2, 0, 2},
           {"keep.npy", NpyType::kUint8, 255, 1, 0}}) {
    const bool is_mask = std::string(c.file) == "loss_mask.npy";
    const int64_t columns = is_mask ? 64 : 5;
    std::vector<int64_t> values = is_mask ? mask : kept;
    values[c.row * columns + c.column] = c.value;
    SCOPED_TRACE(std::string(c.file) + " " + std::string(NpyDescr(c.type)));
    const std::vector<int64_t> shape = {2, columns};
    NpyArray array;
    if (c.type == NpyType::kInt64) array = MakeNpy<int64_t>(values, shape);
    if (c.type == NpyType::kInt32) {
      array = MakeNpy<int32_t>(
          std::vector<int32_t>(values.begin(), values.end()), shape);
    }
    if (c.type == NpyType::kUint8) {
      array = MakeNpy<uint8_t>(
          std::vector<uint8_t>(values.begin(), values.end()), shape);
    }
    ASSERT_TRUE(WriteNpy(dir + "/" + c.file, array).ok());
    std::ostringstream report;
    EXPECT_EQ(RunHeadJob(options, report).status().message(),
              absl::StrCat(dir, "/", c.file, ": value ", c.value, " at ",
                           is_mask ? "(b, s)" : "(b, n)", " = (", c.row, ", ",
                           c.column,
                           ") is not 0 or 1; a mask holds 0 (off) or 1 (on)"));
    ASSERT_TRUE(WriteNpy(dir + "/" + c.file, is_mask ? *original : *keep).ok());
  }
  // The same masks as bool files run as the uint8 ones do.
  std::ostringstream report;
  auto as_uint8 = RunHeadJob(options, report);
  ASSERT_TRUE(as_uint8.ok()) << as_uint8.status();
  const std::vector<bool> mask_bits(mask.begin(), mask.end());
  const std::vector<bool> keep_bits(kept.begin(), kept.end());
  auto bools = [](const std::vector<bool>& bits, std::vector<int64_t> shape) {
    std::unique_ptr<bool[]> values(new bool[bits.size()]);
    for (size_t i = 0; i < bits.size(); ++i) values[i] = bits[i];
    return MakeNpy<bool>(absl::MakeConstSpan(values.get(), bits.size()),
                         std::move(shape));
  };
  ASSERT_TRUE(WriteNpy(dir + "/loss_mask.npy", bools(mask_bits, {2, 64})).ok());
  ASSERT_TRUE(WriteNpy(dir + "/keep.npy", bools(keep_bits, {2, 5})).ok());
  auto as_bool = RunHeadJob(options, report);
  ASSERT_TRUE(as_bool.ok()) << as_bool.status();
  EXPECT_EQ(as_bool->metrics.loss(), as_uint8->metrics.loss());
  EXPECT_EQ(Floats(as_bool->grad_hidden), Floats(as_uint8->grad_hidden));
}

// A zero extent is named against its file and axis, before the config's
// validation would call it a zero layout.block_size or vocab_size.
TEST(HeadJobTest, AnEmptyAxisIsNamedAgainstItsFile) {
  const std::string dir = TempDir("empty_axis");
  const HeadJobOptions options = FromFiles(Small("dflash"), dir);
  ASSERT_TRUE(WriteNpy(dir + "/hidden.npy",
                       MakeNpy<float>(std::vector<float>(), {2, 5, 0, 16}))
                  .ok());
  std::ostringstream report;
  EXPECT_EQ(RunHeadJob(options, report).status().message(),
            dir + "/hidden.npy: axis k of (b, n, k, h) has extent 0 (shape "
                  "[2, 5, 0, 16]); every axis needs at least 1");
  FromFiles(Small("dflash"), dir);
  ASSERT_TRUE(
      WriteNpy(dir + "/lm_head.npy", MakeNpy<float>(std::vector<float>(), {0, 16}))
          .ok());
  EXPECT_EQ(RunHeadJob(options, report).status().message(),
            dir + "/lm_head.npy: axis v of (v, h) has extent 0 (shape [0, "
                  "16]); every axis needs at least 1");
}

// --seq=64 holds 45 anchor blocks (positions 0..62, five of every seven):
// asking for more is refused before any work, whichever source asked.
TEST(HeadJobTest, AnchorsASequenceCannotHoldAreRefusedFirst) {
  HeadJobOptions options = Small("dflash");
  options.anchors = 64;
  options.vocab = 1000000;  // Would be refused later: this comes first.
  const std::string tail =
      " anchor blocks do not fit a synthetic sequence of 64 tokens (--seq): "
      "it holds at most 45 (an anchor needs two consecutive supervised "
      "tokens, and every 7th token is unsupervised); ask for fewer anchor "
      "blocks or more tokens";
  EXPECT_EQ(JobConfig(options).status().message(), "--anchors: 64" + tail);
  options.anchors = 45;
  options.vocab = 97;
  EXPECT_TRUE(JobConfig(options).ok());

  // Unasked, the default of 128 becomes what the sequence holds.
  options.anchors.reset();
  absl::StatusOr<v1::ObjectiveConfig> fitted = JobConfig(options);
  ASSERT_TRUE(fitted.ok()) << fitted.status();
  EXPECT_EQ(fitted->layout().num_anchors(), 45);
  const std::string dir = TempDir("anchors_config");
  options.config_path = WriteConfig(
      dir, "layout { block_size: 4 num_anchors: 46 } head { vocab_size: 97 "
           "hidden_size: 16 } loss { dflash { gamma: 7 } }");
  EXPECT_EQ(JobConfig(options).status().message(),
            "layout.num_anchors (" + options.config_path + "): 46" + tail);
}

// The capacity is what SampleAnchors finds in the synthetic mask, counted
// by asking for more anchors than any of these sequences holds.
TEST(HeadJobTest, TheSyntheticCapacityIsWhatTheBatchHolds) {
  auto config = JobConfig(Small("dflash"));
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(SyntheticAnchorCapacity(64), 45);
  EXPECT_EQ(SyntheticAnchorCapacity(4096), 2925);
  for (int64_t seq : {2, 6, 7, 8, 13, 14, 64, 100}) {
    SCOPED_TRACE(seq);
    auto batch = MakeSyntheticBatch<float>(*config, {1, seq, 1000}, 3);
    ASSERT_TRUE(batch.ok()) << batch.status();
    EXPECT_EQ(batch->anchors.num_anchors, SyntheticAnchorCapacity(seq));
  }
}

// A config's layout.num_anchors shapes the synthetic batch when no
// --anchors does.
TEST(HeadJobTest, AConfigsAnchorsShapeTheSyntheticBatch) {
  const std::string dir = TempDir("config_anchors");
  HeadJobOptions options = Small("dflash");
  options.anchors.reset();
  options.block.reset();
  options.config_path = WriteConfig(
      dir, "layout { block_size: 4 num_anchors: 7 } head { vocab_size: 97 "
           "hidden_size: 16 } loss { dflash { gamma: 7 } }");
  options.out_dir = dir + "/out";
  std::ostringstream report;
  auto job = RunHeadJob(options, report);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->config.layout().num_anchors(), 7);
  auto grad = ReadNpyHeader(options.out_dir + "/grad_hidden.npy");
  ASSERT_TRUE(grad.ok()) << grad.status();
  EXPECT_EQ(grad->shape, (std::vector<int64_t>{2, 7, 4, 16}));
  options.anchors = 3;  // The flag comes first.
  auto flagged = JobConfig(options);
  ASSERT_TRUE(flagged.ok()) << flagged.status();
  EXPECT_EQ(flagged->layout().num_anchors(), 3);
}

// With --inputs, a --config's layout that disagrees with the files is an
// error naming the field, the file and both values; the built-in config's
// layout yields to the files.
TEST(HeadJobTest, AConfigsLayoutMustAgreeWithTheFiles) {
  const std::string dir = TempDir("layout_files");
  HeadJobOptions options = FromFiles(Small("dflash"), dir);
  ASSERT_TRUE(JobConfig(options).ok());  // Built-in: N 128, K 16 yield.
  const std::string config_dir = TempDir("layout_files_config");
  options.config_path = WriteConfig(
      config_dir, "layout { num_anchors: 6 } head { vocab_size: 97 "
                  "hidden_size: 16 } loss { dflash { gamma: 7 } }");
  EXPECT_EQ(JobConfig(options).status().message(),
            "layout.num_anchors: " + options.config_path + " sets 6, but " +
                dir +
                "/hidden.npy [B, N, K, H] = [2, 5, 4, 16] has N = 5; remove "
                "the field from the config or make them agree");
  options.config_path = WriteConfig(
      config_dir, "layout { block_size: 8 } head { vocab_size: 97 "
                  "hidden_size: 16 } loss { dflash { gamma: 7 } }");
  EXPECT_EQ(JobConfig(options).status().message(),
            "layout.block_size: " + options.config_path + " sets 8, but " +
                dir +
                "/hidden.npy [B, N, K, H] = [2, 5, 4, 16] has K = 4; remove "
                "the field from the config or make them agree");
  options.config_path = WriteConfig(
      config_dir, "layout { block_size: 4 num_anchors: 5 } head { "
                  "vocab_size: 97 hidden_size: 16 } loss { dflash { gamma: 7 "
                  "} }");
  EXPECT_TRUE(JobConfig(options).ok()) << JobConfig(options).status();
}

// What check_config refuses, a flag does not hide: --anchors would replace
// layout.num_anchors: 0, but the config itself is invalid.
TEST(HeadJobTest, AnInvalidLayoutIsRefusedBeforeFlagsReplaceIt) {
  const std::string dir = TempDir("layout_zero");
  HeadJobOptions options = Small("dflash");
  options.config_path = WriteConfig(
      dir, "layout { num_anchors: 0 } head { vocab_size: 97 hidden_size: 16 "
           "} loss { dflash { gamma: 7 } }");
  EXPECT_EQ(JobConfig(options).status().message(),
            "layout.num_anchors: must be > 0, got 0");
}

// A report that cannot be written does not keep the outputs from being
// written; the error says they were.
TEST(HeadJobTest, AFailedReportStillWritesTheOutputs) {
  const std::string dir = TempDir("failed_report");
  HeadJobOptions options = Small("dflash");
  options.out_dir = dir;
  std::ostringstream report;
  report.setstate(std::ios::badbit);
  EXPECT_EQ(RunHeadJob(options, report).status().message(),
            "cannot write standard output (the outputs in " + dir +
                " were written)");
  auto grad = ReadNpy(dir + "/grad_hidden.npy");
  ASSERT_TRUE(grad.ok()) << grad.status();
  EXPECT_EQ(grad->shape, (std::vector<int64_t>{2, 5, 4, 16}));
  EXPECT_TRUE(Exists(dir + "/metrics.json"));
}

// A frozen run after a trainable one must remove grad_lm_head.npy; when it
// cannot (immutable), no output changes: no new metrics beside an old
// gradient.
TEST(HeadJobTest, AStaleGradientThatCannotGoChangesNothing) {
  const std::string dir = TempDir("stale_immutable");
  HeadJobOptions options;
  options.config_path = WriteConfig(
      dir,
      "layout { block_size: 4 } head { vocab_size: 31 hidden_size: 8 "
      "trainable: true threads: 1 } loss { dflash { gamma: 7 } }");
  options.batch = 1;
  options.seq = 40;
  options.anchors = 4;
  options.out_dir = dir + "/out";
  std::ostringstream report;
  ASSERT_TRUE(RunHeadJob(options, report).ok());
  const std::string metrics = Contents(options.out_dir + "/metrics.json");
  const std::string grad = Contents(options.out_dir + "/grad_hidden.npy");
  const std::string weight = Contents(options.out_dir + "/grad_lm_head.npy");
  options.config_path = WriteConfig(
      dir, "layout { block_size: 4 } head { vocab_size: 31 hidden_size: 8 "
           "threads: 1 } loss { dflash { gamma: 7 } }");
  options.seed = 9;
  ImmutableFile pinned(options.out_dir + "/grad_lm_head.npy");
  if (!pinned.set()) GTEST_SKIP() << "chattr +i is refused on this filesystem";
  EXPECT_EQ(RunHeadJob(options, report).status().message(),
            options.out_dir +
                "/grad_lm_head.npy: cannot remove the previous run's file: "
                "Operation not permitted; no file was changed");
  EXPECT_TRUE(Contents(options.out_dir + "/metrics.json") == metrics);
  EXPECT_TRUE(Contents(options.out_dir + "/grad_hidden.npy") == grad);
  EXPECT_TRUE(Contents(options.out_dir + "/grad_lm_head.npy") == weight);
  EXPECT_EQ(HiddenEntries(options.out_dir), 0);
}

}  // namespace
}  // namespace dflash
