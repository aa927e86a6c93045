#ifndef DFLASH_TESTS_SPECFORGE_GOLDEN_H_
#define DFLASH_TESTS_SPECFORGE_GOLDEN_H_

// What every SpecForge golden case holds (tools/specforge_goldens.py and
// tools/specforge_dspark_goldens.py write it): its dflash config, the token
// batch and anchors, the draft's states, the frozen lm_head and SpecForge's
// d(loss)/d(states); and the batch labelled as the config's loss labels it.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "losses/row_meta.h"
#include "proto/objective.pb.h"

namespace dflash {

struct SpecForgeBatch {
  std::string name;
  v1::ObjectiveConfig config;
  int64_t batch = 0, seq_len = 0, num_anchors = 0;
  std::vector<int64_t> input_ids, anchors;
  std::vector<uint8_t> loss_mask, keep;
  std::vector<double> hidden, weight, grad_hidden;
};

// `name`.npy of the case directory `dir` as float64 values; a missing or
// bad file fails the test and gives none.
std::vector<double> ReadGoldenValues(const std::string& dir,
                                     const std::string& name);
// The same, empty without a failure where the file is absent.
std::vector<double> ReadOptionalGoldenValues(const std::string& dir,
                                             const std::string& name);

// The case in `dir`; a failure fails the test.
SpecForgeBatch LoadSpecForgeBatch(const std::string& dir);

// The goldens' relative tolerance: float64 round-off, except where
// SpecForge builds its decay weights in float32 (`.float()`) and dflash
// keeps them in double: then float32's.
double SpecForgeTolerance(const v1::ObjectiveConfig& config);

// |actual - expected| within tolerance * max(1, |expected|), `what` named.
void ExpectNear(double actual, double expected, double tolerance,
                const std::string& what);

// The case's rows, labelled as `config`'s loss labels them.
absl::StatusOr<std::vector<RowMeta>> LabelSpecForgeBatch(
    const SpecForgeBatch& batch, const v1::ObjectiveConfig& config);

// A case of tests/goldens/specforge_main (tools/specforge_main_goldens.py):
// SpecForge main's objective on given states, targets (some ignored) and
// weight masks, as the head's rows (row (b, n, k) of block b * N + n).
struct SpecForgeMainGolden {
  // terms.npy, in the generator's TERMS order.
  enum Term {
    kCeLossNum,
    kTvLossNum,
    kLossDen,
    kTargetProbabilityNum,
    kCorrectNum,
    kAccuracyDen,
    kLossNum,
    kLoss,
    kTermCount,
  };
  std::string name;
  v1::ObjectiveConfig config;
  std::vector<RowMeta> rows;
  std::vector<double> hidden, weight, terms, grad_hidden;
  // [K], where no target is ignored: SpecForge's metric loss_weight_num
  // (its probabilities taken in float32), else empty.
  std::vector<double> loss_weight;
};

// Every case under `dir`; a failure fails the test.
std::vector<SpecForgeMainGolden> LoadSpecForgeMainGoldens(
    const std::string& dir);

}  // namespace dflash

#endif  // DFLASH_TESTS_SPECFORGE_GOLDEN_H_
