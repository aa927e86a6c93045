// RunHeadOn's error order over a backend that queues its work (as CUDA's
// does): a failed product is named before the loss error it caused, and a
// failed row movement stops the run where it happened.
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "heads/head_backend.h"
#include "proto/config.h"

namespace dflash {
namespace {

// A projection whose products "fail on the device": its status reports it.
class FailedProjection final : public VocabProjection<double> {
 public:
  FailedProjection(int64_t vocab, int64_t hidden, absl::Status status)
      : VocabProjection<double>(vocab, hidden), status_(std::move(status)) {}
  void Forward(const double*, int64_t m, double* logits) override {
    std::fill(logits, logits + m * vocab(), 0.0);
  }
  void InputGradient(const double*, int64_t, double*) override {}
  void AccumulateWeightGradient(const double*, const double*, int64_t, double*,
                                double*) override {}
  absl::Status status() const override { return status_; }

 private:
  absl::Status status_;
};

// Every step succeeds unless told otherwise.
class ScriptedBackend final : public HeadBackend<double> {
 public:
  ScriptedBackend(int64_t vocab, int64_t hidden, absl::Status projection,
                  absl::Status loss, absl::Status gather)
      : projection_(vocab, hidden, std::move(projection)),
        loss_(std::move(loss)),
        gather_(std::move(gather)) {}

  Device device() const override { return Device::kCpu; }
  TrackingAllocator& allocator() override { return allocator_; }
  VocabProjection<double>& projection() override { return projection_; }
  absl::Status Start(const HeadRunSpec<double>&) override {
    return absl::OkStatus();
  }
  absl::Status GatherRows(const double*, int64_t, int64_t, int64_t,
                          double*) override {
    return gather_;
  }
  absl::Status ScatterRows(const double*, int64_t, int64_t, int64_t,
                           double*) override {
    return absl::OkStatus();
  }
  absl::Status ChunkLoss(int64_t, int64_t, int64_t, double*, const double*,
                         bool) override {
    return loss_;
  }
  absl::Status Synchronize() override { return absl::OkStatus(); }
  absl::StatusOr<ChunkTerms> Terms() override { return ChunkTerms::Zero(2); }
  absl::Status ScaleGradients(double, std::optional<double>) override {
    return absl::OkStatus();
  }
  double loss_seconds() const override { return 0; }

 private:
  TrackingAllocator allocator_;
  FailedProjection projection_;
  absl::Status loss_;
  absl::Status gather_;
};

absl::Status RunScripted(ScriptedBackend& backend) {
  auto config = LoadObjectiveConfigFromString(
      "layout { block_size: 2 num_anchors: 1 } head { vocab_size: 5 "
      "hidden_size: 3 dtype: FLOAT64 } loss { dflash {} }");
  EXPECT_TRUE(config.ok()) << config.status();
  std::vector<RowMeta> rows(2);
  rows[1] = {/*target=*/1, /*position=*/1, /*mask=*/1, /*block=*/0};
  const std::vector<double> hidden(6, 0.5), weight(15, 0.1);
  std::vector<double> grad(6);
  return RunHeadOn<double>(*config, {hidden, {}, {}, rows, weight, {}},
                           {absl::MakeSpan(grad), {}, {}, {}}, backend, {}, {})
      .status();
}

TEST(HeadRunTest, AFailedProductIsNamedBeforeTheLossErrorItCaused) {
  ScriptedBackend backend(5, 3, absl::InternalError("forward GEMM: failed"),
                          absl::InvalidArgumentError("row 0: logit 1 is nan"),
                          absl::OkStatus());
  EXPECT_EQ(RunScripted(backend), absl::InternalError("forward GEMM: failed"));
}

TEST(HeadRunTest, TheLossErrorStandsWhenTheProductsWorked) {
  ScriptedBackend backend(5, 3, absl::OkStatus(),
                          absl::InvalidArgumentError("row 0: logit 1 is nan"),
                          absl::OkStatus());
  EXPECT_EQ(RunScripted(backend).message(), "row 0: logit 1 is nan");
}

TEST(HeadRunTest, AFailedRowGatherStopsTheRun) {
  ScriptedBackend backend(5, 3, absl::OkStatus(), absl::OkStatus(),
                          absl::InternalError("row gather: launch failed"));
  EXPECT_EQ(RunScripted(backend),
            absl::InternalError("row gather: launch failed"));
}

}  // namespace
}  // namespace dflash
