#include "heads/prepared_projection.h"

#include <cmath>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/error_norms.h"
#include "base/tracking_allocator.h"
#include "gtest/gtest.h"
#include "heads/cpu_head.h"
#include "heads/synthetic_batch.h"
#include "proto/config.h"

namespace dflash {
namespace {

std::vector<float> Uniform(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1, 1);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

// The two GEMMs against naive float64 loops, at chunk sizes that are and
// are not the layout's typical one, with a bias, on 1 and 2 threads.
TEST(PreparedProjectionTest, GemmsMatchNaiveLoops) {
  constexpr int64_t kV = 301, kH = 37;
  const std::vector<float> w = Uniform(kV * kH, 1), b = Uniform(kV, 2);
  for (int threads : {1, 2}) {
    auto prepared = PreparedProjection::Create(w, b, kV, kH, threads);
    ASSERT_TRUE(prepared.ok()) << prepared.status();
    EXPECT_GE((*prepared)->packed_bytes(), 2 * kV * kH * 4);
    EXPECT_FALSE((*prepared)->KernelName().empty());
    auto projection = (*prepared)->NewProjection(threads);
    for (int64_t m : {1, 7, 64, 256, 300}) {
      SCOPED_TRACE(absl::StrCat("threads ", threads, " m ", m));
      const std::vector<float> x = Uniform(m * kH, 3 + m);
      const std::vector<float> g = Uniform(m * kV, 4 + m);
      std::vector<float> logits(m * kV), dx(m * kH);
      projection->Forward(x.data(), m, logits.data());
      projection->InputGradient(g.data(), m, dx.data());
      ASSERT_TRUE(projection->status().ok()) << projection->status();
      std::vector<double> want_logits(m * kV), want_dx(m * kH, 0);
      for (int64_t r = 0; r < m; ++r) {
        for (int64_t v = 0; v < kV; ++v) {
          double sum = b[v];
          for (int64_t h = 0; h < kH; ++h) {
            sum += double{x[r * kH + h]} * w[v * kH + h];
            want_dx[r * kH + h] += double{g[r * kV + v]} * w[v * kH + h];
          }
          want_logits[r * kV + v] = sum;
        }
      }
      EXPECT_LE(RelativeMaxError<float>(logits, want_logits), 1e-5);
      EXPECT_LE(RelativeMaxError<float>(dx, want_dx), 1e-5);
    }
    EXPECT_GT(projection->gemms().calls, 0);
  }
}

// The gradient filter's GEMM over vocabulary ranges: on the tiles laid out
// for it where a range is whole filter tiles (the vocabulary's last one
// shorter), on OpenBLAS otherwise; overwriting or adding as asked.
TEST(PreparedProjectionTest, InputGradientColumnsMatchNaiveLoops) {
  constexpr int64_t kV = 700, kH = 37, kM = 9;  // Tiles of 256, 256, 188.
  const std::vector<float> w = Uniform(kV * kH, 5);
  const std::vector<float> g = Uniform(kM * kV, 6);
  struct Range {
    int64_t begin, end;
  };
  const std::vector<std::vector<Range>> cases = {
      {{0, 256}}, {{256, 700}}, {{0, 700}}, {{512, 700}, {0, 256}},
      {{10, 100}}, {{0, 256}, {300, 400}}};
  for (int threads : {1, 2}) {
    auto prepared = PreparedProjection::Create(w, {}, kV, kH, threads);
    ASSERT_TRUE(prepared.ok()) << prepared.status();
    auto projection = (*prepared)->NewProjection(threads);
    for (size_t c = 0; c < cases.size(); ++c) {
      SCOPED_TRACE(absl::StrCat("threads ", threads, " case ", c));
      std::vector<float> dx(kM * kH, 7);
      std::vector<double> want(kM * kH, 0);
      for (size_t i = 0; i < cases[c].size(); ++i) {
        const Range range = cases[c][i];
        projection->InputGradientColumns(g.data(), kM, range.begin, range.end,
                                         /*accumulate=*/i > 0, dx.data());
        for (int64_t r = 0; r < kM; ++r) {
          for (int64_t v = range.begin; v < range.end; ++v) {
            for (int64_t h = 0; h < kH; ++h) {
              want[r * kH + h] += double{g[r * kV + v]} * w[v * kH + h];
            }
          }
        }
      }
      ASSERT_TRUE(projection->status().ok()) << projection->status();
      EXPECT_LE(RelativeMaxError<float>(dx, want), 1e-5);
    }
  }
}

TEST(PreparedProjectionTest, IsFrozenAndKnowsItsWeight) {
  constexpr int64_t kV = 40, kH = 8;
  const std::vector<float> w = Uniform(kV * kH, 5), other = w;
  auto prepared = PreparedProjection::Create(w, {}, kV, kH);
  ASSERT_TRUE(prepared.ok()) << prepared.status();
  EXPECT_TRUE((*prepared)->PreparedFrom(w, {}));
  EXPECT_FALSE((*prepared)->PreparedFrom(other, {}));
  auto projection = (*prepared)->NewProjection(1);
  std::vector<float> rows(kH), grad(kV), dw(kV * kH);
  projection->AccumulateWeightGradient(grad.data(), rows.data(), 1, dw.data(),
                                       nullptr);
  EXPECT_EQ(projection->status().message(),
            "a prepared projection is frozen: it has no weight gradient");
  EXPECT_EQ(PreparedProjection::Create(w, {}, kV + 1, kH).status().message(),
            "projection: weight must hold vocab x hidden = 41 x 8 values, got "
            "320");
}

// RunHead of `config` over `batch` on `prepared` (or none): its result
// and d(loss)/d(hidden).
std::pair<absl::StatusOr<HeadResult>, std::vector<float>> RunOn(
    const v1::ObjectiveConfig& config, const HeadBatch<float>& batch,
    const PreparedProjection* prepared) {
  std::vector<float> grad(batch.hidden.size());
  HeadOptions options;
  options.prepared_projection = prepared;
  TrackingAllocator allocator;
  absl::StatusOr<HeadResult> result =
      RunHead<float>(config, batch.Inputs(config), {absl::MakeSpan(grad)},
                     allocator, {}, options);
  return {std::move(result), std::move(grad)};
}

// A head run on a prepared projection equals one on OpenBLAS; the wrong
// projection, or one for a trainable head, is refused.
TEST(PreparedProjectionTest, HeadRunsOnItAcrossRuns) {
  absl::StatusOr<v1::ObjectiveConfig> config = LoadObjectiveConfigFromString(
      "layout { block_size: 4 num_anchors: 6 } head { vocab_size: 301 "
      "hidden_size: 32 } chunking { blocks_per_chunk: 2 } loss { dflash { "
      "gamma: 7 } }",
      "test");
  ASSERT_TRUE(config.ok()) << config.status();
  absl::StatusOr<HeadBatch<float>> batch =
      MakeSyntheticBatch<float>(*config, {2, 64, 6}, 3);
  ASSERT_TRUE(batch.ok()) << batch.status();
  const HeadInputs<float> inputs = batch->Inputs(*config);
  auto run = [&](const v1::ObjectiveConfig& c, const PreparedProjection* p) {
    return RunOn(c, *batch, p);
  };
  v1::ObjectiveConfig blas = *config;
  blas.mutable_head()->set_pack_weight(false);
  const auto want = run(blas, nullptr);
  ASSERT_TRUE(want.first.ok()) << want.first.status();
  auto prepared = PreparedProjection::Create(batch->weight, {}, 301, 32);
  ASSERT_TRUE(prepared.ok()) << prepared.status();
  for (int repeat = 0; repeat < 2; ++repeat) {
    const auto got = run(*config, prepared->get());
    ASSERT_TRUE(got.first.ok()) << got.first.status();
    EXPECT_NEAR(got.first->loss, want.first->loss, 1e-5 * want.first->loss);
    EXPECT_EQ(got.first->stats.prepare_seconds, 0);
    std::vector<double> expected(want.second.begin(), want.second.end());
    EXPECT_LE(RelativeMaxError<float>(got.second, expected), 1e-5);
  }
  // Without one, the run lays the weight out itself.
  const auto own = run(*config, nullptr);
  ASSERT_TRUE(own.first.ok()) << own.first.status();
  EXPECT_GT(own.first->stats.prepare_seconds, 0);
  const std::vector<float> copy = batch->weight;
  auto elsewhere = PreparedProjection::Create(copy, {}, 301, 32);
  ASSERT_TRUE(elsewhere.ok());
  EXPECT_EQ(run(*config, elsewhere->get()).first.status().message(),
            "options.prepared_projection: was prepared from another weight "
            "or bias than inputs.weight and inputs.bias (prepare it from the "
            "tensors the run reads)");
  v1::ObjectiveConfig trainable = *config;
  trainable.mutable_head()->set_trainable(true);
  std::vector<float> grad(batch->hidden.size()), dw(batch->weight.size());
  HeadOptions options;
  options.prepared_projection = prepared->get();
  TrackingAllocator allocator;
  EXPECT_EQ(RunHead<float>(trainable, inputs,
                           {absl::MakeSpan(grad), absl::MakeSpan(dw)},
                           allocator, {}, options)
                .status()
                .message(),
            "options.prepared_projection: serves a frozen FLOAT32 head, got a "
            "trainable or FLOAT64 one");
}

// A weight written in place after its layout is laid out again by the next
// run (its checksum changed), also the gradient filter's tiles: the runs
// equal OpenBLAS on the new weight. An unchanged weight is not.
TEST(PreparedProjectionTest, AWeightWrittenInPlaceIsLaidOutAgain) {
  absl::StatusOr<v1::ObjectiveConfig> config = LoadObjectiveConfigFromString(
      "layout { block_size: 4 num_anchors: 6 } head { vocab_size: 600 "
      "hidden_size: 32 gradient_filter: 1e-30 } chunking { blocks_per_chunk: "
      "2 } loss { dflash { gamma: 7 } }",
      "test");
  ASSERT_TRUE(config.ok()) << config.status();
  absl::StatusOr<HeadBatch<float>> batch =
      MakeSyntheticBatch<float>(*config, {2, 64, 6}, 4);
  ASSERT_TRUE(batch.ok()) << batch.status();
  auto run = [&](const v1::ObjectiveConfig& c, const PreparedProjection* p) {
    auto [result, grad] = RunOn(c, *batch, p);
    EXPECT_TRUE(result.ok()) << result.status();
    return std::make_pair(result.ok() ? result->loss : 0.0, grad);
  };
  v1::ObjectiveConfig blas = *config;
  blas.mutable_head()->set_pack_weight(false);
  blas.mutable_head()->clear_gradient_filter();
  auto prepared = PreparedProjection::Create(batch->weight, {}, 600, 32, 2);
  ASSERT_TRUE(prepared.ok()) << prepared.status();
  EXPECT_EQ(*(*prepared)->Revalidate(2), false);
  run(*config, prepared->get());  // Lays the filter's tiles out.
  for (float scale : {2.0f, -0.5f}) {
    for (float& w : batch->weight) w *= scale;
    const auto want = run(blas, nullptr);
    const auto got = run(*config, prepared->get());
    EXPECT_NEAR(got.first, want.first, 1e-5 * std::abs(want.first));
    std::vector<double> expected(want.second.begin(), want.second.end());
    EXPECT_LE(RelativeMaxError<float>(got.second, expected), 1e-5);
    EXPECT_EQ(*(*prepared)->Revalidate(1), false);
  }
  batch->weight[123] += 0.5f;  // One element.
  EXPECT_EQ(*(*prepared)->Revalidate(1), true);
  EXPECT_EQ(*(*prepared)->Revalidate(1), false);
}

TEST(PreparedProjectionTest, LaidOutBytesWithoutLayingOut) {
  constexpr int64_t kV = 700, kH = 37;
  const std::vector<float> w = Uniform(kV * kH, 8);
  auto prepared = PreparedProjection::Create(w, {}, kV, kH, 1);
  ASSERT_TRUE(prepared.ok()) << prepared.status();
  absl::StatusOr<int64_t> bytes = PreparedProjection::LaidOutBytes(kV, kH, false);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  EXPECT_EQ(*bytes, (*prepared)->packed_bytes());
  absl::StatusOr<int64_t> with_tiles =
      PreparedProjection::LaidOutBytes(kV, kH, true);
  ASSERT_TRUE(with_tiles.ok()) << with_tiles.status();
  // A third copy, rounded up to whole tiles.
  EXPECT_GE(*with_tiles - *bytes, kV * kH * 4);
  EXPECT_LE(*with_tiles - *bytes, 2 * 768 * kH * 4);
}

TEST(PreparedProjectionTest, ThreadCountsAreChecked) {
  const std::vector<float> w = Uniform(40 * 8, 9);
  EXPECT_EQ(PreparedProjection::Create(w, {}, 40, 8, 5000).status().message(),
            "threads: must lie in [0, 1024] (0: every usable CPU), got 5000");
}

}  // namespace
}  // namespace dflash
