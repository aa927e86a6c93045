// The vocab-parallel loss and head (issue 31) against the single-process
// runs on the whole vocabulary (which //losses and //tests check against
// float64 references): W = 2, 3 and 4 "processes" as threads exchanging
// through ThreadGroup, each holding a contiguous range of the classes
// (sizes differing by one at most, V divisible by none of them, ranges
// narrower than k). Terms, per-row outputs and gradients within float64's
// 1e-12 (float32's 1e-6) of the single-process run, ids exactly equal, and
// every process's results bitwise equal to process 0's.

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/bfloat16.h"
#include "base/tracking_allocator.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"
#include "heads/cpu_head.h"
#include "losses/chunk_loss.h"
#include "losses/loss_family.h"
#include "losses/vocab_shard.h"
#include "proto/loss.pb.h"
#include "tests/head_test_util.h"
#include "tests/thread_vocab_exchange.h"

namespace dflash {
namespace {

using testing_vocab::Ranges;
using testing_vocab::RunRanks;
using testing_vocab::SplitVocab;
using testing_vocab::ThreadGroup;

constexpr std::chrono::milliseconds kTimeout(20000);
constexpr int64_t kV = 11, kK = 4, kBlocks = 4, kRows = kK * kBlocks;
constexpr int32_t kTopK = 5, kMetricTopK = 4;

v1::LossConfig Parse(const std::string& text) {
  v1::LossConfig config;
  EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(text, &config))
      << text;
  return config;
}

// A chunk of kRows rows of kV logits (float64), its teacher logits,
// confidence logits and rows. Rows 0 and 5 have their maximum at several
// classes, across every split's range boundaries (ids 2, 5, 6, 8, 9), and
// rows 2 and 8 an ignored target (-100).
struct Chunk {
  std::vector<double> logits, teacher;
  std::vector<float> confidence;
  std::vector<RowMeta> rows;
};

Chunk MakeChunk(uint32_t seed, bool targets_in_last_range) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal(0, 2);
  std::uniform_int_distribution<int32_t> target(0, kV - 1), last(9, kV - 1);
  Chunk c;
  for (int64_t i = 0; i < kRows * kV; ++i) {
    c.logits.push_back(normal(rng));
    c.teacher.push_back(normal(rng));
  }
  for (int64_t r : {0, 5}) {
    for (int64_t v : {2, 5, 6, 8, 9}) {
      c.logits[r * kV + v] = 7.5;
      c.teacher[r * kV + v] = 6.25;
    }
  }
  for (int64_t r = 0; r < kRows; ++r) {
    RowMeta meta;
    meta.target = targets_in_last_range ? last(rng) : target(rng);
    meta.position = static_cast<int32_t>(r % kK);
    meta.block = r / kK;
    meta.mask = (r % 7 == 3) ? 0.0 : (r % 3 == 1 ? 0.5 : 1.0);
    c.rows.push_back(meta);
    c.confidence.push_back(static_cast<float>(normal(rng)));
  }
  c.rows[2].target = -100;
  c.rows[8].target = -100;
  return c;
}

struct LossCase {
  std::string name;
  std::string loss;
  bool teacher = true;  // Pass teacher logits (the diagnostics without one).
  double scale = 1, softcap = 0;
};

std::vector<LossCase> LossCases() {
  return {
      {"DFlash", "dflash { gamma: 7 }", false},
      {"DFlashTeacherDiagnostics", "dflash { gamma: 7 }"},
      {"DFlashSmoothingZLoss",
       "dflash { gamma: 7 } cross_entropy { label_smoothing: 0.1 "
       "z_loss_scale: 0.01 }",
       false},
      {"DFlashSoftcapScale", "dflash {}", true, 0.7, 5},
      {"DFlashCountIgnored",
       "dflash {} cross_entropy { ignored_target_weight: COUNT "
       "label_smoothing: 0.1 z_loss_scale: 0.01 }",
       false, 1, 4},
      {"Tv", "tv { gamma: 7 }", false},
      {"DFlashLkTv", "dflash { gamma: 7 lk { type: TV } }", false},
      {"DFlashLkLambda",
       "dflash { gamma: 7 lk { type: LAMBDA kl_scale: 0.8 kl_decay: 2 } }",
       false},
      {"LkLambda", "lk_lambda { gamma: 7 kl_scale: 0.8 kl_decay: 2 }"},
      {"LkLambdaSmoothing",
       "lk_lambda { kl_scale: 1 kl_decay: 0.5 } cross_entropy { "
       "z_loss_scale: 0.01 label_smoothing: 0.05 }",
       false},
      {"DPace", "dpace { alpha: 0.3 }", false},
      {"DPaceCumulative",
       "dpace { alpha: 0.3 variant: CUMULATIVE_CONFIDENCE_ONLY }", false},
      {"DPaceContinuation",
       "dpace { alpha: 0.3 variant: CONTINUATION_VALUE_ONLY }", false},
      {"DPaceSequenceBalanced",
       "dpace { alpha: 0.3 denominator: SEQUENCE_BALANCED }", false},
      {"DPaceLkTvCount",
       "dpace { alpha: 0.6 lk { type: TV } } cross_entropy { "
       "ignored_target_weight: COUNT }"},
      {"DPaceSmoothedSoftcap",
       "dpace { alpha: 0 } cross_entropy { label_smoothing: 0.2 }", false, 1,
       4},
      {"DSpark", "dspark { gamma: 7 l1_weight: 0.5 confidence_weight: 0.3 }"},
      {"DSparkSoftcapSmoothing",
       "dspark { l1_weight: 1 confidence_weight: 1 } cross_entropy { "
       "label_smoothing: 0.1 }",
       true, 1, 6},
      {"DSparkCount",
       "dspark { gamma: 7 l1_weight: 0.5 confidence_weight: 0.3 } "
       "cross_entropy { ignored_target_weight: COUNT }"},
      {"DPard",
       "dspark { objective: DPARD ce_weight: 0 l1_weight: 0 "
       "confidence_weight: 0.4 }"},
      {"ForwardKl", "distillation { divergence: FORWARD_KL temperature: 2 }"},
      {"ReverseKl",
       "distillation { divergence: REVERSE_KL temperature: 1.5 gamma: 7 }"},
      {"Jsd", "distillation { divergence: JSD beta: 0.3 }"},
      {"JsdSoftcap",
       "distillation { divergence: JSD beta: 0.5 temperature: 0.8 }", true, 1,
       3},
  };
}

// One run's results, every output asked for.
template <typename T>
struct Result {
  absl::Status status;
  ChunkTerms terms;
  std::vector<T> gradient;  // [rows x width]
  std::vector<float> top_k_values;
  std::vector<double> neg_log_q, loss_weight, confidence_grad;
  std::vector<int32_t> argmax, top_k, target_rank;
  std::vector<double> target_probability, teacher_acceptance;
};

template <typename T>
Result<T> RunChunk(const LossParams& params, const LossCase& c,
                   const Chunk& chunk, int64_t offset, int64_t width,
                   const VocabShard* shard) {
  Result<T> out;
  out.gradient.resize(kRows * width);
  std::vector<T> teacher(kRows * width);
  for (int64_t r = 0; r < kRows; ++r) {
    for (int64_t v = 0; v < width; ++v) {
      out.gradient[r * width + v] =
          FromDouble<T>(chunk.logits[r * kV + offset + v]);
      teacher[r * width + v] = FromDouble<T>(chunk.teacher[r * kV + offset + v]);
    }
  }
  out.neg_log_q.resize(kRows);
  out.argmax.resize(kRows);
  out.top_k.resize(kRows * kTopK);
  out.top_k_values.resize(kRows * kTopK);
  out.target_probability.resize(kRows);
  out.target_rank.resize(kRows);
  out.loss_weight.resize(kRows);
  out.confidence_grad.resize(kRows);
  const bool distillation = params.family == LossFamily::kDistillation;
  out.teacher_acceptance.resize(c.teacher && !distillation ? kRows : 0);
  const ChunkLossOptions options{kK, c.scale, c.softcap, kMetricTopK, shard};
  absl::StatusOr<CpuChunkLoss<T>> loss =
      CpuChunkLoss<T>::Create(params, options);
  if (!loss.ok()) {
    out.status = loss.status();
    return out;
  }
  const LossTraits traits = LossTraitsOf(params);
  using Confidence = ConfidenceOf<T>;
  const std::vector<Confidence> confidence(chunk.confidence.begin(),
                                           chunk.confidence.end());
  ChunkLossInputs<T> inputs{
      absl::MakeSpan(out.gradient),
      c.teacher ? absl::MakeConstSpan(teacher) : absl::Span<const T>(),
      traits.needs_confidence ? absl::MakeConstSpan(confidence)
                              : absl::Span<const Confidence>(),
      chunk.rows, width};
  ChunkLossOutputs outputs{absl::MakeSpan(out.confidence_grad),
                           absl::MakeSpan(out.neg_log_q),
                           absl::MakeSpan(out.argmax),
                           absl::MakeSpan(out.top_k),
                           kTopK,
                           absl::MakeSpan(out.target_probability),
                           absl::MakeSpan(out.target_rank),
                           absl::MakeSpan(out.top_k_values),
                           absl::MakeSpan(out.loss_weight),
                           absl::MakeSpan(out.teacher_acceptance)};
  absl::StatusOr<ChunkTerms> terms = loss->Run(inputs, outputs);
  out.status = terms.status();
  if (terms.ok()) out.terms = *terms;
  return out;
}

