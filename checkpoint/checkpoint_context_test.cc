#include "checkpoint/checkpoint_context.h"

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "checkpoint/checkpoint_policy.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/config.h"

namespace dflash {
namespace {

using ::testing::HasSubstr;

// Options from a policy in the config's text format (the adapter is
// tested alongside).
CheckpointOptions Policy(const std::string& text) {
  auto config = ParseObjectiveConfig("checkpoint { " + text + " }");
  EXPECT_TRUE(config.ok()) << config.status();
  return CheckpointOptionsFromPolicy(ResolveDefaults(*config).checkpoint());
}

IntermediateInfo Info(std::string tag, IntermediateKind kind, bool frozen,
                      bool requires_grad) {
  return {std::move(tag), kind, frozen, requires_grad, 100};
}

TEST(CheckpointContextTest, DecisionTableFirstMatchWins) {
  TrackingAllocator allocator;
  auto context = CheckpointContext::Create(
      Policy("rules { name: \"teacher*\" action: MUST_SAVE } "
             "rules { kind: PROJECTION weight_frozen: true "
             "        input_requires_grad: true action: PREFER_SAVE } "
             "rules { kind: PROJECTION action: MUST_RECOMPUTE } "
             "rules { name: \"lse\" action: PREFER_RECOMPUTE } "
             "rules { weight_frozen: false action: MUST_SAVE } "
             "default_action: MUST_RECOMPUTE"),
      allocator);
  ASSERT_TRUE(context.ok()) << context.status();
  const CheckpointContext& c = **context;
  // Prefix name beats the later kind rules.
  EXPECT_EQ(c.Decide(Info("teacher_logits", IntermediateKind::kProjection, true, false)),
            CheckpointAction::kMustSave);
  EXPECT_EQ(c.Decide(Info("draft_logits", IntermediateKind::kProjection, true, true)),
            CheckpointAction::kPreferSave);
  // input_requires_grad mismatch falls through to the kind-only rule.
  EXPECT_EQ(c.Decide(Info("draft_logits", IntermediateKind::kProjection, true, false)),
            CheckpointAction::kMustRecompute);
  EXPECT_EQ(c.Decide(Info("draft_logits", IntermediateKind::kProjection, false, true)),
            CheckpointAction::kMustRecompute);
  // Exact name: "lse" matches, "lse2" does not.
  EXPECT_EQ(c.Decide(Info("lse", IntermediateKind::kLossStatistics, true, true)),
            CheckpointAction::kPreferRecompute);
  EXPECT_EQ(c.Decide(Info("lse2", IntermediateKind::kLossStatistics, false, true)),
            CheckpointAction::kMustSave);
  EXPECT_EQ(c.Decide(Info("lse2", IntermediateKind::kLossStatistics, true, true)),
            CheckpointAction::kMustRecompute);
}

TEST(CheckpointContextTest, SelectivePresetKeepsFrozenProjections) {
  TrackingAllocator allocator;
  auto context = CheckpointContext::Create(
      Policy("preset: SELECTIVE_FROZEN_PROJECTION"), allocator);
  ASSERT_TRUE(context.ok()) << context.status();
  const CheckpointContext& c = **context;
  EXPECT_EQ(c.Decide(Info("teacher", IntermediateKind::kProjection, true, false)),
            CheckpointAction::kMustSave);
  EXPECT_EQ(c.Decide(Info("draft", IntermediateKind::kProjection, true, true)),
            CheckpointAction::kPreferSave);
  EXPECT_EQ(c.Decide(Info("trainable", IntermediateKind::kProjection, false, true)),
            CheckpointAction::kMustRecompute);
  EXPECT_EQ(c.Decide(Info("lse", IntermediateKind::kLossStatistics, false, true)),
            CheckpointAction::kMustRecompute);
}

// A stand-in stage: chunk c's intermediate is c + i/10 for i in [0, n).
struct Stage {
  explicit Stage(int64_t n) : n(n) {}
  std::vector<float> Make(int64_t chunk) const {
    std::vector<float> v(n);
    for (int64_t i = 0; i < n; ++i) v[i] = chunk + i / 10.0f;
    return v;
  }
  RecomputeFn Recompute(int64_t chunk) {
    return [this, chunk](const TensorView& out) {
      ++calls;
      std::vector<float> v = Make(chunk);
      std::copy(v.begin(), v.end(), out.data_as<float>());
      return absl::OkStatus();
    };
  }
  int64_t n;
  int calls = 0;
};

TEST(CheckpointContextTest, PreferSaveYieldsToBudgetInOfferOrder) {
  TrackingAllocator allocator;
  // Each tensor is 10 floats = 40 bytes; the budget holds two.
  auto context = CheckpointContext::Create(
      Policy("memory_budget_bytes: 80 "
             "rules { name: \"must\" action: MUST_SAVE } "
             "rules { action: PREFER_SAVE }"),
      allocator);
  ASSERT_TRUE(context.ok()) << context.status();
  Stage stage(10);
  std::vector<bool> kept;
  for (int64_t chunk = 0; chunk < 4; ++chunk) {
    std::vector<float> v = stage.Make(chunk);
    auto k = (*context)->Offer(chunk, Info("prefer", IntermediateKind::kOther, true, true),
                               TensorView::Of(v.data(), {10}),
                               stage.Recompute(chunk));
    ASSERT_TRUE(k.ok()) << k.status();
    kept.push_back(*k);
  }
  EXPECT_EQ(kept, (std::vector<bool>{true, true, false, false}));
  std::vector<float> v = stage.Make(9);
  auto must = (*context)->Offer(9, Info("must", IntermediateKind::kOther, true, true),
                                TensorView::Of(v.data(), {10}), nullptr);
  ASSERT_TRUE(must.ok()) << must.status();
  EXPECT_TRUE(*must);
  const CheckpointStats& stats = (*context)->stats();
  EXPECT_EQ(stats.budget_refusals, 2);
  EXPECT_EQ(stats.must_save_over_budget, 1);
  EXPECT_EQ(stats.current_kept_bytes, 120);
  EXPECT_EQ(allocator.current_bytes(), 120);
  EXPECT_EQ(stats.per_tag.at("prefer").kept, 2);
  EXPECT_EQ(stats.per_tag.at("prefer").offered, 4);
}

struct SegmentCase {
  std::string name;
  int64_t segment_chunks;
  int64_t recomputed;       // Intermediates recomputed.
  int64_t segment_passes;   // Segments run again.
  int64_t peak_held;        // Tensors held at once.
};

class SegmentTest : public ::testing::TestWithParam<SegmentCase> {};

// Six chunks, one recomputable intermediate each, consumed in backward in
// reverse order as a real head would.
TEST_P(SegmentTest, SameResultsDifferentRecomputeAndMemory) {
  constexpr int64_t kChunks = 6;
  constexpr int64_t kN = 16;
  TrackingAllocator allocator;
  auto context = CheckpointContext::Create(
      Policy(absl::StrCat("segment_chunks: ", GetParam().segment_chunks)),
      allocator);
  ASSERT_TRUE(context.ok()) << context.status();
  Stage stage(kN);
  for (int64_t chunk = 0; chunk < kChunks; ++chunk) {
    std::vector<float> v = stage.Make(chunk);
    ASSERT_TRUE((*context)
                    ->Offer(chunk, Info("logits", IntermediateKind::kProjection, true, true),
                            TensorView::Of(v.data(), {kN}),
                            stage.Recompute(chunk))
                    .ok());
  }
  double sum = 0;
  for (int64_t chunk = kChunks - 1; chunk >= 0; --chunk) {
    auto t = (*context)->Fetch(chunk, "logits");
    ASSERT_TRUE(t.ok()) << t.status();
    ASSERT_EQ(t->shape(), (Shape{kN}));
    for (int64_t i = 0; i < kN; ++i) sum += t->data_as<float>()[i];
    (*context)->Release(chunk);
  }
  // Reference: sum over chunks c and i of (c + i/10) in float.
  double expected = 0;
  for (int64_t c = 0; c < kChunks; ++c) {
    for (int64_t i = 0; i < kN; ++i) expected += c + i / 10.0f;
  }
  EXPECT_DOUBLE_EQ(sum, expected);
  const CheckpointStats& stats = (*context)->stats();
  EXPECT_EQ(stats.per_tag.at("logits").recomputed, GetParam().recomputed);
  EXPECT_EQ(stats.per_tag.at("logits").recomputed_flops,
            100 * GetParam().recomputed);
  EXPECT_EQ(stage.calls, GetParam().recomputed);
  EXPECT_EQ(stats.segment_recomputes, GetParam().segment_passes);
  EXPECT_EQ(stats.peak_kept_bytes,
            GetParam().peak_held * kN * static_cast<int64_t>(sizeof(float)));
  EXPECT_EQ(stats.current_kept_bytes, 0);
  EXPECT_EQ(allocator.current_bytes(), 0);
}

INSTANTIATE_TEST_SUITE_P(
    Segments, SegmentTest,
    ::testing::Values(SegmentCase{"Never", 0, 0, 0, 6},
                      SegmentCase{"One", 1, 6, 6, 1},
                      SegmentCase{"Two", 2, 6, 3, 2},
                      SegmentCase{"All", 6, 6, 1, 6}),
    [](const ::testing::TestParamInfo<SegmentCase>& info) {
      return info.param.name;
    });

// Two backward passes over one forward (a retained graph): the second
// recomputes what the first did and finds the kept chunks as they were.
TEST(CheckpointContextTest, ReleaseRecomputedKeepsKeptForASecondPass) {
  constexpr int64_t kN = 4;
  TrackingAllocator allocator;
  // Chunks 0 and 2 kept (MUST_SAVE by name), 1 and 3 recomputed.
  auto context = CheckpointContext::Create(
      Policy("segment_chunks: 1 rules { name: \"keep\" action: MUST_SAVE }"),
      allocator);
  ASSERT_TRUE(context.ok()) << context.status();
  CheckpointContext& ctx = **context;
  Stage stage(kN);
  for (int64_t chunk = 0; chunk < 4; ++chunk) {
    std::vector<float> v = stage.Make(chunk);
    const std::string tag = chunk % 2 == 0 ? "keep" : "drop";
    ASSERT_TRUE(ctx.Offer(chunk, Info(tag, IntermediateKind::kOther, true, true),
                          TensorView::Of(v.data(), {kN}),
                          stage.Recompute(chunk))
                    .ok());
  }
  const int64_t bytes = kN * static_cast<int64_t>(sizeof(float));
  EXPECT_EQ(allocator.current_bytes(), 2 * bytes);
  for (int pass = 1; pass <= 2; ++pass) {
    SCOPED_TRACE(pass);
    for (int64_t chunk = 3; chunk >= 0; --chunk) {
      auto t = ctx.Fetch(chunk, chunk % 2 == 0 ? "keep" : "drop");
      ASSERT_TRUE(t.ok()) << t.status();
      const std::vector<float> expected = stage.Make(chunk);
      EXPECT_EQ(std::vector<float>(t->data_as<float>(),
                                   t->data_as<float>() + kN),
                expected);
      ctx.ReleaseRecomputed(chunk);
    }
    // The kept copies stay; what was recomputed is freed.
    EXPECT_EQ(allocator.current_bytes(), 2 * bytes);
    EXPECT_EQ(ctx.stats().current_kept_bytes, 2 * bytes);
    EXPECT_EQ(stage.calls, 2 * pass);
    EXPECT_EQ(ctx.stats().per_tag.at("drop").recomputed, 2 * pass);
  }
  for (int64_t chunk = 0; chunk < 4; ++chunk) ctx.Release(chunk);
  EXPECT_EQ(allocator.current_bytes(), 0);
}

TEST(CheckpointContextTest, DiscardFreesAnEntryNothingWillFetch) {
  TrackingAllocator allocator;
  auto context = CheckpointContext::Create(
      Policy("segment_chunks: 1 rules { name: \"keep*\" action: MUST_SAVE }"),
      allocator);
  ASSERT_TRUE(context.ok()) << context.status();
  CheckpointContext& ctx = **context;
  Stage stage(4);
  std::vector<float> v = stage.Make(0);
  for (const char* tag : {"keep_a", "keep_b", "drop"}) {
    ASSERT_TRUE(ctx.Offer(0, Info(tag, IntermediateKind::kOther, true, true),
                          TensorView::Of(v.data(), {4}), stage.Recompute(0))
                    .ok());
  }
  EXPECT_EQ(allocator.current_bytes(), 32);
  ctx.Discard(0, "keep_a");
  EXPECT_EQ(allocator.current_bytes(), 16);
  EXPECT_EQ(ctx.stats().current_kept_bytes, 16);
  auto gone = ctx.Fetch(0, "keep_a");
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kNotFound);
  // A discarded dropped entry is not recomputed with its segment.
  ctx.Discard(0, "drop");
  ctx.Discard(0, "drop");  // Nothing left: a no-op.
  ctx.Discard(7, "keep_b");  // No such chunk: a no-op.
  auto kept = ctx.Fetch(0, "keep_b");
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_EQ(kept->data_as<float>()[3], v[3]);
  EXPECT_EQ(stage.calls, 0);
  ctx.Discard(0, "keep_b");
  EXPECT_EQ(allocator.current_bytes(), 0);
  EXPECT_EQ(ctx.stats().current_kept_bytes, 0);
}

// A recompute may read an intermediate offered before it: the segment is
// recomputed in offer order, whatever the tags' names.
TEST(CheckpointContextTest, RecomputesInOfferOrderSoLaterStagesCanFetch) {
  TrackingAllocator allocator;
  auto context = CheckpointContext::Create(Policy("segment_chunks: 1"),
                                           allocator);
  ASSERT_TRUE(context.ok());
  CheckpointContext& ctx = **context;
  std::vector<float> zz = {1, 2};  // Sorts after "aa" but is offered first.
  std::vector<float> aa = {3, 5};  // 2 * zz + 1.
  int zz_calls = 0;
  ASSERT_TRUE(ctx.Offer(0, Info("zz", IntermediateKind::kProjection, true, false),
                        TensorView::Of(zz.data(), {2}),
                        [&](const TensorView& out) {
                          ++zz_calls;
                          out.data_as<float>()[0] = 1;
                          out.data_as<float>()[1] = 2;
                          return absl::OkStatus();
                        })
                  .ok());
  ASSERT_TRUE(ctx.Offer(0, Info("aa", IntermediateKind::kLogitsGradient, true, true),
                        TensorView::Of(aa.data(), {2}),
                        [&](const TensorView& out) -> absl::Status {
                          auto source = ctx.Fetch(0, "zz");
                          if (!source.ok()) return source.status();
                          for (int i = 0; i < 2; ++i) {
                            out.data_as<float>()[i] =
                                2 * source->data_as<float>()[i] + 1;
                          }
                          return absl::OkStatus();
                        })
                  .ok());
  auto result = ctx.Fetch(0, "aa");
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->data_as<float>()[0], 3);
  EXPECT_EQ(result->data_as<float>()[1], 5);
  EXPECT_EQ(zz_calls, 1);
  EXPECT_EQ(ctx.stats().segment_recomputes, 1);
}

