#ifndef DFLASH_CLI_HEAD_JOB_H_
#define DFLASH_CLI_HEAD_JOB_H_

// The dflash_head command as a library: one objective through the head on
// a synthetic batch or on .npy tensors, with its report and output files.
// Every failure is a Status naming the flag or file, the value and what was
// expected; sizes are checked against the memory available before they are
// allocated, and output files are replaced all together or not at all.

#include <cstdint>
#include <functional>
#include <optional>
#include <ostream>
#include <string>
#include <variant>
#include <vector>

#include "absl/status/statusor.h"
#include "heads/cpu_head.h"
#include "heads/head_metrics.h"
#include "heads/synthetic_batch.h"
#include "proto/config_overrides.h"
#include "proto/metrics.pb.h"
#include "proto/objective.pb.h"

namespace dflash {

// What the dflash_head command was asked to do. Unset fields keep the
// config's (or the synthetic batch's default) value.
struct HeadJobOptions {
  std::string config_path;  // Empty: the built-in configs/dflash_default.
  // --loss, --gamma, --lk, --kl_scale, --kl_decay, --mode, --chunk_blocks
  // and --threads on top of the config.
  ConfigOverrides overrides;
  // The synthetic batch; each of these with inputs_dir is an error, since
  // the files give the shapes.
  std::optional<uint64_t> seed;
  std::optional<int64_t> batch, seq, anchors, block, hidden, vocab;
  std::string inputs_dir;  // .npy tensors instead of a synthetic batch.
  std::string out_dir;     // metrics.json, grad_hidden.npy, grad_lm_head.npy.
  bool compare_modes = false;
  // Bytes the job may hold; unset: what the system has available.
  std::optional<int64_t> memory_limit;
};

// The synthetic batch's shape when no flag changes it (anchor blocks: a
// config's layout.num_anchors, when it sets one, comes before 128).
inline constexpr SyntheticShape kDefaultSyntheticShape = {1, 4096, 128};
inline constexpr uint64_t kDefaultSeed = 1;

// The built-in default objective (configs/dflash_default.textproto).
absl::StatusOr<v1::ObjectiveConfig> DefaultObjectiveConfig();

// The config the job runs: file or built-in (refused where check_config
// refuses it, ValidateConfigAsWritten), flags applied, the shapes of the
// batch actually used (the synthetic flags, or the headers of the --inputs
// files, which a --config's layout must agree with), defaults resolved,
// validated once. Anchor blocks a synthetic sequence cannot hold are
// refused here, before any work.
absl::StatusOr<v1::ObjectiveConfig> JobConfig(const HeadJobOptions& options);

// A gradient in the head's storage type: float (FLOAT32) or double.
using JobTensor = std::variant<std::vector<float>, std::vector<double>>;

struct HeadJobResult {
  v1::ObjectiveConfig config;
  HeadResult result;
  v1::HeadMetrics metrics;
  JobTensor grad_hidden, grad_weight;  // grad_weight empty when frozen.
  // With head.correction_rank: d/dz and d/dM of the correction.
  JobTensor grad_correction_inputs, grad_correction_weight;
  // Things a user should know that are not errors (printed on stderr).
  std::vector<std::string> notes;
  // What the job predicted it would hold at its peak (checked against
  // --memory_limit before it allocated): batch, gradients, head buffers,
  // weight layout, libraries and threads.
  int64_t predicted_bytes = 0;
};

// Runs the job, printing the readable report (and the --compare_modes
// table) to `report`; `progress` gets (steps done, steps) per chunk step.
// With out_dir, the directory is created and checked before any work, and
// the run's files replace the previous run's as one once complete
// (OutputFileSet; a frozen run removes a trainable run's grad_lm_head.npy).
// The outputs do not depend on `report`: they are written even when it
// fails, and the error then says so.
absl::StatusOr<HeadJobResult> RunHeadJob(
    const HeadJobOptions& options, std::ostream& report,
    std::function<void(int64_t, int64_t)> progress = nullptr);

}  // namespace dflash

#endif  // DFLASH_CLI_HEAD_JOB_H_
