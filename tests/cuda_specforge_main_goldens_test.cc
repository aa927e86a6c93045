// The SpecForge main goldens (tests/goldens/specforge_main: the
// sequence-balanced D-PACE denominator, ignored targets counted) through the
// CUDA head in float32: terms and loss within 1e-5 of SpecForge's float64,
// d(loss)/d(hidden) within 1e-5 in relative norm. Skipped, with the reason,
// where no GPU is usable.
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/error_norms.h"
#include "base/gpu_test.h"
#include "gtest/gtest.h"
#include "heads/cuda_head.h"
#include "proto/config.h"
#include "tests/cuda_test_util.h"
#include "tests/specforge_golden.h"

namespace dflash {
namespace {

using Golden = SpecForgeMainGolden;

TrackedBuffer<float> Upload(const std::vector<double>& host,
                            CudaStream& stream) {
  const std::vector<float> values(host.begin(), host.end());
  auto buffer = TrackedBuffer<float>::Create(
      stream.allocator(), static_cast<int64_t>(values.size()));
  EXPECT_TRUE(buffer.ok()) << buffer.status();
  EXPECT_TRUE(
      stream.CopyToDevice(buffer->data(), values.data(), buffer->bytes()).ok());
  return *std::move(buffer);
}

TEST(CudaSpecForgeMainGoldensTest, Float32MatchesSpecForgeMain) {
  absl::StatusOr<Gpu> gpu = OpenGpu();
  DFLASH_SKIP_WITHOUT_GPU(gpu.status());
  CudaStream& stream = *gpu->stream;
  for (const Golden& g :
       LoadSpecForgeMainGoldens("tests/goldens/specforge_main")) {
    ASSERT_EQ(g.terms.size(), static_cast<size_t>(Golden::kTermCount))
        << g.name;
    for (const char* mode : {"fused", "checkpoint", "materialize"}) {
      for (int64_t per_chunk : {int64_t{1}, int64_t{3}}) {
        SCOPED_TRACE(absl::StrCat(g.name, " ", mode, " blocks_per_chunk ",
                                  per_chunk));
        v1::ObjectiveConfig config = g.config;
        ASSERT_TRUE(SetModeByName("mode", mode, config).ok());
        config.mutable_chunking()->set_blocks_per_chunk(per_chunk);
        config.mutable_head()->set_backend(v1::HeadConfig::CUDA);
        config.mutable_head()->set_dtype(v1::HeadConfig::FLOAT32);
        TrackedBuffer<float> hidden = Upload(g.hidden, stream);
        TrackedBuffer<float> weight = Upload(g.weight, stream);
        TrackedBuffer<float> grad =
            Upload(std::vector<double>(g.hidden.size(), 7.0), stream);
        const HeadInputs<float> inputs{
            absl::MakeConstSpan(hidden.data(), hidden.size()),
            {},
            {},
            g.rows,
            absl::MakeConstSpan(weight.data(), weight.size()),
            {}};
        const HeadGradients<float> gradients{
            absl::MakeSpan(grad.data(), grad.size()), {}, {}, {}};
        absl::StatusOr<HeadResult> result =
            RunCudaHead<float>(config, inputs, gradients, *gpu->blas);
        ASSERT_TRUE(result.ok()) << result.status();
        std::vector<float> host(grad.size());
        ASSERT_TRUE(
            stream.CopyToHost(host.data(), grad.data(), grad.bytes()).ok());
        ASSERT_TRUE(stream.Synchronize().ok());
        const ChunkTerms& t = result->terms;
        ExpectNear(result->loss, g.terms[Golden::kLoss], 1e-5, "loss");
        ExpectNear(t.loss_den, g.terms[Golden::kLossDen], 1e-6, "loss_den");
        ExpectNear(t.ce_num, g.terms[Golden::kCeLossNum], 1e-5, "ce_num");
        ExpectNear(t.tv_num, g.terms[Golden::kTvLossNum], 1e-5, "tv_num");
        ExpectNear(t.target_probability,
                   g.terms[Golden::kTargetProbabilityNum], 1e-5,
                   "target_probability");
        EXPECT_EQ(t.correct, g.terms[Golden::kCorrectNum]);
        EXPECT_EQ(t.accuracy_den, g.terms[Golden::kAccuracyDen]);
        const std::vector<double> got(host.begin(), host.end());
        EXPECT_LT(RelativeL2Error<double>(got, g.grad_hidden), 1e-5);
        for (size_t k = 0; k < g.loss_weight.size(); ++k) {
          ExpectNear(t.loss_weight_per_position[k], g.loss_weight[k], 1e-5,
                     absl::StrCat("loss_weight[", k, "]"));
        }
      }
    }
  }
}

}  // namespace
}  // namespace dflash
