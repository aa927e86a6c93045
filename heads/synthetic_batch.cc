#include "heads/synthetic_batch.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "heads/config/head_facts.h"
#include "losses/loss_family.h"

namespace dflash {

namespace {

// Position p of a synthetic sequence is unsupervised when p % 7 == 6.
constexpr int64_t kUnsupervisedEvery = 7;

}  // namespace

int64_t SyntheticAnchorCapacity(int64_t seq_len) {
  // Anchors p in [0, seq_len - 2] with p and p + 1 supervised: p % 7 < 5.
  const int64_t positions = std::max<int64_t>(seq_len - 1, 0);
  constexpr int64_t kPerPeriod = kUnsupervisedEvery - 2;
  return positions / kUnsupervisedEvery * kPerPeriod +
         std::min(positions % kUnsupervisedEvery, kPerPeriod);
}

template <typename T>
HeadInputs<T> HeadBatch<T>::Inputs(
    const v1::ObjectiveConfig& config) const {
  const LossTraits traits = LossTraitsOf(config.loss());
  const bool teacher = ProjectsTeacher(config);
  const bool confidence = traits.needs_confidence;
  return {hidden,
          teacher ? absl::MakeConstSpan(teacher_hidden)
                  : absl::Span<const T>(),
          confidence ? absl::MakeConstSpan(confidence_logits)
                     : absl::Span<const ConfidenceOf<T>>(),
          rows,
          weight,
          config.head().bias() ? absl::MakeConstSpan(bias)
                               : absl::Span<const T>(),
          correction_inputs,
          correction_weight};
}

template <typename T>
absl::StatusOr<HeadBatch<T>> MakeSyntheticBatch(
    const v1::ObjectiveConfig& config, const SyntheticShape& shape,
    uint64_t seed) {
  const int64_t vocab = config.head().vocab_size();
  const int64_t hidden = config.head().hidden_size();
  const int64_t block = config.layout().block_size();
  if (shape.batch <= 0 || shape.seq_len < 2 || shape.num_anchors <= 0 ||
      vocab <= 0 || hidden <= 0 || block <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "synthetic batch: batch, num_anchors, vocab, hidden and block must be "
        "> 0 and seq_len >= 2, got batch ",
        shape.batch, ", seq_len ", shape.seq_len, ", num_anchors ",
        shape.num_anchors, ", vocab ", vocab, ", hidden ", hidden,
        ", block ", block));
  }
  std::mt19937_64 rng(seed);
  HeadBatch<T> b;
  const int64_t tokens = shape.batch * shape.seq_len;
  std::uniform_int_distribution<int64_t> token(0, vocab - 1);
  b.input_ids.resize(tokens);
  b.loss_mask.resize(tokens);
  std::uniform_real_distribution<double> unit(0, 1);
  const double log_vocab = std::log(static_cast<double>(vocab) + 1);
  for (int64_t i = 0; i < tokens; ++i) {
    b.input_ids[i] =
        shape.peaked
            ? std::min<int64_t>(
                  vocab - 1,
                  static_cast<int64_t>(std::exp(unit(rng) * log_vocab)) - 1)
            : token(rng);
    b.loss_mask[i] =
        (i % shape.seq_len) % kUnsupervisedEvery != kUnsupervisedEvery - 1;
  }
  const TokenBatch token_batch{shape.batch, shape.seq_len, b.input_ids,
                               b.loss_mask};
  DFLASH_ASSIGN_OR_RETURN(Anchors anchors,
                          SampleAnchors(token_batch, shape.num_anchors, seed));
  b.anchors = std::move(anchors);
  DFLASH_ASSIGN_OR_RETURN(
      std::vector<RowMeta> rows,
      LabelRows(token_batch, b.anchors.positions, b.anchors.keep,
                b.anchors.num_anchors, block, vocab,
                LossTraitsOf(config.loss()).labeling));
  b.rows = std::move(rows);
  const int64_t n = static_cast<int64_t>(b.rows.size());
  std::normal_distribution<float> normal(0, 1), noise(0, 0.3f);
  const float weight_scale = 1 / std::sqrt(static_cast<float>(hidden));
  b.weight.resize(vocab * hidden);
  for (T& x : b.weight) x = weight_scale * normal(rng);
  if (config.head().bias()) {
    b.bias.resize(vocab);
    for (int64_t v = 0; v < vocab; ++v) {
      b.bias[v] = static_cast<T>(
          0.1f * normal(rng) +
          (shape.peaked && v >= kFrequentTokens ? kRareTokenBias : 0.0));
    }
  }
  // A draft model's states point at their target, less so further into the
  // block: state += margin(k) * W[target] / |W[target]|^2 lifts the target
  // logit by margin(k) over logits of unit spread.
  b.hidden.resize(n * hidden);
  for (T& x : b.hidden) x = normal(rng);
  for (int64_t r = 0; r < n; ++r) {
    const RowMeta& meta = b.rows[r];
    if (meta.mask <= 0) continue;
    const T* w = b.weight.data() + int64_t{meta.target} * hidden;
    double norm2 = 0;
    for (int64_t h = 0; h < hidden; ++h) norm2 += double{w[h]} * w[h];
    const double margin = kSyntheticMargin - kSyntheticMarginDecay * meta.position;
    const T lift = static_cast<T>(norm2 > 0 ? margin / norm2 : 0);
    T* x = b.hidden.data() + r * hidden;
    for (int64_t h = 0; h < hidden; ++h) x[h] += lift * w[h];
  }
  if (ProjectsTeacher(config)) {
    b.teacher_hidden.resize(n * hidden);
    for (int64_t i = 0; i < n * hidden; ++i) {
      b.teacher_hidden[i] = b.hidden[i] + noise(rng);
    }
  }
  b.confidence_logits.resize(n);
  for (auto& x : b.confidence_logits) x = normal(rng);
  if (const int64_t rank = config.head().correction_rank(); rank > 0) {
    b.correction_inputs.resize(n * rank);
    for (T& x : b.correction_inputs) x = static_cast<T>(normal(rng));
    b.correction_weight.resize(config.head().vocab_size() * rank);
    const double scale = 1 / std::sqrt(static_cast<double>(rank));
    for (T& x : b.correction_weight) x = static_cast<T>(scale * normal(rng));
  }
  return b;
}

template struct HeadBatch<float>;
template struct HeadBatch<double>;
template absl::StatusOr<HeadBatch<float>> MakeSyntheticBatch<float>(
    const v1::ObjectiveConfig&, const SyntheticShape&, uint64_t);
template absl::StatusOr<HeadBatch<double>> MakeSyntheticBatch<double>(
    const v1::ObjectiveConfig&, const SyntheticShape&, uint64_t);

}  // namespace dflash
