// Fuzzes the loss row kernels: bytes become a loss family, logit options,
// rows (targets, positions, masks, block ids), logits, teacher logits,
// confidence logits and a top-k request, run through ChunkLoss in float64,
// float32 and bfloat16. Every call returns terms or an error with a
// message. When the inputs are finite and it succeeds, terms and gradient
// are finite; when they are also moderate (|z| <= 20, masks in [0, 1]),
// float32 runs where float64 does and agrees with it.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/bfloat16.h"
#include "fuzz/fuzz_input.h"
#include "google/protobuf/text_format.h"
#include "losses/chunk_loss.h"

namespace dflash {
namespace {

const char* const kLosses[] = {
    "dflash { gamma: 7 }",
    "dflash { } cross_entropy { label_smoothing: 0.1 z_loss_scale: 0.01 "
    "ignore_index: 3 }",
    "dpace { alpha: 0.3 }",
    "dpace { alpha: 0.2 variant: CUMULATIVE_CONFIDENCE_ONLY }",
    "dpace { alpha: 0 variant: CONTINUATION_VALUE_ONLY }",
    "tv { gamma: 7 }",
    "lk_lambda { gamma: 7 kl_scale: 0.8 kl_decay: 2 }",
    "dspark { gamma: 7 l1_weight: 0.5 confidence_weight: 0.3 }",
    "distillation { divergence: FORWARD_KL temperature: 2 }",
    "distillation { divergence: REVERSE_KL temperature: 0.5 }",
    "distillation { divergence: JSD beta: 0.3 }",
};

struct Problem {
  v1::LossConfig config;
  ChunkLossOptions options;
  int64_t vocab = 0;
  std::vector<RowMeta> rows;
  std::vector<double> logits, teacher;
  std::vector<float> confidence;
  int32_t k = 0;
  bool finite = true, moderate = true;
};

Problem Read(FuzzInput& in) {
  Problem p;
  const int family =
      static_cast<int>(in.Int(0, sizeof(kLosses) / sizeof(kLosses[0]) - 1));
  google::protobuf::TextFormat::ParseFromString(kLosses[family], &p.config);
  const bool wild = in.Bool();
  p.options.block_size = in.Int(0, 6);
  const double scales[] = {1, 0.5, 2};
  const double caps[] = {0, 0, 5};
  p.options.logit_scale = wild ? in.Raw<double>() : scales[in.Int(0, 2)];
  p.options.logit_softcap = wild ? in.Raw<double>() : caps[in.Int(0, 2)];
  p.vocab = in.Int(0, 40);
  const int64_t n = in.Int(0, 24);
  int64_t block = 0;
  for (int64_t r = 0; r < n; ++r) {
    RowMeta meta;
    meta.target =
        wild ? in.Raw<int32_t>() : static_cast<int32_t>(in.Int(-1, p.vocab));
    meta.position = static_cast<int32_t>(in.Int(-1, p.options.block_size));
    const float masks[] = {0, 0.5f, 1, 1};
    meta.mask = wild ? in.Raw<float>() : masks[in.Int(0, 3)];
    // Masks beyond 1 scale the gradient: float32 may rightly refuse it.
    p.moderate &= !(std::abs(meta.mask) > 1);
    block += in.Int(0, 1);
    meta.block = wild ? in.Raw<int64_t>() : block;
    p.rows.push_back(meta);
  }
  auto value = [&]() {
    const double x = wild ? static_cast<double>(in.Raw<float>())
                          : static_cast<double>(in.Int(-80, 80)) / 4;
    p.finite &= std::isfinite(x);
    p.moderate &= std::abs(x) <= 20;
    return x;
  };
  // Sizes may be wrong on purpose: the call must say so.
  const int64_t cells = n * p.vocab + (in.Int(0, 9) == 0 ? in.Int(-1, 1) : 0);
  for (int64_t i = 0; i < cells; ++i) p.logits.push_back(value());
  for (int64_t i = 0; i < cells; ++i) p.teacher.push_back(value());
  for (int64_t r = 0; r < n; ++r) {
    p.confidence.push_back(static_cast<float>(value()));
  }
  p.k = static_cast<int32_t>(in.Int(-1, 5));
  return p;
}

struct Outcome {
  absl::StatusOr<ChunkTerms> terms;
  std::vector<double> grad;
};

template <typename T>
Outcome Run(const Problem& p) {
  std::vector<T> logits = FromDoubles<T>(p.logits);
  const std::vector<T> teacher = FromDoubles<T>(p.teacher);
  const size_t n = p.rows.size();
  const std::vector<ConfidenceOf<T>> confidence(p.confidence.begin(),
                                                p.confidence.end());
  std::vector<double> confidence_grad(n), neg_log_q(n);
  std::vector<int32_t> argmax(n),
      top_k(p.k > 0 ? n * static_cast<size_t>(p.k) : 0);
  Outcome out;
  out.terms = ChunkLoss<T>(
      p.config, p.options,
      {absl::MakeSpan(logits), teacher, confidence, p.rows, p.vocab},
      {absl::MakeSpan(confidence_grad), absl::MakeSpan(neg_log_q),
       absl::MakeSpan(argmax), absl::MakeSpan(top_k), p.k});
  out.grad = AsDoubles(logits);
  return out;
}

void CheckFinite(const Problem& p, const Outcome& o, const char* type) {
  const std::string what = absl::StrCat(
      type, " ", p.config.ShortDebugString(), ", scale ", p.options.logit_scale,
      ", softcap ", p.options.logit_softcap, ", K ", p.options.block_size,
      ", V ", p.vocab, ", rows ", p.rows.size());
  const ChunkTerms& t = *o.terms;
  FUZZ_CHECK(std::isfinite(t.loss_num) && std::isfinite(t.loss_den) &&
                 std::isfinite(t.correct) && std::isfinite(t.accuracy_den),
             "%s: non-finite terms from finite inputs (num %g, den %g)",
             what.c_str(), t.loss_num, t.loss_den);
  for (size_t i = 0; i < o.grad.size(); ++i) {
    FUZZ_CHECK(std::isfinite(o.grad[i]),
               "%s: non-finite gradient %g at row %zu, logit %zu (z = %g)",
               what.c_str(), o.grad[i], i / p.vocab, i % p.vocab, p.logits[i]);
  }
}

}  // namespace
}  // namespace dflash

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace dflash;  // NOLINT
  FuzzInput in(data, size);
  const Problem p = Read(in);
  const Outcome f64 = Run<double>(p);
  const Outcome f32 = Run<float>(p);
  const Outcome bf16 = Run<BFloat16>(p);
  for (const Outcome* o : {&f64, &f32, &bf16}) {
    if (!o->terms.ok()) {
      FUZZ_CHECK(!o->terms.status().message().empty(), "an empty error");
    }
  }
  const bool scaled_sanely = std::isfinite(p.options.logit_scale) &&
                             std::abs(p.options.logit_scale) <= 4;
  if (p.finite && scaled_sanely) {
    if (f64.terms.ok()) CheckFinite(p, f64, "float64");
    if (f32.terms.ok()) CheckFinite(p, f32, "float32");
    if (bf16.terms.ok()) CheckFinite(p, bf16, "bfloat16");
  }
  if (p.finite && p.moderate && scaled_sanely && f64.terms.ok()) {
    FUZZ_CHECK(f32.terms.ok(), "float32 failed where float64 ran: %s",
               std::string(f32.terms.status().message()).c_str());
    const double num = f64.terms->loss_num;
    FUZZ_CHECK(std::abs(f32.terms->loss_num - num) <=
                   1e-4 * (1 + std::abs(num)) * (1 + p.rows.size()),
               "float32 loss_num %.9g, float64 %.9g", f32.terms->loss_num, num);
  }
  return 0;
}
