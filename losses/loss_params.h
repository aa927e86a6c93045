#ifndef DFLASH_LOSSES_LOSS_PARAMS_H_
#define DFLASH_LOSSES_LOSS_PARAMS_H_

// LossParams: a v1::LossConfig resolved into plain values, the only form of
// the loss config that the CPU loss and the CUDA kernels read (ResolveLoss
// in loss_family.h makes one). ChunkLossOptions: what the head adds (block
// size, logit scale and softcap). Plain types without protobuf, so that
// nvcc and the host share them.

#include <cstdint>

namespace dflash {

struct VocabShard;  // losses/vocab_shard.h

// The loss family, as LossConfig's `family` oneof sets it.
enum class LossFamily : int32_t {
  kNone = 0,
  kDFlash,
  kDPace,
  kTv,
  kLkLambda,
  kDSpark,
  kDistillation,
  kDomino,
};

// DPaceLoss.Variant and DistillationLoss.Divergence.
enum class DPaceVariant : int32_t {
  kDPace = 0,
  kCumulative = 1,
  kContinuation = 2
};
enum class Divergence : int32_t { kForwardKl = 0, kReverseKl = 1, kJsd = 2 };

// How a softmax family's cross-entropy and total-variation parts combine
// (LkComposition, and the tv and lk_lambda families): cross-entropy only;
// tv only; SpecForge's LK lambda with one CE weight for the batch, known
// only after the last chunk; dflash's lk_lambda with a CE weight per anchor
// block.
enum class LkMode : int32_t {
  kCrossEntropy = 0,
  kTv = 1,
  kLambdaBatch = 2,
  kLambdaBlock = 3
};

struct LossParams {
  LossFamily family = LossFamily::kNone;
  // A row's decay: m * exp(-max(k - decay_from, 0) / gamma), none when
  // gamma is 0 (absent). decay_from is 1 for the DFlash decay, 0 for DSpark.
  double gamma = 0;
  int32_t decay_from = 1;
  // D-PACE; sequence_balanced: each row's weight times its RowMeta's
  // sequence_share, loss_den the sequences with weight (the head's).
  DPaceVariant dpace_variant = DPaceVariant::kDPace;
  double alpha = 0;
  bool sequence_balanced = false;
  // The LK composition; kl_scale and kl_decay for the two lambdas.
  LkMode lk = LkMode::kCrossEntropy;
  double kl_scale = 0, kl_decay = 0;
  // DSpark: the CE, L1 and confidence weights; D-PARD replaces CE and L1
  // by the Renyi divergence with credit smoothed by dpard_alpha.
  double ce_weight = 1, l1_weight = 0, confidence_weight = 0;
  bool dpard = false;
  double dpard_alpha = 0.5;
  // Domino: the base loss's share, whether slot k predicts anchor + 1 + k
  // (shift_label), and the first block position the head's correction
  // applies at (the loss reads base and correction logits apart).
  double lambda_base = 0;
  bool shift_label = false;
  int32_t suffix_start = 0;
  // Distillation.
  Divergence divergence = Divergence::kForwardKl;
  double inv_temperature = 1, beta = 0.5;
  // Cross-entropy options; label_smoothing is 0 for families without a
  // cross-entropy term.
  int64_t ignore_index = -100;
  double label_smoothing = 0, z_loss_scale = 0;
  // CrossEntropyOptions.ignored_target_weight COUNT: a row whose target is
  // ignore_index keeps its mask and has no target class (HasTarget).
  bool count_ignored = false;
};

// How logits z become the loss's logits z': z' = c * tanh(s * z / c) with
// softcap c > 0, z' = s * z without (HeadConfig.logit_scale/logit_softcap).
// The teacher's logits, from the same head, get the same transform.
// metric_top_k > 0 adds the top-k diagnostics (the target among the k
// largest z', their probability mass) to the terms; at most min(64, V).
//
// vocab_shard (borrowed; null: the whole vocabulary is here) makes the CPU
// loss vocab-parallel: the logits' width (ChunkLossInputs::vocab) is this
// process's classes [offset, offset + width) of vocab_shard->vocab, and
// every process of the exchange's group runs the same chunks in the same
// order (docs/semantics.md section 8.2). Target ids, argmax and
// top-k ids are global; metric_top_k and outputs.k are bounded by the
// whole vocabulary. The CUDA loss runs every family so.
struct ChunkLossOptions {
  int64_t block_size = 1;
  double logit_scale = 1;
  double logit_softcap = 0;
  int32_t metric_top_k = 0;
  const VocabShard* vocab_shard = nullptr;
};

}  // namespace dflash

#endif  // DFLASH_LOSSES_LOSS_PARAMS_H_