TEST(CheckpointContextTest, BadPoliciesAreRejected) {
  TrackingAllocator allocator;
  EXPECT_THAT(CheckpointContext::Create(Policy("segment_chunks: -2"), allocator)
                  .status()
                  .message(),
              HasSubstr("checkpoint.segment_chunks: must be >= 0, got -2"));
  EXPECT_THAT(
      CheckpointContext::Create(Policy("segment_chunks: 0 rules { action: "
                                       "MUST_RECOMPUTE }"),
                                allocator)
          .status()
          .message(),
      HasSubstr("0 (never recompute) contradicts MUST_RECOMPUTE in "
                "checkpoint.rules[0]"));
  EXPECT_THAT(CheckpointContext::Create(
                  Policy("memory_budget_bytes: 0 default_action: PREFER_SAVE"),
                  allocator)
                  .status()
                  .message(),
              HasSubstr("PREFER_SAVE in checkpoint.default_action could never "
                        "save"));
  EXPECT_THAT(
      CheckpointContext::Create(Policy("rules { kind: KIND_UNSPECIFIED "
                                       "action: MUST_SAVE }"),
                                allocator)
          .status()
          .message(),
      HasSubstr("checkpoint.rules[0].kind: must name a kind"));
}

TEST(CheckpointContextTest, BadCallsAreErrors) {
  TrackingAllocator allocator;
  auto context = CheckpointContext::Create(Policy(""), allocator);
  ASSERT_TRUE(context.ok());
  std::vector<float> v(12);
  const IntermediateInfo info = Info("x", IntermediateKind::kOther, false, true);
  EXPECT_THAT((*context)
                  ->Offer(0, info, TensorView::Of(v.data(), {12}), nullptr)
                  .status()
                  .message(),
              HasSubstr("x of chunk 0 is dropped (PREFER_RECOMPUTE) but no "
                        "recompute function was given"));
  Stage stage(12);
  ASSERT_TRUE((*context)
                  ->Offer(0, info, TensorView::Of(v.data(), {12}),
                          stage.Recompute(0))
                  .ok());
  EXPECT_EQ((*context)
                ->Offer(0, info, TensorView::Of(v.data(), {12}),
                        stage.Recompute(0))
                .status()
                .code(),
            absl::StatusCode::kAlreadyExists);
  auto strided = TensorView::Of(v.data(), {3, 4}).Slice(1, 0, 2);
  ASSERT_TRUE(strided.ok());
  EXPECT_THAT((*context)->Offer(1, info, *strided, stage.Recompute(1))
                  .status()
                  .message(),
              HasSubstr("must be a contiguous CPU tensor (the allocator's), "
                        "got CPU float32[3, 2]"));
  // A tensor on another device than the allocator's memory.
  const TensorView on_gpu(v.data(), DType::kFloat32, {12}, Device::kCuda);
  EXPECT_THAT(
      (*context)->Offer(1, info, on_gpu, stage.Recompute(1)).status().message(),
      HasSubstr("must be a contiguous CPU tensor (the allocator's), got CUDA "
                "float32[12]"));
  EXPECT_EQ((*context)->Offer(-1, info, TensorView::Of(v.data(), {12}),
                              stage.Recompute(0))
                .status()
                .message(),
            "checkpoint: chunk must be >= 0, got -1");
  EXPECT_EQ((*context)->Fetch(5, "x").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ((*context)->Fetch(0, "y").status().code(),
            absl::StatusCode::kNotFound);
  auto failing = CheckpointContext::Create(Policy(""), allocator);
  ASSERT_TRUE(failing.ok());
  ASSERT_TRUE((*failing)
                  ->Offer(0, info, TensorView::Of(v.data(), {12}),
                          [](const TensorView&) {
                            return absl::InternalError("recompute failed");
                          })
                  .ok());
  EXPECT_EQ((*failing)->Fetch(0, "x").status().message(), "recompute failed");
  EXPECT_EQ((*failing)->stats().current_kept_bytes, 0);
}

}  // namespace
}  // namespace dflash
