// RunHeadOn's error order over a backend that queues its work (as CUDA's
// does): a failed product is named before the loss error it caused, and a
// failed row movement stops the run where it happened.
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "heads/head_backend.h"
#include "losses/row_error.h"
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
  void AddForward(const double*, int64_t, double*) override {}
  void InputGradient(const double*, int64_t, double*) override {}
  void InputGradientColumns(const double*, int64_t, int64_t, int64_t, bool,
                            double*) override {}
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
                  absl::Status loss, absl::Status gather,
                  absl::Status terms = absl::OkStatus())
      : projection_(vocab, hidden, std::move(projection)),
        loss_(std::move(loss)),
        gather_(std::move(gather)),
        terms_(std::move(terms)) {}

  Device device() const override { return Device::kCpu; }
  TrackingAllocator& allocator() override { return allocator_; }
  VocabProjection<double>& projection() override { return projection_; }
  VocabProjection<double>* correction() override { return nullptr; }
  absl::Status Start(const HeadRunSpec<double>&) override {
    return absl::OkStatus();
  }
  absl::Status StartGradients(const HeadGradients<double>&) override {
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
                         double*, bool) override {
    return loss_;
  }
  absl::Status Synchronize() override { return absl::OkStatus(); }
  absl::StatusOr<ChunkTerms> Terms() override {
    if (!terms_.ok()) return terms_;
    return ChunkTerms::Zero(2);
  }
  absl::Status ScaleGradients(double, const DeviceUpstream*,
                              const FinishedLoss&) override {
    return absl::OkStatus();
  }
  double loss_seconds() const override { return 0; }
  std::string gemm_library() const override { return "scripted"; }

 private:
  TrackingAllocator allocator_;
  FailedProjection projection_;
  absl::Status loss_;
  absl::Status gather_;
  absl::Status terms_;
};

// Two sequences of two anchor blocks of K = 2: rows (b, n, k).
absl::Status RunScripted(ScriptedBackend& backend) {
  auto config = LoadObjectiveConfigFromString(
      "layout { block_size: 2 num_anchors: 2 } head { vocab_size: 5 "
      "hidden_size: 3 dtype: FLOAT64 } loss { dflash {} }");
  EXPECT_TRUE(config.ok()) << config.status();
  std::vector<RowMeta> rows(8);
  for (int64_t r = 0; r < 8; ++r) {
    rows[r] = {/*target=*/1, static_cast<int32_t>(r % 2),
               /*mask=*/r % 2 == 1 ? 1.0f : 0.0f, r / 2};
  }
  const std::vector<double> hidden(24, 0.5), weight(15, 0.1);
  std::vector<double> grad(24);
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

// An error the device reports at the end (a non-finite logit) names the
// batch row by its (b, n, k), as the CPU's errors do.
TEST(HeadRunTest, ADeviceRowErrorNamesTheRowsPlaceInTheBatch) {
  ScriptedBackend backend(5, 3, absl::OkStatus(), absl::OkStatus(),
                          absl::OkStatus(),
                          RowError(7, "a logit is not finite"));
  EXPECT_EQ(RunScripted(backend).message(),
            "row (b, n, k) = (1, 1, 1): a logit is not finite");
}

TEST(HeadRunTest, AFailedRowGatherStopsTheRun) {
  ScriptedBackend backend(5, 3, absl::OkStatus(), absl::OkStatus(),
                          absl::InternalError("row gather: launch failed"));
  EXPECT_EQ(RunScripted(backend),
            absl::InternalError("row gather: launch failed"));
}

}  // namespace
}  // namespace dflash
