#ifndef DFLASH_CLI_HEAD_JOB_H_
#define DFLASH_CLI_HEAD_JOB_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <ostream>
#include <string>

#include "absl/status/statusor.h"
#include "heads/fused_head.h"
#include "heads/synthetic_batch.h"
#include "proto/metrics.pb.h"
#include "proto/policy.pb.h"

namespace dflash {

// What the dflash_head command was asked to do. Empty / unset fields keep
// the config's value.
struct HeadJobOptions {
  std::string config_path;  // Empty: the built-in configs/dflash_default.
  std::string loss;         // dflash, dpace, ..., kl, reverse-kl, jsd.
  std::optional<double> gamma;
  std::string mode;  // materialize, save, checkpoint, selective, fused.
  int64_t chunk_blocks = 0;
  std::optional<int32_t> threads;
  uint64_t seed = 1;
  SyntheticShape shape;  // The synthetic batch, without --inputs.
  int64_t block = 0, hidden = 0, vocab = 0;
  std::string inputs_dir;  // .npy tensors instead of a synthetic batch.
  std::string out_dir;     // metrics.json, grad_hidden.npy, grad_lm_head.npy.
  bool compare_modes = false;
};

// The built-in default objective (configs/dflash_default.textproto).
absl::StatusOr<v1::ObjectiveConfig> DefaultObjectiveConfig();

// The config the job runs: file or built-in, flags applied, defaults
// resolved, validated. With --inputs, the shapes come from the files.
absl::StatusOr<v1::ObjectiveConfig> JobConfig(const HeadJobOptions& options);

// The tensors of --inputs=DIR (SEMANTICS.md section 2 derives the rows),
// with `config`'s block size, hidden and vocabulary sizes set from them.
absl::StatusOr<HeadBatch<float>> LoadInputs(const std::string& dir,
                                            v1::ObjectiveConfig& config);

// Writes `batch` as the .npy files LoadInputs reads.
absl::Status SaveInputs(const HeadBatch<float>& batch,
                        const v1::ObjectiveConfig& config, int64_t batch_size,
                        int64_t seq_len, const std::string& dir);

// The metrics.json record of one head run of `config`.
v1::HeadMetrics HeadMetricsOf(const v1::ObjectiveConfig& config,
                              const HeadResult& result);

struct HeadJobResult {
  v1::ObjectiveConfig config;
  HeadResult result;
  v1::HeadMetrics metrics;
  std::vector<float> grad_hidden, grad_weight;
};

// Runs the job, printing the readable report (and the --compare_modes
// table) to `report`; `progress` gets (steps done, steps) per chunk step.
absl::StatusOr<HeadJobResult> RunHeadJob(
    const HeadJobOptions& options, std::ostream& report,
    std::function<void(int64_t, int64_t)> progress = nullptr);

}  // namespace dflash

#endif  // DFLASH_CLI_HEAD_JOB_H_
