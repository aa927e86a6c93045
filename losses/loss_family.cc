#include "losses/loss_family.h"

#include <cstdint>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "losses/loss_math.h"

namespace dflash {
namespace {

template <typename Loss>
void Gamma(const std::string& path, const Loss& loss, ProblemList& problems) {
  if (loss.has_gamma()) problems.AtLeast(path + ".gamma", loss.gamma(), 0);
}

void Lk(const std::string& path, const v1::LkComposition& lk,
        ProblemList& problems) {
  problems.Specified(path + ".type", lk.type(),
                     v1::LkComposition::Type_Name(lk.type()));
  problems.AtLeast(path + ".kl_scale", lk.kl_scale(), 0);
  problems.AtLeast(path + ".kl_decay", lk.kl_decay(), 0);
}

// The family's LK composition, read from its `lk` field.
void ReadLk(const v1::LkComposition& lk, LossParams& p) {
  switch (lk.type()) {
    case v1::LkComposition::TV:
      p.lk = LkMode::kTv;
      break;
    case v1::LkComposition::LAMBDA:
      p.lk = LkMode::kLambdaBatch;
      p.kl_scale = lk.kl_scale();
      p.kl_decay = lk.kl_decay();
      break;
    default:
      p.lk = LkMode::kCrossEntropy;
      break;
  }
}

// The path of the family's `lk` field, or empty when it has none set.
std::string LkPath(const v1::LossConfig& loss) {
  if (loss.has_dflash() && loss.dflash().has_lk()) return "loss.dflash.lk";
  if (loss.has_dpace() && loss.dpace().has_lk()) return "loss.dpace.lk";
  return "";
}

}  // namespace

LossTraits LossTraitsOf(const LossParams& loss) {
  LossTraits traits;
  switch (loss.family) {
    case LossFamily::kDFlash:
      traits.name = "dflash";
      break;
    case LossFamily::kDPace:
      traits.name = "dpace";
      break;
    case LossFamily::kTv:
      traits.name = "tv";
      break;
    case LossFamily::kLkLambda:
      traits.name = "lk_lambda";
      break;
    case LossFamily::kDSpark:
      traits.name = "dspark";
      // SpecForge reads the teacher only for a term that needs it.
      traits.needs_teacher =
          loss.dpard || loss.l1_weight > 0 || loss.confidence_weight > 0;
      traits.needs_confidence = loss.confidence_weight > 0;
      traits.has_cross_entropy = !loss.dpard;
      traits.labeling = Labeling::kDSpark;
      break;
    case LossFamily::kDomino:
      traits.name = "domino";
      traits.splits_correction = true;
      traits.labeling =
          loss.shift_label ? Labeling::kShifted : Labeling::kDFlash;
      break;
    case LossFamily::kDistillation:
      traits.name = "distillation";
      traits.needs_teacher = true;
      traits.has_cross_entropy = false;
      break;
    case LossFamily::kNone:
      break;
  }
  if (loss.lk == LkMode::kTv) traits.has_cross_entropy = false;
  traits.first_accepted_position = traits.labeling == Labeling::kDFlash ? 1 : 0;
  traits.accepts_teacher =
      loss.family == LossFamily::kDSpark && traits.needs_teacher;
  traits.couples_blocks = CouplesBlocks(loss);
  return traits;
}

LossTraits LossTraitsOf(const v1::LossConfig& loss) {
  return LossTraitsOf(LossParamsOf(loss));
}

LossParams LossParamsOf(const v1::LossConfig& loss) {
  LossParams p;
  // An absent gamma reads as 0: no decay.
  auto decay = [&p](const auto& family, int32_t from) {
    p.gamma = family.has_gamma() ? family.gamma() : 0;
    p.decay_from = from;
  };
  switch (loss.family_case()) {
    case v1::LossConfig::kDflash:
      p.family = LossFamily::kDFlash;
      decay(loss.dflash(), 1);
      ReadLk(loss.dflash().lk(), p);
      break;
    case v1::LossConfig::kDpace:
      p.family = LossFamily::kDPace;
      p.alpha = loss.dpace().alpha();
      switch (loss.dpace().variant()) {
        case v1::DPaceLoss::CUMULATIVE_CONFIDENCE_ONLY:
          p.dpace_variant = DPaceVariant::kCumulative;
          break;
        case v1::DPaceLoss::CONTINUATION_VALUE_ONLY:
          p.dpace_variant = DPaceVariant::kContinuation;
          break;
        default:
          p.dpace_variant = DPaceVariant::kDPace;
          break;
      }
      ReadLk(loss.dpace().lk(), p);
      p.sequence_balanced =
          loss.dpace().denominator() == v1::DPaceLoss::SEQUENCE_BALANCED;
      break;
    case v1::LossConfig::kTv:
      p.family = LossFamily::kTv;
      p.lk = LkMode::kTv;
      decay(loss.tv(), 1);
      break;
    case v1::LossConfig::kLkLambda:
      p.family = LossFamily::kLkLambda;
      p.lk = LkMode::kLambdaBlock;
      decay(loss.lk_lambda(), 1);
      p.kl_scale = loss.lk_lambda().kl_scale();
      p.kl_decay = loss.lk_lambda().kl_decay();
      break;
    case v1::LossConfig::kDspark: {
      const v1::DSparkLoss& d = loss.dspark();
      p.family = LossFamily::kDSpark;
      decay(d, 0);
      p.ce_weight = d.ce_weight();
      p.l1_weight = d.l1_weight();
      p.confidence_weight = d.confidence_weight();
      p.dpard = d.objective() == v1::DSparkLoss::DPARD;
      p.dpard_alpha = d.dpard_alpha();
      break;
    }
    case v1::LossConfig::kDomino: {
      const v1::DominoLoss& d = loss.domino();
      p.family = LossFamily::kDomino;
      decay(d, d.shift_label() ? 0 : 1);
      p.lambda_base = d.lambda_base();
      p.shift_label = d.shift_label();
      p.suffix_start = d.pure_draft_prefix_len() + (d.shift_label() ? 0 : 1);
      break;
    }
    case v1::LossConfig::kDistillation: {
      const v1::DistillationLoss& d = loss.distillation();
      p.family = LossFamily::kDistillation;
      decay(d, 1);
      p.inv_temperature = 1 / d.temperature();
      p.beta = d.beta();
      p.divergence = d.divergence() == v1::DistillationLoss::REVERSE_KL
                         ? Divergence::kReverseKl
                     : d.divergence() == v1::DistillationLoss::JSD
                         ? Divergence::kJsd
                         : Divergence::kForwardKl;
      break;
    }
    case v1::LossConfig::FAMILY_NOT_SET:
      break;
  }
  const v1::CrossEntropyOptions& ce = loss.cross_entropy();
  p.ignore_index = ce.ignore_index();
  p.label_smoothing =
      LossTraitsOf(p).has_cross_entropy ? ce.label_smoothing() : 0;
  p.z_loss_scale = ce.z_loss_scale();
  p.count_ignored =
      ce.ignored_target_weight() == v1::CrossEntropyOptions::COUNT;
  return p;
}

absl::StatusOr<LossParams> ResolveLoss(const v1::LossConfig& loss) {
  DFLASH_RETURN_IF_ERROR(ValidateLossConfig(loss));
  return LossParamsOf(loss);
}

void AddLossConfigProblems(const v1::LossConfig& loss, ProblemList& problems) {
  switch (loss.family_case()) {
    case v1::LossConfig::kDflash:
      Gamma("loss.dflash", loss.dflash(), problems);
      if (loss.dflash().has_lk()) {
        Lk("loss.dflash.lk", loss.dflash().lk(), problems);
      }
      break;
    case v1::LossConfig::kDpace:
      problems.Within("loss.dpace.alpha", loss.dpace().alpha(), 0, 1);
      problems.Specified("loss.dpace.variant", loss.dpace().variant(),
                         v1::DPaceLoss::Variant_Name(loss.dpace().variant()));
      if (loss.dpace().has_lk()) {
        Lk("loss.dpace.lk", loss.dpace().lk(), problems);
      }
      problems.Specified(
          "loss.dpace.denominator", loss.dpace().denominator(),
          v1::DPaceLoss::Denominator_Name(loss.dpace().denominator()));
      break;
    case v1::LossConfig::kTv:
      Gamma("loss.tv", loss.tv(), problems);
      break;
    case v1::LossConfig::kLkLambda:
      Gamma("loss.lk_lambda", loss.lk_lambda(), problems);
      problems.AtLeast("loss.lk_lambda.kl_scale", loss.lk_lambda().kl_scale(),
                       0);
      problems.AtLeast("loss.lk_lambda.kl_decay", loss.lk_lambda().kl_decay(),
                       0);
      break;
    case v1::LossConfig::kDspark: {
      const v1::DSparkLoss& d = loss.dspark();
      Gamma("loss.dspark", d, problems);
      problems.AtLeast("loss.dspark.ce_weight", d.ce_weight(), 0);
      problems.AtLeast("loss.dspark.l1_weight", d.l1_weight(), 0);
      problems.AtLeast("loss.dspark.confidence_weight", d.confidence_weight(),
                       0);
      problems.Specified("loss.dspark.objective", d.objective(),
                         v1::DSparkLoss::Objective_Name(d.objective()));
      if (!(d.dpard_alpha() > 0 && d.dpard_alpha() < 1)) {
        problems.Add("loss.dspark.dpard_alpha",
                     absl::StrCat("must lie in (0, 1), got ",
                                  ProblemNumber(d.dpard_alpha())));
      }
      if (d.objective() == v1::DSparkLoss::DPARD) {
        for (const auto& [name, value] :
             {std::pair<const char*, double>{"ce_weight", d.ce_weight()},
              {"l1_weight", d.l1_weight()}}) {
          if (value != 0) {
            problems.Add(absl::StrCat("loss.dspark.", name),
                         absl::StrCat("must be 0 with objective DPARD (D-PARD "
                                      "replaces CE and L1), got ",
                                      ProblemNumber(value)));
          }
        }
      }
      break;
    }
    case v1::LossConfig::kDomino: {
      const v1::DominoLoss& d = loss.domino();
      Gamma("loss.domino", d, problems);
      problems.AtLeast("loss.domino.pure_draft_prefix_len",
                       d.pure_draft_prefix_len(), 0);
      problems.Within("loss.domino.lambda_base", d.lambda_base(), 0, 1);
      break;
    }
    case v1::LossConfig::kDistillation: {
      const v1::DistillationLoss& distillation = loss.distillation();
      Gamma("loss.distillation", distillation, problems);
      problems.Specified(
          "loss.distillation.divergence", distillation.divergence(),
          v1::DistillationLoss::Divergence_Name(distillation.divergence()));
      if (distillation.divergence() == v1::DistillationLoss::JSD &&
          !(distillation.beta() > 0 && distillation.beta() < 1)) {
        // The mixture at beta 0 or 1 is one of the two sides: the JSD is 0.
        problems.Add("loss.distillation.beta",
                     absl::StrCat("must lie in (0, 1) for JSD (use FORWARD_KL "
                                  "or REVERSE_KL for the end points), got ",
                                  ProblemNumber(distillation.beta())));
      } else {
        problems.Within("loss.distillation.beta", distillation.beta(), 0, 1);
      }
      problems.Above("loss.distillation.temperature",
                     distillation.temperature(), 0);
      break;
    }
    case v1::LossConfig::FAMILY_NOT_SET:
      problems.Add("loss", "one loss family must be set (dflash, dpace, tv, "
                           "lk_lambda, dspark, domino, distillation), got "
                           "none");
      break;
  }
  const v1::CrossEntropyOptions& ce = loss.cross_entropy();
  const double smoothing = ce.label_smoothing();
  if (!(smoothing >= 0 && smoothing < 1)) {
    problems.Add("loss.cross_entropy.label_smoothing",
                 absl::StrCat("must lie in [0, 1), got ", ProblemNumber(smoothing)));
  }
  problems.AtLeast("loss.cross_entropy.z_loss_scale", ce.z_loss_scale(), 0);
  problems.Specified(
      "loss.cross_entropy.ignored_target_weight", ce.ignored_target_weight(),
      v1::CrossEntropyOptions::IgnoredTargetWeight_Name(
          ce.ignored_target_weight()));
  if (ce.ignored_target_weight() == v1::CrossEntropyOptions::COUNT) {
    // A non-negative ignore_index is a class: whether its row is then
    // correct, or its target the argmax's, SpecForge (always -100) never
    // says.
    // And an int32, as the rows' targets are.
    if (ce.ignore_index() >= 0 ||
        ce.ignore_index() < std::numeric_limits<int32_t>::min()) {
      problems.Add("loss.cross_entropy.ignore_index",
                   absl::StrCat("must be negative, and at least -2^31, with "
                                "ignored_target_weight COUNT (SpecForge's "
                                "-100, never a class), got ",
                                ce.ignore_index()));
    }
    // Families SpecForge does not have leave COUNT undefined; its Domino
    // embeds each target id (embed_tokens(target_ids), or the next slot's
    // predecessor with shift_label), which raises on -100.
    if (loss.has_lk_lambda() || loss.has_distillation()) {
      problems.Add("loss.cross_entropy.ignored_target_weight",
                   absl::StrCat("COUNT is SpecForge's convention, which loss.",
                                loss.has_lk_lambda() ? "lk_lambda"
                                                     : "distillation",
                                " has no counterpart in (use DROP, or "
                                "dflash { lk { type: LAMBDA } } for "
                                "SpecForge's LK lambda), got COUNT"));
    }
    if (loss.has_domino()) {
      problems.Add("loss.cross_entropy.ignored_target_weight",
                   "COUNT is undefined for loss.domino: SpecForge's Domino "
                   "embeds every target id, which fails on an ignored one "
                   "(use DROP), got COUNT");
    }
    // D-PARD's credit chains the rows' teacher acceptance, not q; how
    // SpecForge's would take such a row is not matched here.
    if (loss.has_dspark() &&
        loss.dspark().objective() == v1::DSparkLoss::DPARD) {
      problems.Add("loss.cross_entropy.ignored_target_weight",
                   "COUNT is not matched for loss.dspark objective DPARD "
                   "(use DROP), got COUNT");
    }
  }
  // Label smoothing reshapes a cross-entropy term; tv and distillation have
  // none. The z-loss acts on the draft's logsumexp at temperature 1, which a
  // distillation at another temperature never forms.
  const LossParams params = LossParamsOf(loss);
  const LossTraits traits = LossTraitsOf(params);
  const std::string lk_path = LkPath(loss);
  // The batch-level lambda defers each row's gradient factor until the
  // batch's acceptance is known (LkDeferredFactor); that needs every part of
  // the row's gradient along p - onehot, which label smoothing and the
  // z-loss are not. SpecForge's composition has neither.
  if (params.lk == LkMode::kLambdaBatch || params.lk == LkMode::kTv) {
    const char* type = params.lk == LkMode::kTv ? "TV" : "LAMBDA";
    if (smoothing > 0 && !lk_path.empty()) {
      problems.Add("loss.cross_entropy.label_smoothing",
                   absl::StrCat("does not apply with ", lk_path, ".type ", type,
                                " (the LK composition is defined on "
                                "plain cross-entropy), got ",
                                ProblemNumber(smoothing)));
    }
    if (ce.z_loss_scale() > 0 && params.lk == LkMode::kLambdaBatch) {
      problems.Add(
          "loss.cross_entropy.z_loss_scale",
          absl::StrCat("does not apply with ", lk_path,
                       ".type LAMBDA (its batch-level CE weight scales "
                       "each row's gradient after the last chunk, "
                       "which the z-loss's part would not follow; "
                       "loss.lk_lambda takes it), got ",
                       ProblemNumber(ce.z_loss_scale())));
    }
  }
  if (smoothing > 0 && !traits.has_cross_entropy && lk_path.empty()) {
    problems.Add("loss.cross_entropy.label_smoothing",
                 absl::StrCat("applies to cross-entropy terms, which loss.",
                              traits.name,
                              " does not have, got ", ProblemNumber(smoothing)));
  }
  if (ce.z_loss_scale() > 0 &&
      (loss.has_distillation() || loss.has_domino() || params.dpard)) {
    problems.Add("loss.cross_entropy.z_loss_scale",
                 absl::StrCat("does not apply to loss.", traits.name,
                              params.dpard ? " with objective DPARD" : "",
                              ", got ", ProblemNumber(ce.z_loss_scale())));
  }
  // Domino's two cross-entropies are SpecForge's plain ones.
  if (smoothing > 0 && loss.has_domino()) {
    problems.Add("loss.cross_entropy.label_smoothing",
                 absl::StrCat("does not apply to loss.domino, got ",
                              ProblemNumber(smoothing)));
  }
}


absl::Status ValidateLossConfig(const v1::LossConfig& loss) {
  ProblemList problems;
  AddLossConfigProblems(loss, problems);
  return problems.ToStatus();
}

}  // namespace dflash
