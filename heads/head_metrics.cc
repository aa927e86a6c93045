#include "heads/head_metrics.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "losses/loss_family.h"
#include "losses/loss_math.h"

namespace dflash {
namespace {

// The family's name; distillation adds its divergence, dflash and dpace
// their LK composition other than ALPHA.
std::string LossFamilyName(const v1::LossConfig& loss) {
  const std::string name = LossTraitsOf(loss).name;
  const v1::LkComposition::Type lk =
      loss.has_dflash()  ? loss.dflash().lk().type()
      : loss.has_dpace() ? loss.dpace().lk().type()
                         : v1::LkComposition::ALPHA;
  if (lk != v1::LkComposition::ALPHA) {
    return absl::StrCat(name, "/lk-",
                        lk == v1::LkComposition::TV ? "tv" : "lambda");
  }
  if (!loss.has_distillation()) return name;
  return absl::StrCat(
      name, "/",
      v1::DistillationLoss::Divergence_Name(loss.distillation().divergence()));
}

}  // namespace

v1::HeadMetrics HeadMetricsOf(const v1::ObjectiveConfig& config,
                              const HeadResult& r) {
  v1::HeadMetrics m;
  m.set_mode(v1::HeadConfig::ExecutionMode_Name(r.mode));
  m.set_loss_family(LossFamilyName(config.loss()));
  m.set_loss(r.loss);
  m.set_loss_num(r.terms.loss_num);
  m.set_loss_den(r.terms.loss_den);
  m.set_accuracy(r.accuracy);
  m.set_target_probability(r.terms.accuracy_den > 0
                               ? r.terms.target_probability /
                                     r.terms.accuracy_den
                               : 0);
  m.set_ce_loss_num(r.terms.ce_num);
  m.set_tv_loss_num(r.terms.tv_num);
  m.set_lk_kl_weight(r.lk_kl_weight.value_or(0));
  for (double a : r.accuracy_per_position) m.add_accuracy_per_position(a);
  const ChunkTerms& t = r.terms;
  auto ratio = [](double num, double den) { return den > 0 ? num / den : 0; };
  double weight = 0;
  for (double w : t.loss_weight_per_position) weight += w;
  for (size_t k = 0; k < t.mask_per_position.size(); ++k) {
    const double mass = t.mask_per_position[k];
    m.add_target_probability_per_position(
        ratio(t.target_probability_per_position[k], mass));
    m.add_loss_weight_share_per_position(
        ratio(t.loss_weight_per_position[k], weight));
    m.add_top_k_recall_per_position(
        ratio(t.top_k_recall_per_position[k], mass));
    m.add_top_k_mass_per_position(ratio(t.top_k_mass_per_position[k], mass));
    if (config.head().teacher_diagnostics()) {
      m.add_teacher_acceptance_per_position(
          ratio(t.teacher_acceptance_per_position[k], mass));
      m.add_teacher_agreement_per_position(
          ratio(t.teacher_agreement_per_position[k], mass));
      m.add_teacher_top_k_mass_per_position(
          ratio(t.teacher_top_k_mass_per_position[k], mass));
    }
  }
  m.set_metric_top_k(ChunkLossOptionsOf(config).metric_top_k);
  m.set_expected_accepted_length(
      ratio(t.accepted_length.expected_num, t.accepted_length.block_den));
  m.set_oracle_accepted_length(
      ratio(t.accepted_length.oracle_num, t.accepted_length.block_den));
  m.set_teacher_expected_accepted_length(ratio(
      t.accepted_length.teacher_expected_num, t.accepted_length.block_den));
  if (config.loss().has_dspark()) {
    m.set_l1_loss(ratio(t.l1_num, t.loss_den));
    m.set_confidence_loss(ratio(t.confidence_num, t.loss_den));
    m.set_confidence_abs_error(ratio(t.confidence_error_num, t.loss_den));
    m.set_teacher_top1_prob(ratio(t.teacher_top1, t.accuracy_den));
    m.set_draft_top1_prob(ratio(t.draft_top1, t.accuracy_den));
  }
  if (config.loss().has_domino()) {
    constexpr double kOffset = kDominoDenominatorOffset;
    const AcceptedLengthTerms& a = t.accepted_length;
    m.set_base_loss(t.base_ce_num / (t.loss_den + kOffset));
    m.set_base_accuracy(t.base_correct / (t.accuracy_den + kOffset));
    m.set_accept_len(a.greedy_num / (a.greedy_den + kOffset));
    m.set_base_accept_len(a.base_greedy_num / (a.greedy_den + kOffset));
  }
  if (r.stats.filter_tiles > 0) {
    m.set_gradient_filter_skipped_fraction(
        static_cast<double>(r.stats.filter_skipped_tiles) /
        r.stats.filter_tiles);
  }
  m.set_gemms(r.stats.gemm_passes);
  m.set_gemm_calls(r.stats.gemm_calls);
  m.set_flops(r.stats.gemm_flops);
  m.set_peak_bytes(r.stats.peak_bytes);
  m.set_seconds(r.stats.forward_seconds + r.stats.backward_seconds);
  m.set_gemm_seconds(r.stats.gemm_seconds);
  m.set_loss_seconds(r.stats.loss_seconds);
  m.set_chunks(r.stats.chunks);
  m.set_rows(r.plan.chunks.empty() ? 0 : r.plan.chunks.back().end);
  m.set_projected_rows(r.stats.projected_rows);
  m.set_weighted_rows(r.stats.projected_rows);
  m.set_segment_recomputes(r.stats.segment_recomputes);
  return m;
}

}  // namespace dflash