// |a - b| <= tolerance * max(1, |b|).
void ExpectNear(double a, double b, double tolerance, const std::string& what) {
  EXPECT_LE(std::abs(a - b), tolerance * std::max(1.0, std::abs(b)))
      << what << ": " << a << " vs " << b;
}

void ExpectTermsNear(const ChunkTerms& a, const ChunkTerms& b,
                     double tolerance, const std::string& where) {
#define DFLASH_SUMMED_TERM(field, slot, dict, key) \
  ExpectNear(a.field, b.field, tolerance, where + " " #field);
#define DFLASH_POSITION_TERM(field, slot, dict, key)                        \
  ASSERT_EQ(a.field.size(), b.field.size()) << where << " " #field;         \
  for (size_t i = 0; i < a.field.size(); ++i) {                             \
    ExpectNear(a.field[i], b.field[i], tolerance,                           \
               absl::StrCat(where, " " #field "[", i, "]"));                \
  }
#define DFLASH_BLOCK_TERM(field, dict, key)                             \
  ExpectNear(a.accepted_length.field, b.accepted_length.field, tolerance, \
             where + " accepted_length." #field);
#include "losses/chunk_terms.inc"
}

// Bitwise, as every process must agree.
void ExpectTermsEqual(const ChunkTerms& a, const ChunkTerms& b,
                      const std::string& where) {
#define DFLASH_SUMMED_TERM(field, slot, dict, key) \
  EXPECT_EQ(a.field, b.field) << where << " " #field;
#define DFLASH_POSITION_TERM(field, slot, dict, key) \
  EXPECT_EQ(a.field, b.field) << where << " " #field;
#define DFLASH_BLOCK_TERM(field, dict, key)                    \
  EXPECT_EQ(a.accepted_length.field, b.accepted_length.field) \
      << where << " accepted_length." #field;
#include "losses/chunk_terms.inc"
}

template <typename T>
void ExpectRowOutputsEqual(const Result<T>& a, const Result<T>& b,
                           const std::string& where) {
  EXPECT_EQ(a.argmax, b.argmax) << where;
  EXPECT_EQ(a.top_k, b.top_k) << where;
  EXPECT_EQ(a.target_rank, b.target_rank) << where;
  EXPECT_EQ(a.top_k_values, b.top_k_values) << where;
  EXPECT_EQ(a.loss_weight, b.loss_weight) << where;
}

// Runs `run(shard, width)` on each of ranges' processes at once, over
// `vocab` classes; returns every process's result, or none (a test failure
// naming `where` and the process) when one failed.
template <typename Result, typename Run>
std::vector<Result> RunSharded(const Ranges& ranges, int64_t vocab,
                               std::chrono::milliseconds timeout,
                               const std::string& where, const Run& run) {
  const int size = static_cast<int>(ranges.offsets.size());
  ThreadGroup group(size, timeout);
  std::vector<Result> results(size);
  RunRanks(size, [&](int q) {
    const VocabShard shard{ranges.offsets[q], vocab, &group.exchange(q)};
    results[q] = run(shard, ranges.widths[q]);
  });
  for (int q = 0; q < size; ++q) {
    if (!results[q].status.ok()) {
      ADD_FAILURE() << where << " process " << q << ": " << results[q].status;
      return {};
    }
  }
  return results;
}

// bfloat16: the float computation's gradient rounded once, so within one
// bfloat16 step (2^-8 relative) of the single run's.
template <typename T>
void CheckCase(const LossCase& c, bool last_range) {
  const double tolerance = std::is_same_v<T, double> ? 1e-12 : 1e-6;
  const double gradient_tolerance =
      std::is_same_v<T, BFloat16> ? 1.0 / 256 : tolerance;
  absl::StatusOr<LossParams> params = ResolveChunkLoss(Parse(c.loss));
  ASSERT_TRUE(params.ok()) << params.status();
  const Chunk chunk = MakeChunk(17, last_range);
  const Result<T> single = RunChunk<T>(*params, c, chunk, 0, kV, nullptr);
  ASSERT_TRUE(single.status.ok()) << single.status;
  for (int size : {2, 3, 4}) {
    const std::string where = absl::StrCat(c.name, " W=", size);
    const Ranges ranges = SplitVocab(kV, size);
    const std::vector<Result<T>> results = RunSharded<Result<T>>(
        ranges, kV, kTimeout, where,
        [&](const VocabShard& shard, int64_t width) {
          return RunChunk<T>(*params, c, chunk, shard.offset, width, &shard);
        });
    if (results.empty()) return;
    const Result<T>& first = results[0];
    ExpectTermsNear(first.terms, single.terms, tolerance, where);
    EXPECT_EQ(first.argmax, single.argmax) << where;
    EXPECT_EQ(first.top_k, single.top_k) << where;
    EXPECT_EQ(first.target_rank, single.target_rank) << where;
    EXPECT_EQ(first.top_k_values, single.top_k_values) << where;
    for (int64_t r = 0; r < kRows; ++r) {
      const std::string row = absl::StrCat(where, " row ", r);
      ExpectNear(first.neg_log_q[r], single.neg_log_q[r], tolerance, row);
      ExpectNear(first.target_probability[r], single.target_probability[r],
                 tolerance, row + " q");
      ExpectNear(first.loss_weight[r], single.loss_weight[r], tolerance,
                 row + " w");
      ExpectNear(first.confidence_grad[r], single.confidence_grad[r],
                 tolerance, row + " confidence gradient");
      if (!single.teacher_acceptance.empty()) {
        ExpectNear(first.teacher_acceptance[r], single.teacher_acceptance[r],
                   tolerance, row + " teacher acceptance");
      }
    }
    // Each range's gradient against the single run's columns, normwise.
    double max_error = 0, max_value = 0;
    for (int q = 0; q < size; ++q) {
      const int64_t width = ranges.widths[q];
      for (int64_t r = 0; r < kRows; ++r) {
        for (int64_t v = 0; v < width; ++v) {
          const double a = AsDouble(results[q].gradient[r * width + v]);
          const double b =
              AsDouble(single.gradient[r * kV + ranges.offsets[q] + v]);
          max_error = std::max(max_error, std::abs(a - b));
          max_value = std::max(max_value, std::abs(b));
        }
      }
    }
    EXPECT_LE(max_error, gradient_tolerance * max_value)
        << where << " gradient";
    for (int q = 1; q < size; ++q) {
      const std::string other = absl::StrCat(where, " process ", q);
      ExpectTermsEqual(results[q].terms, first.terms, other);
      ExpectRowOutputsEqual(results[q], first, other);
      EXPECT_EQ(results[q].neg_log_q, first.neg_log_q) << other;
      EXPECT_EQ(results[q].target_probability, first.target_probability)
          << other;
      EXPECT_EQ(results[q].confidence_grad, first.confidence_grad) << other;
      EXPECT_EQ(results[q].teacher_acceptance, first.teacher_acceptance)
          << other;
    }
  }
}

class VocabParallelLossTest : public ::testing::TestWithParam<LossCase> {};

TEST_P(VocabParallelLossTest, Float64EqualsSingleProcess) {
  CheckCase<double>(GetParam(), /*last_range=*/false);
}

TEST_P(VocabParallelLossTest, Float64TargetsInTheLastRange) {
  CheckCase<double>(GetParam(), /*last_range=*/true);
}

TEST_P(VocabParallelLossTest, Float32EqualsSingleProcess) {
  CheckCase<float>(GetParam(), /*last_range=*/false);
}

TEST_P(VocabParallelLossTest, BFloat16EqualsSingleProcess) {
  CheckCase<BFloat16>(GetParam(), /*last_range=*/false);
}

INSTANTIATE_TEST_SUITE_P(
    Families, VocabParallelLossTest, ::testing::ValuesIn(LossCases()),
    [](const ::testing::TestParamInfo<LossCase>& info) {
      return info.param.name;
    });

TEST(VocabParallelLossTest, TiesAcrossRangesGoToTheLowerId) {
  const LossCase c{"Ties", "dflash {}", false};
  absl::StatusOr<LossParams> params = ResolveChunkLoss(Parse(c.loss));
  ASSERT_TRUE(params.ok());
  const Chunk chunk = MakeChunk(5, false);
  const Ranges ranges = SplitVocab(kV, 4);
  ThreadGroup group(4, kTimeout);
  std::vector<Result<double>> results(4);
  RunRanks(4, [&](int q) {
    const VocabShard shard{ranges.offsets[q], kV, &group.exchange(q)};
    results[q] = RunChunk<double>(*params, c, chunk, ranges.offsets[q],
                                  ranges.widths[q], &shard);
  });
  ASSERT_TRUE(results[0].status.ok()) << results[0].status;
  // Row 0's maximum is at ids 2, 5, 6, 8, 9 (ranges [0, 3) [3, 6) [6, 9)
  // [9, 11)).
  EXPECT_EQ(results[0].argmax[0], 2);
  EXPECT_EQ(std::vector<int32_t>(results[0].top_k.begin(),
                                 results[0].top_k.begin() + kTopK),
            (std::vector<int32_t>{2, 5, 6, 8, 9}));
}

// The exchanges a chunk of kRows rows makes, and the bytes each process
// sends: a handshake (kHandshakeSize values, as every gather that is not
// the rows' is), the stats (with top-k entries of (value, id) and, for
// the teacher diagnostics, the teacher's logit), then one gather per round
// of row sums (a waiting flag and a 2-value partial per row).
TEST(VocabParallelLossTest, GathersPerChunk) {
  struct Expected {
    const char* loss;
    bool teacher;
    int64_t gathers, bytes;
  };
  constexpr int64_t kHandshake = 8 * kHandshakeSize;
  auto stats = [](int64_t fields, int64_t entry) {
    return 8 * (2 + kRows * (fields + entry * kTopK));
  };
  constexpr int64_t kRound = 8 * (2 + kRows * 3);
  const Expected cases[] = {
      // One round: no row sum inside the pass.
      {"dflash {}", false, 3, kHandshake + stats(4, 2) + kRound},
      // The teacher diagnostics' L1: two rounds.
      {"dflash {}", true, 4, kHandshake + stats(7, 3) + 2 * kRound},
      {"dflash {} cross_entropy { label_smoothing: 0.1 }", false, 3,
       kHandshake + stats(5, 2) + kRound},
      {"dspark { l1_weight: 0.5 confidence_weight: 0.3 }", true, 4,
       kHandshake + stats(7, 2) + 2 * kRound},
      // Acceptance before the block weights, then the Renyi logsumexp.
      {"dspark { objective: DPARD ce_weight: 0 l1_weight: 0 }", true, 6,
       kHandshake + stats(7, 2) + 4 * kRound},
      // The tempered logsumexps, then the divergence's sum.
      {"distillation { divergence: JSD }", true, 5,
       kHandshake + stats(7, 2) + 3 * kRound},
  };
  for (const Expected& e : cases) {
    absl::StatusOr<LossParams> params = ResolveChunkLoss(Parse(e.loss));
    ASSERT_TRUE(params.ok());
    const LossCase c{"", e.loss, e.teacher};
    const Chunk chunk = MakeChunk(9, false);
    const Ranges ranges = SplitVocab(kV, 2);
    ThreadGroup group(2, kTimeout);
    RunRanks(2, [&](int q) {
      const VocabShard shard{ranges.offsets[q], kV, &group.exchange(q)};
      EXPECT_TRUE(RunChunk<double>(*params, c, chunk, ranges.offsets[q],
                                   ranges.widths[q], &shard)
                      .status.ok());
    });
    EXPECT_EQ(group.calls(0), e.gathers) << e.loss;
    EXPECT_EQ(group.bytes(0), e.bytes) << e.loss;
  }
}

// Runs a 2- or 3-process chunk where `setup` edits each process's shard
// and chunk; returns every process's status.
std::vector<absl::Status> RunWith(
    int size, const std::string& loss,
    const std::function<void(int, VocabShard&, Chunk&, int64_t&)>& setup) {
  absl::StatusOr<LossParams> params = ResolveChunkLoss(Parse(loss));
  EXPECT_TRUE(params.ok());
  const Ranges ranges = SplitVocab(kV, size);
  ThreadGroup group(size, kTimeout);
  std::vector<absl::Status> statuses(size);
  RunRanks(size, [&](int q) {
    VocabShard shard{ranges.offsets[q], kV, &group.exchange(q)};
    Chunk chunk = MakeChunk(3, false);
    int64_t width = ranges.widths[q];
    setup(q, shard, chunk, width);
    statuses[q] = RunChunk<double>(*params, {"", loss, true}, chunk,
                                   shard.offset, width, &shard)
                      .status;
  });
  return statuses;
}

TEST(VocabParallelLossTest, MismatchedOffsetsAreAnErrorOnEveryProcess) {
  const std::vector<absl::Status> statuses = RunWith(
      3, "dflash {}", [](int q, VocabShard& shard, Chunk&, int64_t& width) {
        if (q == 2) {  // Ranges [0, 4) [4, 8) then [7, 10): overlapping.
          shard.offset = 7;
          width = 3;
        }
      });
  for (const absl::Status& status : statuses) {
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_EQ(status.message(),
              "chunk loss: vocab_shard.offset: process 2 starts at class 7, "
              "expected 8 (the processes' ranges tile [0, vocab) in rank "
              "order)");
  }
}

TEST(VocabParallelLossTest, RangesShortOfTheVocabularyAreAnError) {
  const std::vector<absl::Status> statuses = RunWith(
      2, "dflash {}", [](int q, VocabShard&, Chunk&, int64_t& width) {
        if (q == 1) width = 4;  // [0, 6) [6, 10) of 11.
      });
  for (const absl::Status& status : statuses) {
    EXPECT_EQ(status.message(),
              "chunk loss: vocab_shard: the processes' ranges end at class "
              "10, expected vocab = 11 (the ranges tile [0, vocab) in rank "
              "order)");
  }
}

TEST(VocabParallelLossTest, MismatchedVocabIsAnErrorOnEveryProcess) {
  const std::vector<absl::Status> statuses = RunWith(
      2, "dflash {}", [](int q, VocabShard& shard, Chunk&, int64_t& width) {
        if (q == 1) {
          shard.vocab = 12;
          width = 6;
        }
      });
  for (const absl::Status& status : statuses) {
    EXPECT_EQ(status.message(),
              "chunk loss: vocab_shard.vocab: differs across the group: "
              "process 1 has 12, process 0 has 11");
  }
}

TEST(VocabParallelLossTest, AnErrorOnOneProcessIsAnErrorOnEvery) {
  for (const char* loss :
       {"dflash {}", "dspark { l1_weight: 0.5 confidence_weight: 0.3 }",
        "distillation { divergence: JSD }"}) {
    const std::vector<absl::Status> statuses = RunWith(
        3, loss, [](int q, VocabShard&, Chunk& chunk, int64_t&) {
          if (q == 1) chunk.logits[4 * kV + 5] = std::nan("");  // Class 5.
        });
    EXPECT_EQ(statuses[1].message(),
              "row 4: logit 1 is not finite (nan) (counted from class 4, "
              "this process's first)")
        << loss;
    for (int q : {0, 2}) {
      EXPECT_EQ(statuses[q].code(), absl::StatusCode::kInvalidArgument);
      EXPECT_EQ(statuses[q].message(),
                "row 4: vocab_shard: process 1 of 3 failed on this row (its "
                "own error says why)")
          << loss;
    }
  }
}

TEST(VocabParallelLossTest, AConfidenceErrorAfterARowSumIsAnErrorOnEvery) {
  // DSpark's confidence is read after its L1 row sum, in the second round.
  const std::vector<absl::Status> statuses =
      RunWith(2, "dspark { l1_weight: 0.5 confidence_weight: 0.3 }",
              [](int, VocabShard&, Chunk& chunk, int64_t&) {
                chunk.confidence[6] = std::nanf("");
              });
  for (const absl::Status& status : statuses) {
    EXPECT_EQ(status.message(), "row 6: confidence logit is not finite (nan)");
  }
}

// Domino: the base logits (Chunk::logits) and a correction's logits
// (Chunk::teacher stands in for them), both this range's; its final and
// base logits' stats merged from one gather.
struct DominoCase {
  std::string name;
  std::string loss;
  double scale = 1, softcap = 0;
  bool masked = false;  // Every row without a mask.
};

std::vector<DominoCase> DominoCases() {
  return {
      {"Domino", "domino { lambda_base: 0.3 pure_draft_prefix_len: 1 "
                 "gamma: 4 }"},
      {"DominoShift", "domino { lambda_base: 0.3 shift_label: true gamma: 4 }"},
      {"DominoFinalOnly", "domino { shift_label: true pure_draft_prefix_len: "
                          "1 }"},
      {"DominoSoftcapScale", "domino { lambda_base: 0.5 }", 0.7, 5},
      {"DominoMaskedChunk", "domino { lambda_base: 0.3 }", 1, 0, true},
  };
}

template <typename T>
struct DominoResult {
  absl::Status status;
  ChunkTerms terms;
  std::vector<T> base, correction;  // Gradients, [rows x width].
  std::vector<double> neg_log_q, target_probability, loss_weight;
  std::vector<int32_t> argmax, base_argmax;
};

template <typename T>
DominoResult<T> RunDomino(const LossParams& params, const DominoCase& c,
                          const Chunk& chunk, int64_t offset, int64_t width,
                          const VocabShard* shard) {
  DominoResult<T> out;
  for (int64_t r = 0; r < kRows; ++r) {
    for (int64_t v = 0; v < width; ++v) {
      out.base.push_back(FromDouble<T>(chunk.logits[r * kV + offset + v]));
      out.correction.push_back(
          FromDouble<T>(chunk.teacher[r * kV + offset + v]));
    }
  }
  out.neg_log_q.resize(kRows);
  out.target_probability.resize(kRows);
  out.loss_weight.resize(kRows);
  out.argmax.resize(kRows);
  out.base_argmax.resize(kRows);
  const ChunkLossOptions options{kK, c.scale, c.softcap, 0, shard};
  absl::StatusOr<CpuChunkLoss<T>> loss =
      CpuChunkLoss<T>::Create(params, options);
  if (!loss.ok()) {
    out.status = loss.status();
    return out;
  }
  std::vector<RowMeta> rows = chunk.rows;
  if (c.masked) {
    for (RowMeta& row : rows) row.mask = 0;
  }
  ChunkLossInputs<T> inputs{absl::MakeSpan(out.base), {}, {}, rows, width,
                            absl::MakeSpan(out.correction)};
  ChunkLossOutputs outputs;
  outputs.neg_log_q = absl::MakeSpan(out.neg_log_q);
  outputs.argmax = absl::MakeSpan(out.argmax);
  outputs.target_probability = absl::MakeSpan(out.target_probability);
  outputs.loss_weight = absl::MakeSpan(out.loss_weight);
  outputs.base_argmax = absl::MakeSpan(out.base_argmax);
  absl::StatusOr<ChunkTerms> terms = loss->Run(inputs, outputs);
  out.status = terms.status();
  if (terms.ok()) out.terms = *terms;
  return out;
}

// The ranges' gradients stacked against the single run's, normwise.
template <typename T>
double DominoGradientError(const std::vector<DominoResult<T>>& results,
                           const Ranges& ranges,
                           const std::vector<T>& single,
                           std::vector<T> DominoResult<T>::*field) {
  double max_error = 0, max_value = 0;
  for (size_t q = 0; q < results.size(); ++q) {
    const int64_t width = ranges.widths[q];
    for (int64_t r = 0; r < kRows; ++r) {
      for (int64_t v = 0; v < width; ++v) {
        const double a = AsDouble((results[q].*field)[r * width + v]);
        const double b = AsDouble(single[r * kV + ranges.offsets[q] + v]);
        max_error = std::max(max_error, std::abs(a - b));
        max_value = std::max(max_value, std::abs(b));
      }
    }
  }
  return max_value > 0 ? max_error / max_value : max_error;
}

template <typename T>
void CheckDomino(const DominoCase& c) {
  const double tolerance = std::is_same_v<T, double> ? 1e-12 : 1e-6;
  const double gradient_tolerance =
      std::is_same_v<T, BFloat16> ? 1.0 / 256 : tolerance;
  absl::StatusOr<LossParams> params = ResolveChunkLoss(Parse(c.loss));
  ASSERT_TRUE(params.ok()) << params.status();
  const Chunk chunk = MakeChunk(29, false);
  const DominoResult<T> single = RunDomino<T>(*params, c, chunk, 0, kV, nullptr);
  ASSERT_TRUE(single.status.ok()) << single.status;
  for (int size : {2, 3, 4}) {
    const std::string where = absl::StrCat(c.name, " W=", size);
    const Ranges ranges = SplitVocab(kV, size);
    const std::vector<DominoResult<T>> results = RunSharded<DominoResult<T>>(
        ranges, kV, kTimeout, where,
        [&](const VocabShard& shard, int64_t width) {
          return RunDomino<T>(*params, c, chunk, shard.offset, width, &shard);
        });
    if (results.empty()) return;
    const DominoResult<T>& first = results[0];
    ExpectTermsNear(first.terms, single.terms, tolerance, where);
    EXPECT_EQ(first.argmax, single.argmax) << where;
    EXPECT_EQ(first.base_argmax, single.base_argmax) << where;
    for (int64_t r = 0; r < kRows; ++r) {
      const std::string row = absl::StrCat(where, " row ", r);
      ExpectNear(first.neg_log_q[r], single.neg_log_q[r], tolerance, row);
      ExpectNear(first.target_probability[r], single.target_probability[r],
                 tolerance, row + " q");
      ExpectNear(first.loss_weight[r], single.loss_weight[r], tolerance,
                 row + " w");
    }
    EXPECT_LE(DominoGradientError(results, ranges, single.base,
                                  &DominoResult<T>::base),
              gradient_tolerance)
        << where << " d/d(base logits)";
    EXPECT_LE(DominoGradientError(results, ranges, single.correction,
                                  &DominoResult<T>::correction),
              gradient_tolerance)
        << where << " d/d(correction logits)";
    for (int q = 1; q < size; ++q) {
      const std::string other = absl::StrCat(where, " process ", q);
      ExpectTermsEqual(results[q].terms, first.terms, other);
      EXPECT_EQ(results[q].argmax, first.argmax) << other;
      EXPECT_EQ(results[q].base_argmax, first.base_argmax) << other;
      EXPECT_EQ(results[q].neg_log_q, first.neg_log_q) << other;
      EXPECT_EQ(results[q].target_probability, first.target_probability)
          << other;
      EXPECT_EQ(results[q].loss_weight, first.loss_weight) << other;
    }
  }
}

class VocabParallelDominoTest : public ::testing::TestWithParam<DominoCase> {};

TEST_P(VocabParallelDominoTest, Float64EqualsSingleProcess) {
  CheckDomino<double>(GetParam());
}

TEST_P(VocabParallelDominoTest, Float32EqualsSingleProcess) {
  CheckDomino<float>(GetParam());
}

TEST_P(VocabParallelDominoTest, BFloat16EqualsSingleProcess) {
  CheckDomino<BFloat16>(GetParam());
}

INSTANTIATE_TEST_SUITE_P(
    Domino, VocabParallelDominoTest, ::testing::ValuesIn(DominoCases()),
    [](const ::testing::TestParamInfo<DominoCase>& info) {
      return info.param.name;
    });

TEST(VocabParallelDominoTest, TiesAcrossRangesGoToTheLowerId) {
  const DominoCase c{"Ties", "domino { lambda_base: 0.3 }"};
  absl::StatusOr<LossParams> params = ResolveChunkLoss(Parse(c.loss));
  ASSERT_TRUE(params.ok());
  const Chunk chunk = MakeChunk(5, false);
  const Ranges ranges = SplitVocab(kV, 4);
  ThreadGroup group(4, kTimeout);
  std::vector<DominoResult<double>> results(4);
  RunRanks(4, [&](int q) {
    const VocabShard shard{ranges.offsets[q], kV, &group.exchange(q)};
    results[q] = RunDomino<double>(*params, c, chunk, ranges.offsets[q],
                                   ranges.widths[q], &shard);
  });
  ASSERT_TRUE(results[0].status.ok()) << results[0].status;
  // Rows 0 and 5 have their base and correction maxima at ids 2, 5, 6, 8,
  // 9 (ranges [0, 3) [3, 6) [6, 9) [9, 11)); row 5 is past suffix_start 1.
  EXPECT_EQ(results[0].base_argmax[0], 2);
  EXPECT_EQ(results[0].base_argmax[5], 2);
  EXPECT_EQ(results[0].argmax[0], 2);
  EXPECT_EQ(results[0].argmax[5], 2);
}

// A handshake, the stats (the final and the base logits' four fields a
// row) and the chunk's closing gather (a record head).
TEST(VocabParallelDominoTest, GathersPerChunk) {
  absl::StatusOr<LossParams> params =
      ResolveChunkLoss(Parse("domino { lambda_base: 0.3 }"));
  ASSERT_TRUE(params.ok());
  const DominoCase c{"", "domino { lambda_base: 0.3 }"};
  const Chunk chunk = MakeChunk(9, false);
  const Ranges ranges = SplitVocab(kV, 2);
  ThreadGroup group(2, kTimeout);
  RunRanks(2, [&](int q) {
    const VocabShard shard{ranges.offsets[q], kV, &group.exchange(q)};
    EXPECT_TRUE(RunDomino<double>(*params, c, chunk, ranges.offsets[q],
                                  ranges.widths[q], &shard)
                    .status.ok());
  });
  EXPECT_EQ(group.calls(0), 3);
  EXPECT_EQ(group.bytes(0), 8 * kHandshakeSize + 8 * (2 + kRows * 8) + 8 * 2);
}

TEST(VocabParallelDominoTest, AnErrorOnOneProcessIsAnErrorOnEvery) {
  absl::StatusOr<LossParams> params =
      ResolveChunkLoss(Parse("domino { lambda_base: 0.3 }"));
  ASSERT_TRUE(params.ok());
  const DominoCase c{"", "domino { lambda_base: 0.3 }"};
  const Ranges ranges = SplitVocab(kV, 3);
  ThreadGroup group(3, kTimeout);
  std::vector<absl::Status> statuses(3);
  RunRanks(3, [&](int q) {
    const VocabShard shard{ranges.offsets[q], kV, &group.exchange(q)};
    Chunk chunk = MakeChunk(3, false);
    // Row 5 (position 1) is past suffix_start 1: its final logit at class
    // 5 is nan.
    if (q == 1) chunk.teacher[5 * kV + 5] = std::nan("");
    statuses[q] = RunDomino<double>(*params, c, chunk, ranges.offsets[q],
                                    ranges.widths[q], &shard)
                      .status;
  });
  EXPECT_EQ(statuses[1].message(),
            "row 5: logit 1 is not finite (nan) (counted from class 4, this "
            "process's first)");
  for (int q : {0, 2}) {
    EXPECT_EQ(statuses[q].message(),
              "row 5: vocab_shard: process 1 of 3 failed on this row (its own "
              "error says why)");
  }
}

// A float gradient that overflows in the target's range alone (row 6's
// mask of 1e39): the chunk's closing gather stops every process.
TEST(VocabParallelDominoTest, AnOverflowInOneRangeIsAnErrorOnEvery) {
  absl::StatusOr<LossParams> params =
      ResolveChunkLoss(Parse("domino { lambda_base: 0.3 }"));
  ASSERT_TRUE(params.ok());
  const DominoCase c{"", "domino { lambda_base: 0.3 }"};
  Chunk chunk = MakeChunk(3, false);
  chunk.rows[6].mask = 1e39;
  const DominoResult<float> single =
      RunDomino<float>(*params, c, chunk, 0, kV, nullptr);
  ASSERT_TRUE(absl::StrContains(single.status.message(), "overflows"))
      << single.status;
  const Ranges ranges = SplitVocab(kV, 3);
  ThreadGroup group(3, kTimeout);
  std::vector<absl::Status> statuses(3);
  RunRanks(3, [&](int q) {
    const VocabShard shard{ranges.offsets[q], kV, &group.exchange(q)};
    statuses[q] = RunDomino<float>(*params, c, chunk, ranges.offsets[q],
                                   ranges.widths[q], &shard)
                      .status;
  });
  int overflowed = 0;
  for (int q = 0; q < 3; ++q) {
    ASSERT_FALSE(statuses[q].ok()) << q;
    if (statuses[q].message() == single.status.message()) {
      ++overflowed;
    } else {
      EXPECT_TRUE(absl::StartsWith(statuses[q].message(),
                                   "row 6: vocab_shard: process "))
          << statuses[q];
    }
  }
  EXPECT_GE(overflowed, 1);
  EXPECT_LT(overflowed, 3);
}

// A shard's own fields (CheckShardFields): the loss's options, its inputs'
// width, and the head's.
TEST(VocabParallelLossTest, AShardsFieldsAreChecked) {
  ThreadGroup group(1, kTimeout);
  VocabExchange* exchange = &group.exchange(0);
  const struct {
    VocabShard shard;
    std::string error;  // After the name of the shard.
  } cases[] = {
      {{0, kV, nullptr}, ".exchange: must be set, got none"},
      {{0, 0, exchange}, ".vocab: must lie in [1, 2^31), got 0"},
      {{0, int64_t{1} << 31, exchange},
       ".vocab: must lie in [1, 2^31), got 2147483648"},
      {{-1, kV, exchange},
       absl::StrCat(".offset: must lie in [0, vocab = ", kV, "), got -1")},
      {{kV, kV, exchange},
       absl::StrCat(".offset: must lie in [0, vocab = ", kV, "), got ", kV)},
      {{1, kV, exchange},
       absl::StrCat(": classes [offset, offset + width) = [1, ", kV + 1,
                    ") must lie in [0, vocab = ", kV,
                    ") (width: the logits')")},
  };
  absl::StatusOr<LossParams> params = ResolveChunkLoss(Parse("dflash {}"));
  ASSERT_TRUE(params.ok());
  for (const auto& c : cases) {
    // The loss's options (the width not known yet), else its inputs.
    const absl::Status options =
        ValidateChunkLossOptions({kK, 1, 0, 0, &c.shard});
    if (!options.ok()) {
      EXPECT_EQ(options.message(), absl::StrCat("vocab_shard", c.error));
    } else {
      EXPECT_EQ(RunChunk<double>(*params, {"", "dflash {}", false},
                                 MakeChunk(3, false), 0, kV, &c.shard)
                    .status.message(),
                absl::StrCat("chunk loss: vocab_shard", c.error));
    }
  }
}

}  // namespace
}  // namespace dflash

namespace dflash {
namespace {

using head_test::Batch;
using head_test::ConfigBuilder;
using testing_vocab::Ranges;
using testing_vocab::RunRanks;
using testing_vocab::SplitVocab;
using testing_vocab::ThreadGroup;

constexpr int64_t kHeadV = head_test::kV, kH = head_test::kH;
constexpr int32_t kHeadTopK = head_test::kTopK;
constexpr int64_t kCorrectionRank = 2;
constexpr std::chrono::milliseconds kHeadTimeout(20000);

// What one process's head run left.
struct HeadRun {
  absl::Status status;
  HeadResult result;
  std::vector<double> grad_hidden, grad_weight, grad_bias, grad_z, grad_m;
  std::vector<double> grad_confidence, neg_log_q, loss_weight;
  std::vector<int32_t> argmax, base_argmax, teacher_argmax, top_k;
};

// The batch with a fully masked chunk (blocks 2 and 3: chunk 1 of 3) and a
// correction's inputs and weight.
struct HeadBatch {
  Batch b;
  std::vector<double> z, m;
};

HeadBatch MakeHeadBatch() {
  HeadBatch h{head_test::MakeBatch(11)};
  for (int64_t r = 2 * head_test::kK; r < 4 * head_test::kK; ++r) {
    h.b.rows[r].mask = 0;
  }
  std::mt19937 rng(23);
  std::normal_distribution<double> normal(0, 0.5);
  for (int64_t i = 0; i < h.b.num_rows() * kCorrectionRank; ++i) {
    h.z.push_back(normal(rng));
  }
  for (int64_t i = 0; i < kHeadV * kCorrectionRank; ++i) {
    h.m.push_back(normal(rng));
  }
  return h;
}

template <typename T>
std::vector<T> As(const std::vector<double>& x);
template <>
std::vector<double> As(const std::vector<double>& x) {
  return x;
}
template <>
std::vector<float> As(const std::vector<double>& x) {
  return std::vector<float>(x.begin(), x.end());
}
template <typename T>
std::vector<double> Widened(const std::vector<T>& x) {
  return std::vector<double>(x.begin(), x.end());
}

// What a process's run changes, to make it fail there alone.
struct RunTweaks {
  int64_t limit_bytes = std::numeric_limits<int64_t>::max();
  double upstream_gradient = 0.75;
};

// Process `shard`'s run (the whole head without one) in the config's
// dtype, FLOAT64 or FLOAT32; its gradients read back in double.
template <typename T>
HeadRun RunHeadRangeAs(const v1::ObjectiveConfig& whole, const HeadBatch& h,
                       int64_t offset, int64_t width, const VocabShard* shard,
                       bool forward_only, const RunTweaks& tweaks) {
  const Batch& b = h.b;
  v1::ObjectiveConfig config = whole;
  config.mutable_head()->set_vocab_size(width);
  const v1::HeadConfig& head = config.head();
  const int64_t rows = b.num_rows(), rank = head.correction_rank();
  HeadRun out;
  auto rows_of = [&](const std::vector<double>& all, int64_t columns) {
    return As<T>(std::vector<double>(all.begin() + offset * columns,
                                     all.begin() + (offset + width) * columns));
  };
  const std::vector<T> weight = rows_of(b.weight, kH);
  const std::vector<T> bias = rows_of(b.bias, 1);
  const std::vector<T> m = rank > 0 ? rows_of(h.m, rank) : std::vector<T>();
  const std::vector<T> hidden = As<T>(b.hidden), teacher = As<T>(b.teacher),
                       z = As<T>(h.z);
  HeadInputs<T> inputs;
  inputs.hidden = hidden;
  inputs.teacher_hidden = teacher;
  const std::vector<ConfidenceOf<T>> confidence(b.confidence.begin(),
                                                b.confidence.end());
  inputs.confidence_logits = confidence;
  inputs.rows = b.rows;
  inputs.weight = weight;
  if (head.bias()) inputs.bias = bias;
  if (rank > 0) {
    inputs.correction_inputs = z;
    inputs.correction_weight = m;
  }
  std::vector<T> grad_hidden, grad_weight, grad_bias, grad_z, grad_m;
  std::vector<ConfidenceOf<T>> grad_confidence(rows);
  HeadGradients<T> gradients;
  gradients.confidence = absl::MakeSpan(grad_confidence);
  if (!forward_only) {
    grad_hidden.resize(rows * kH);
    gradients.hidden = absl::MakeSpan(grad_hidden);
    if (head.trainable()) {
      grad_weight.resize(width * kH);
      gradients.weight = absl::MakeSpan(grad_weight);
      if (head.bias()) {
        grad_bias.resize(width);
        gradients.bias = absl::MakeSpan(grad_bias);
      }
    }
    if (rank > 0) {
      grad_z.resize(rows * rank);
      grad_m.resize(width * rank);
      gradients.correction_inputs = absl::MakeSpan(grad_z);
      gradients.correction_weight = absl::MakeSpan(grad_m);
    }
  }
  out.neg_log_q.resize(rows);
  out.loss_weight.resize(rows);
  out.argmax.resize(rows);
  out.base_argmax.resize(rows);
  out.teacher_argmax.resize(rows);
  // Domino takes no top-k.
  const bool top_k = !config.loss().has_domino();
  out.top_k.resize(top_k ? rows * kHeadTopK : 0);
  HeadRowOutputs row_outputs;
  row_outputs.neg_log_q = absl::MakeSpan(out.neg_log_q);
  row_outputs.argmax = absl::MakeSpan(out.argmax);
  row_outputs.base_argmax = absl::MakeSpan(out.base_argmax);
  row_outputs.teacher_argmax = absl::MakeSpan(out.teacher_argmax);
  row_outputs.top_k = absl::MakeSpan(out.top_k);
  row_outputs.k = top_k ? kHeadTopK : 0;
  row_outputs.loss_weight = absl::MakeSpan(out.loss_weight);
  HeadOptions options;
  options.upstream_gradient = tweaks.upstream_gradient;
  options.vocab_shard = shard;
  options.forward_only = forward_only;
  TrackingAllocator allocator(tweaks.limit_bytes);
  absl::StatusOr<HeadResult> result =
      RunHead<T>(config, inputs, gradients, allocator, row_outputs, options);
  out.status = result.status();
  if (result.ok()) out.result = *std::move(result);
  out.grad_confidence = Widened(grad_confidence);
  out.grad_hidden = Widened(grad_hidden);
  out.grad_weight = Widened(grad_weight);
  out.grad_bias = Widened(grad_bias);
  out.grad_z = Widened(grad_z);
  out.grad_m = Widened(grad_m);
  return out;
}

HeadRun RunHeadRange(const v1::ObjectiveConfig& whole, const HeadBatch& h,
                     int64_t offset, int64_t width, const VocabShard* shard,
                     bool forward_only = false,
                     const RunTweaks& tweaks = RunTweaks()) {
  if (whole.head().dtype() == v1::HeadConfig::FLOAT32) {
    return RunHeadRangeAs<float>(whole, h, offset, width, shard, forward_only,
                                 tweaks);
  }
  return RunHeadRangeAs<double>(whole, h, offset, width, shard, forward_only,
                                tweaks);
}

// max |a - b| / max |b| over the whole tensor.
double NormwiseError(const std::vector<double>& a,
                     const std::vector<double>& b) {
  double error = 0, norm = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    error = std::max(error, std::abs(a[i] - b[i]));
    norm = std::max(norm, std::abs(b[i]));
  }
  return norm > 0 ? error / norm : error;
}

// The ranks' rows of a [V, columns] gradient, stacked in rank order.
std::vector<double> Stacked(const std::vector<HeadRun>& runs,
                            std::vector<double> HeadRun::*field) {
  std::vector<double> all;
  for (const HeadRun& run : runs) {
    all.insert(all.end(), (run.*field).begin(), (run.*field).end());
  }
  return all;
}

// The ranks' partial sums of a gradient, added.
std::vector<double> Summed(const std::vector<HeadRun>& runs,
                           std::vector<double> HeadRun::*field) {
  std::vector<double> sum((runs[0].*field).size(), 0.0);
  for (const HeadRun& run : runs) {
    for (size_t i = 0; i < sum.size(); ++i) sum[i] += (run.*field)[i];
  }
  return sum;
}

// float64 within 1e-12, float32 1e-6 (relative; gradients normwise).
void CheckHead(const v1::ObjectiveConfig& config, const std::string& name,
               bool forward_only = false) {
  const double kTolerance =
      config.head().dtype() == v1::HeadConfig::FLOAT32 ? 1e-6 : 1e-12;
  const HeadBatch h = MakeHeadBatch();
  const HeadRun single =
      RunHeadRange(config, h, 0, kHeadV, nullptr, forward_only);
  ASSERT_TRUE(single.status.ok()) << name << " " << single.status;
  for (int size : {2, 3}) {
    const std::string where = absl::StrCat(name, " W=", size);
    const Ranges ranges = SplitVocab(kHeadV, size);
    const std::vector<HeadRun> runs = RunSharded<HeadRun>(
        ranges, kHeadV, kHeadTimeout, where,
        [&](const VocabShard& shard, int64_t width) {
          return RunHeadRange(config, h, shard.offset, width, &shard,
                              forward_only);
        });
    if (runs.empty()) return;
    const HeadRun& first = runs[0];
    ExpectNear(first.result.loss, single.result.loss, kTolerance,
               where + " loss");
    ExpectTermsNear(first.result.terms, single.result.terms, kTolerance,
                    where);
    EXPECT_EQ(first.argmax, single.argmax) << where;
    EXPECT_EQ(first.base_argmax, single.base_argmax) << where;
    EXPECT_EQ(first.teacher_argmax, single.teacher_argmax) << where;
    EXPECT_EQ(first.top_k, single.top_k) << where;
    for (size_t r = 0; r < single.neg_log_q.size(); ++r) {
      // Double outputs (the confidence gradient in the head's dtype).
      ExpectNear(first.neg_log_q[r], single.neg_log_q[r], kTolerance,
                 absl::StrCat(where, " neg_log_q ", r));
      ExpectNear(first.loss_weight[r], single.loss_weight[r], kTolerance,
                 absl::StrCat(where, " loss_weight ", r));
      ExpectNear(first.grad_confidence[r], single.grad_confidence[r],
                 kTolerance, absl::StrCat(where, " confidence gradient ", r));
    }
    EXPECT_LE(NormwiseError(Summed(runs, &HeadRun::grad_hidden),
                            single.grad_hidden),
              kTolerance)
        << where << " d/d(hidden) summed over the processes";
    EXPECT_LE(NormwiseError(Stacked(runs, &HeadRun::grad_weight),
                            single.grad_weight),
              kTolerance)
        << where << " d/d(weight)";
    EXPECT_LE(
        NormwiseError(Stacked(runs, &HeadRun::grad_bias), single.grad_bias),
        kTolerance)
        << where << " d/d(bias)";
    EXPECT_LE(NormwiseError(Stacked(runs, &HeadRun::grad_m), single.grad_m),
              kTolerance)
        << where << " d/d(correction weight)";
    EXPECT_LE(NormwiseError(Summed(runs, &HeadRun::grad_z), single.grad_z),
              kTolerance)
        << where << " d/d(correction inputs) summed over the processes";
    for (int q = 1; q < size; ++q) {
      const std::string other = absl::StrCat(where, " process ", q);
      EXPECT_EQ(runs[q].result.loss, first.result.loss) << other;
      ExpectTermsEqual(runs[q].result.terms, first.result.terms, other);
      EXPECT_EQ(runs[q].argmax, first.argmax) << other;
      EXPECT_EQ(runs[q].base_argmax, first.base_argmax) << other;
      EXPECT_EQ(runs[q].teacher_argmax, first.teacher_argmax) << other;
      EXPECT_EQ(runs[q].top_k, first.top_k) << other;
      EXPECT_EQ(runs[q].neg_log_q, first.neg_log_q) << other;
      EXPECT_EQ(runs[q].loss_weight, first.loss_weight) << other;
      EXPECT_EQ(runs[q].grad_confidence, first.grad_confidence) << other;
    }
  }
}

const char* const kHeadLosses[] = {
    "dflash { gamma: 7 }",
    "dpace { alpha: 0.3 }",
    "dpace { alpha: 0.3 denominator: SEQUENCE_BALANCED }",
    "tv { gamma: 7 }",
    "lk_lambda { gamma: 7 kl_scale: 0.8 kl_decay: 2 }",
    "dflash { gamma: 7 lk { type: LAMBDA kl_scale: 0.8 kl_decay: 2 } }",
    "dpace { alpha: 0.3 lk { type: TV } }",
    "dspark { gamma: 7 l1_weight: 0.5 confidence_weight: 0.3 }",
    "dspark { objective: DPARD ce_weight: 0 l1_weight: 0 confidence_weight: "
    "0.4 }",
    "distillation { divergence: FORWARD_KL temperature: 2 }",
    "distillation { divergence: JSD beta: 0.3 }",
};

TEST(VocabParallelHeadTest, EveryModeEqualsTheSingleProcessHead) {
  for (const char* loss : kHeadLosses) {
    for (const char* mode : head_test::kModes) {
      const v1::ObjectiveConfig config =
          ConfigBuilder(loss)
              .Mode(mode)
              .Trainable(head_test::TrainsWith(loss))
              .ExtraHead("metric_top_k: 4")
              .Build();
      CheckHead(config, absl::StrCat(loss, " ", mode));
    }
  }
}

TEST(VocabParallelHeadTest, Float32AndForwardOnly) {
  for (const char* loss :
       {"dflash { gamma: 7 }", "dpace { alpha: 0.3 }",
        "dspark { gamma: 7 l1_weight: 0.5 confidence_weight: 0.3 }",
        "distillation { divergence: JSD beta: 0.3 }"}) {
    for (const char* mode : {"FUSED", "CHECKPOINT"}) {
      v1::ObjectiveConfig config = ConfigBuilder(loss)
                                       .Mode(mode)
                                       .Trainable(head_test::TrainsWith(loss))
                                       .ExtraHead("metric_top_k: 4")
                                       .Build();
      CheckHead(config, absl::StrCat(loss, " ", mode, " forward only"),
                /*forward_only=*/true);
      config.mutable_head()->set_dtype(v1::HeadConfig::FLOAT32);
      CheckHead(config, absl::StrCat(loss, " ", mode, " float32"));
    }
  }
}

TEST(VocabParallelHeadTest, TeacherDiagnosticsAndACorrection) {
  for (const char* mode : {"FUSED", "CHECKPOINT"}) {
    CheckHead(ConfigBuilder("dflash { gamma: 7 }")
                  .Mode(mode)
                  .Trainable()
                  .ExtraHead("teacher_diagnostics: true correction_rank: 2 "
                             "logit_softcap: 6")
                  .Build(),
              absl::StrCat("diagnostics and correction ", mode));
    CheckHead(ConfigBuilder(
                  "dspark { gamma: 7 l1_weight: 0.5 confidence_weight: 0.3 }")
                  .Mode(mode)
                  .Trainable()
                  .ExtraHead("correction_rank: 2")
                  .Build(),
              absl::StrCat("dspark correction ", mode));
  }
}

// Every process's status when process 1 runs `other` instead of `config`.
std::vector<absl::Status> HeadStatuses(const v1::ObjectiveConfig& config,
                                       const v1::ObjectiveConfig& other) {
  const HeadBatch h = MakeHeadBatch();
  const Ranges ranges = SplitVocab(kHeadV, 2);
  ThreadGroup group(2, kHeadTimeout);
  std::vector<absl::Status> statuses(2);
  RunRanks(2, [&](int q) {
    const VocabShard shard{ranges.offsets[q], kHeadV, &group.exchange(q)};
    statuses[q] = RunHeadRange(q == 1 ? other : config, h, ranges.offsets[q],
                               ranges.widths[q], &shard)
                      .status;
  });
  return statuses;
}

TEST(VocabParallelHeadTest, DifferentConfigsAreAnErrorOnEveryProcess) {
  const std::vector<absl::Status> statuses =
      HeadStatuses(ConfigBuilder("dflash { gamma: 7 }").Build(),
                   ConfigBuilder("dflash { gamma: 6 }").Build());
  for (const absl::Status& status : statuses) {
    EXPECT_TRUE(absl::StartsWith(
        status.message(),
        "vocab_shard: the config (but head.vocab_size and head.threads) "
        "differs across the group: process 1 has "))
        << status;
  }
}

TEST(VocabParallelHeadTest, AnInvalidInputOnOneProcessIsAnErrorOnEvery) {
  v1::ObjectiveConfig config = ConfigBuilder("dflash {}").Build();
  v1::ObjectiveConfig bad = config;
  bad.mutable_loss()->mutable_dflash()->set_gamma(-1);  // Invalid.
  const std::vector<absl::Status> statuses = HeadStatuses(config, bad);
  EXPECT_EQ(statuses[0].message(),
            "vocab_shard: process 1 of 2 failed: INVALID_ARGUMENT (its own "
            "error says why)");
  EXPECT_TRUE(absl::StrContains(statuses[1].message(), "gamma"))
      << statuses[1];
}

// Two processes, process 1's run changed by `tweaks` (its exchange set up
// by `fail`); every process's run. A hang would fail at the group's
// timeout (DeadlineExceeded).
std::vector<HeadRun> FailOnProcessOne(
    const v1::ObjectiveConfig& config, const RunTweaks& tweaks,
    const std::function<void(ThreadGroup&)>& fail = [](ThreadGroup&) {}) {
  const HeadBatch h = MakeHeadBatch();
  const Ranges ranges = SplitVocab(kHeadV, 2);
  ThreadGroup group(2, kHeadTimeout);
  fail(group);
  std::vector<HeadRun> runs(2);
  RunRanks(2, [&](int q) {
    const VocabShard shard{ranges.offsets[q], kHeadV, &group.exchange(q)};
    runs[q] = RunHeadRange(config, h, ranges.offsets[q], ranges.widths[q],
                           &shard, /*forward_only=*/false,
                           q == 1 ? tweaks : RunTweaks());
  });
  return runs;
}

// Process 1 failed alone with `code`: process 0 names it (after the chunk
// it was at, if any).
void ExpectStoppedTogether(const std::vector<HeadRun>& runs,
                           absl::StatusCode code, const std::string& where) {
  EXPECT_EQ(runs[1].status.code(), code) << where << " " << runs[1].status;
  EXPECT_TRUE(absl::EndsWith(
      runs[0].status.message(),
      absl::StrCat("vocab_shard: process 1 of 2 failed: ",
                   absl::StatusCodeToString(code),
                   " (its own error says why)")))
      << where << " " << runs[0].status;
}

const char* const kStopModes[] = {"FUSED", "CHECKPOINT", "SELECTIVE"};

// An allocation that fails on one process, wherever it is (Start's
// workspaces, a chunk's, the checkpoints', backward's): a budget of
// i / 8 of that process's peak.
// DSpark (rounds) and Domino (a split correction, a chunk's closing
// gather).
std::vector<v1::ObjectiveConfig> StopConfigs(const char* mode, bool trainable) {
  return {ConfigBuilder("dspark { gamma: 7 l1_weight: 0.5 confidence_weight: "
                        "0.3 }")
              .Mode(mode)
              .Trainable(trainable)
              .Build(),
          ConfigBuilder("domino { lambda_base: 0.3 pure_draft_prefix_len: 1 }")
              .Mode(mode)
              .Trainable(trainable)
              .ExtraHead("correction_rank: 2")
              .Build()};
}

TEST(VocabParallelHeadTest, AFailedAllocationOnOneProcessStopsEvery) {
  for (const char* mode : kStopModes) {
    for (const v1::ObjectiveConfig& config : StopConfigs(mode, true)) {
      const std::vector<HeadRun> whole = FailOnProcessOne(config, RunTweaks());
      ASSERT_TRUE(whole[1].status.ok()) << mode << " " << whole[1].status;
      const int64_t peak = whole[1].result.stats.peak_bytes;
      ASSERT_GT(peak, 0) << mode;
      for (int i = 0; i < 8; ++i) {
        RunTweaks tweaks;
        tweaks.limit_bytes = peak * i / 8;
        ExpectStoppedTogether(
            FailOnProcessOne(config, tweaks),
            absl::StatusCode::kResourceExhausted,
            absl::StrCat(config.loss().ShortDebugString(), " ", mode, " limit ",
                         tweaks.limit_bytes));
      }
    }
  }
}

// Process 1's exchange fails (without sending) at each gather a run makes
// in turn: the run's handshake, each chunk's handshake, stats and rounds
// (Domino: its closing gather; again for the chunks backward recomputes)
// and the closing gather.
TEST(VocabParallelHeadTest, AnExchangeErrorAtEachGatherStopsEvery) {
  for (const char* mode : kStopModes) {
    for (const v1::ObjectiveConfig& config : StopConfigs(mode, false)) {
      int64_t calls = 0;  // The gathers of a run that fails nowhere.
      {
        const HeadBatch h = MakeHeadBatch();
        const Ranges ranges = SplitVocab(kHeadV, 2);
        ThreadGroup group(2, kHeadTimeout);
        RunRanks(2, [&](int q) {
          const VocabShard shard{ranges.offsets[q], kHeadV, &group.exchange(q)};
          EXPECT_TRUE(RunHeadRange(config, h, ranges.offsets[q],
                                   ranges.widths[q], &shard)
                          .status.ok());
        });
        calls = group.calls(1);
      }
      ASSERT_GE(calls, 6) << mode;
      for (int64_t call = 1; call <= calls; ++call) {
        const std::vector<HeadRun> runs = FailOnProcessOne(
            config, RunTweaks(),
            [&](ThreadGroup& group) { group.FailCall(1, call); });
        ExpectStoppedTogether(runs, absl::StatusCode::kUnavailable,
                              absl::StrCat(mode, " gather ", call));
        EXPECT_TRUE(absl::EndsWith(runs[1].status.message(),
                                   absl::StrCat("AllGather: call ", call,
                                                " of rank 1 fails (injected)")))
            << mode << " " << runs[1].status;
      }
    }
  }
}

// A check of the head's own that process 1 alone fails, before the run's
// handshake.
TEST(VocabParallelHeadTest, AHeadCheckOnOneProcessStopsEvery) {
  RunTweaks tweaks;
  tweaks.upstream_gradient = std::nan("");
  const std::vector<HeadRun> runs =
      FailOnProcessOne(ConfigBuilder("dflash {}").Build(), tweaks);
  ExpectStoppedTogether(runs, absl::StatusCode::kInvalidArgument, "upstream");
  EXPECT_EQ(runs[1].status.message(),
            "options.upstream_gradient: must be finite, got nan");
}

TEST(VocabParallelHeadTest, AShardsFieldsAreChecked) {
  const HeadBatch h = MakeHeadBatch();
  const v1::ObjectiveConfig config = ConfigBuilder("dflash {}").Build();
  ThreadGroup group(1, kHeadTimeout);
  VocabExchange* exchange = &group.exchange(0);
  const struct {
    VocabShard shard;
    std::string error;
  } cases[] = {
      {{0, kHeadV, nullptr},
       "options.vocab_shard.exchange: must be set, got none"},
      {{0, 0, exchange},
       "options.vocab_shard.vocab: must lie in [1, 2^31), got 0"},
      {{-1, kHeadV, exchange},
       absl::StrCat("options.vocab_shard.offset: must lie in [0, vocab = ",
                    kHeadV, "), got -1")},
      {{1, kHeadV, exchange},
       absl::StrCat("options.vocab_shard: classes [offset, offset + width) "
                    "= [1, ",
                    kHeadV + 1, ") must lie in [0, vocab = ", kHeadV,
                    ") (width: the logits')")},
  };
  for (const auto& c : cases) {
    EXPECT_EQ(RunHeadRange(config, h, 0, kHeadV, &c.shard).status.message(),
              c.error);
  }
}

TEST(VocabParallelHeadTest, ABudgetThatCouldDropChunksIsRefused) {
  const v1::ObjectiveConfig config =
      ConfigBuilder("dflash {}")
          .Mode("SELECTIVE")
          .Build();
  v1::ObjectiveConfig small = config;
  small.mutable_checkpoint()->set_memory_budget_bytes(8);
  const std::vector<absl::Status> statuses = HeadStatuses(small, small);
  for (const absl::Status& status : statuses) {
    EXPECT_TRUE(absl::StartsWith(
        status.message(),
        "checkpoint.memory_budget_bytes: a vocab-parallel head's budget "
        "must keep every chunk's intermediates ("))
        << status;
  }
}

const char* const kDominoLosses[] = {
    "domino { lambda_base: 0.3 pure_draft_prefix_len: 1 gamma: 4 }",
    "domino { lambda_base: 0.3 shift_label: true }",
};

// The split correction's weight rows sharded as the head's, trained in
// every mode; its inputs' gradient summed over the processes.
TEST(VocabParallelHeadTest, DominoEveryModeEqualsTheSingleProcessHead) {
  for (const char* loss : kDominoLosses) {
    for (const char* mode : head_test::kModes) {
      for (bool trainable : {false, true}) {
        CheckHead(ConfigBuilder(loss)
                      .Mode(mode)
                      .Trainable(trainable)
                      .ExtraHead("correction_rank: 2")
                      .Build(),
                  absl::StrCat(loss, " ", mode, trainable ? " trainable" : ""));
      }
    }
  }
}

TEST(VocabParallelHeadTest, DominoFloat32SoftcapAndForwardOnly) {
  for (const char* loss : kDominoLosses) {
    for (const char* mode : {"FUSED", "CHECKPOINT"}) {
      v1::ObjectiveConfig config =
          ConfigBuilder(loss)
              .Mode(mode)
              .Trainable()
              .ExtraHead("correction_rank: 2 logit_softcap: 6")
              .Build();
      CheckHead(config, absl::StrCat(loss, " ", mode, " forward only"),
                /*forward_only=*/true);
      config.mutable_head()->set_dtype(v1::HeadConfig::FLOAT32);
      CheckHead(config, absl::StrCat(loss, " ", mode, " float32"));
    }
  }
}

}  // namespace
}  // namespace dflash
