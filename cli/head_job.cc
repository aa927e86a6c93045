#include "cli/head_job.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/checked_math.h"
#include "base/file.h"
#include "base/status_macros.h"
#include "base/system_memory.h"
#include "base/threads.h"
#include "base/tracking_allocator.h"
#include "cli/job_inputs.h"
#include "cli/job_memory.h"
#include "configs/default_config.h"
#include "google/protobuf/util/json_util.h"
#include "heads/cpu_head.h"
#include "heads/cpu_projection.h"
#include "heads/head_metrics.h"
#include "heads/head_plan.h"
#include "io/npy.h"
#include "losses/loss_family.h"
#include "proto/config.h"
#include "proto/config_overrides.h"

namespace dflash {
namespace {

// Outputs of ours in --out; a run removes those it does not write.
constexpr char kMetricsFile[] = "metrics.json";
constexpr char kGradHiddenFile[] = "grad_hidden.npy";
constexpr char kGradWeightFile[] = "grad_lm_head.npy";
constexpr char kGradCorrectionInputsFile[] = "grad_correction_inputs.npy";
constexpr char kGradCorrectionWeightFile[] = "grad_correction_weight.npy";

bool NeedsConfidence(const v1::ObjectiveConfig& config) {
  return LossTraitsOf(config.loss()).needs_confidence;
}

absl::Status CheckSyntheticFlags(const HeadJobOptions& options) {
  if (options.inputs_dir.empty()) return absl::OkStatus();
  const std::pair<const char*, std::optional<int64_t>> flags[] = {
      {"--batch", options.batch},     {"--seq", options.seq},
      {"--anchors", options.anchors}, {"--block", options.block},
      {"--hidden", options.hidden},   {"--vocab", options.vocab}};
  for (const auto& [flag, value] : flags) {
    if (value.has_value()) {
      return absl::InvalidArgumentError(absl::StrCat(
          flag,
          ": shapes the synthetic batch, which --inputs replaces (the "
          "files give the shapes), got ",
          *value));
    }
  }
  if (options.seed.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--seed: seeds the synthetic batch, which --inputs replaces, got ",
        *options.seed));
  }
  return absl::OkStatus();
}

template <typename T>
std::vector<T>& Values(JobTensor& tensor) {
  if (!std::holds_alternative<std::vector<T>>(tensor)) {
    tensor = std::vector<T>();
  }
  return std::get<std::vector<T>>(tensor);
}

absl::string_view Data(const JobTensor& tensor) {
  return std::visit(
      [](const auto& values) {
        return absl::string_view(reinterpret_cast<const char*>(values.data()),
                                 values.size() * sizeof(values[0]));
      },
      tensor);
}

NpyType TypeOf(const JobTensor& tensor) {
  return std::holds_alternative<std::vector<float>>(tensor) ? NpyType::kFloat32
                                                            : NpyType::kFloat64;
}

bool Empty(const JobTensor& tensor) {
  return std::visit([](const auto& values) { return values.empty(); }, tensor);
}

template <typename T>
absl::StatusOr<HeadJobResult> RunOnce(
    const v1::ObjectiveConfig& config, const HeadBatch<T>& batch,
    int64_t limit_bytes, std::function<void(int64_t, int64_t)> progress) {
  HeadJobResult job;
  job.config = config;
  const int64_t rows = static_cast<int64_t>(batch.rows.size());
  const int64_t hidden = config.head().hidden_size();
  std::vector<T>& grad_hidden = Values<T>(job.grad_hidden);
  std::vector<T>& grad_weight = Values<T>(job.grad_weight);
  grad_hidden.assign(rows * hidden, 0);
  if (config.head().trainable()) {
    grad_weight.assign(config.head().vocab_size() * hidden, 0);
  }
  std::vector<T> grad_bias(config.head().trainable() && config.head().bias()
                               ? config.head().vocab_size()
                               : 0);
  const bool confidence = NeedsConfidence(config);
  std::vector<ConfidenceOf<T>> grad_confidence(confidence ? rows : 0);
  const int64_t rank = config.head().correction_rank();
  std::vector<T>& grad_z = Values<T>(job.grad_correction_inputs);
  std::vector<T>& grad_m = Values<T>(job.grad_correction_weight);
  grad_z.assign(rows * rank, 0);
  grad_m.assign(config.head().vocab_size() * rank, 0);
  HeadGradients<T> gradients{
      absl::MakeSpan(grad_hidden), absl::MakeSpan(grad_weight),
      absl::MakeSpan(grad_bias),   absl::MakeSpan(grad_confidence),
      absl::MakeSpan(grad_z),      absl::MakeSpan(grad_m)};
  TrackingAllocator allocator(limit_bytes);
  HeadOptions options;
  options.progress = std::move(progress);
  DFLASH_ASSIGN_OR_RETURN(HeadResult result,
                          RunHead<T>(config, batch.Inputs(config), gradients,
                                     allocator, {}, options));
  job.result = std::move(result);
  job.metrics = HeadMetricsOf(config, job.result);
  return job;
}

void PrintReport(const HeadJobResult& job, const std::string& source,
                 std::ostream& out) {
  const v1::ObjectiveConfig& c = job.config;
  const HeadResult& r = job.result;
  const HeadStats& s = r.stats;
  const int64_t k_size = c.layout().block_size();
  const int64_t rows = job.metrics.rows();
  const double seconds = job.metrics.seconds();
  out << absl::StrFormat("dflash_head: %s head, %s loss, %s, %s\n",
                         v1::HeadConfig::ExecutionMode_Name(r.mode),
                         job.metrics.loss_family(),
                         v1::HeadConfig::DType_Name(c.head().dtype()), source);
  out << absl::StrFormat(
      "  batch        %d rows = %d blocks x %d positions (%d projected), "
      "H %d, V %d\n",
      rows, rows / k_size, k_size, s.projected_rows, c.head().hidden_size(),
      c.head().vocab_size());
  out << absl::StrFormat(
      "  chunk plan   %d chunk(s) of up to %d rows, %.1f MiB of logits each\n",
      s.chunks, r.plan.rows_per_chunk, r.plan.max_chunk_bytes / 1048576.0);
  out << absl::StrFormat("  loss         %.6f (num %.6g / den %.6g)\n", r.loss,
                         r.terms.loss_num, r.terms.loss_den);
  std::vector<std::string> per_k;
  for (int64_t k = 0; k < k_size; ++k) {
    if (r.terms.mask_per_position[k] == 0) continue;
    per_k.push_back(absl::StrFormat("k%d %.3f", k, r.accuracy_per_position[k]));
  }
  out << absl::StrFormat(
      "  accuracy     %.4f; per position: %s\n", r.accuracy,
      per_k.empty() ? "none supervised" : absl::StrJoin(per_k, "  "));
  const AcceptedLengthTerms& accepted = r.terms.accepted_length;
  if (accepted.block_den > 0) {
    const int32_t top_k = ChunkLossOptionsOf(c).metric_top_k;
    out << absl::StrFormat(
        "  accepted     %.3f tokens per block expected%s%s\n",
        accepted.expected_num / accepted.block_den,
        top_k > 0
            ? absl::StrFormat(", %.3f oracle (target in top-%d)",
                              accepted.oracle_num / accepted.block_den, top_k)
            : "",
        c.head().teacher_diagnostics() || c.loss().has_dspark()
            ? absl::StrFormat(
                  ", %.3f against the teacher",
                  accepted.teacher_expected_num / accepted.block_den)
            : "");
  }
  if (c.loss().has_domino()) {
    out << absl::StrFormat(
        "  domino       base loss %.6f, base accuracy %.4f; greedy accepted "
        "length %.3f (base %.3f)\n",
        job.metrics.base_loss(), job.metrics.base_accuracy(),
        job.metrics.accept_len(), job.metrics.base_accept_len());
  }
  out << absl::StrFormat("  GEMMs        %.3g passes (%d calls), %.3f TFLOP\n",
                         s.gemm_passes, s.gemm_calls, s.gemm_flops / 1e12);
  out << absl::StrFormat(
      "  time         %.3f s (forward %.3f, backward %.3f; GEMMs %.3f, loss "
      "%.3f), %.1f GFLOP/s\n",
      seconds, s.forward_seconds, s.backward_seconds, s.gemm_seconds,
      s.loss_seconds, seconds > 0 ? s.gemm_flops / seconds / 1e9 : 0);
  out << absl::StrFormat("  peak memory  %.1f MiB (tracking allocator)\n",
                         s.peak_bytes / 1048576.0);
  out << "  GEMMs on     " << s.gemm_library;
  if (s.prepare_seconds > 0) {
    out << absl::StrFormat(" (%.3f s)", s.prepare_seconds);
  }
  out << "\n";
  if (s.segment_recomputes > 0) {
    out << absl::StrFormat("  recomputed   %d segment(s)\n",
                           s.segment_recomputes);
  }
}

// Stages every output of the run in `files` and the removal of a previous
// run's grad_lm_head.npy that this run does not write.
absl::Status StageOutputs(const HeadJobResult& job, int64_t batch_size,
                          const std::string& dir, OutputFileSet& files) {
  google::protobuf::util::JsonPrintOptions json;
  json.add_whitespace = true;
  json.always_print_primitive_fields = true;
  json.preserve_proto_field_names = true;
  std::string text;
  if (auto ok =
          google::protobuf::util::MessageToJsonString(job.metrics, &text, json);
      !ok.ok()) {
    return absl::InternalError(std::string(ok.message()));
  }
  DFLASH_RETURN_IF_ERROR(files.Stage(JoinPath(dir, kMetricsFile), text));
  const v1::ObjectiveConfig& c = job.config;
  const int64_t n = c.layout().num_anchors(), k = c.layout().block_size();
  const int64_t h = c.head().hidden_size(), v = c.head().vocab_size();
  if (absl::Status ok =
          StageNpy(files, JoinPath(dir, kGradHiddenFile), TypeOf(job.grad_hidden),
                   {batch_size, n, k, h}, Data(job.grad_hidden));
      !ok.ok()) {
    return ok;
  }
  const int64_t r = c.head().correction_rank();
  const struct {
    const char* file;
    const JobTensor& values;
    std::vector<int64_t> shape;
  } optional[] = {
      {kGradWeightFile, job.grad_weight, {v, h}},
      {kGradCorrectionInputsFile, job.grad_correction_inputs,
       {batch_size, n, k, r}},
      {kGradCorrectionWeightFile, job.grad_correction_weight, {v, r}},
  };
  for (const auto& [file, values, shape] : optional) {
    if (Empty(values)) {
      files.StageRemoval(JoinPath(dir, file));
      continue;
    }
    DFLASH_RETURN_IF_ERROR(
        StageNpy(files, JoinPath(dir, file), TypeOf(values), shape, Data(values)));
  }
  return absl::OkStatus();
}

double MaxDifference(const JobTensor& a, const JobTensor& b) {
  return std::visit(
      [&](const auto& x) {
        using V = std::decay_t<decltype(x)>;
        const V& y = std::get<V>(b);
        double most = 0;
        for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
          most = std::max(most, std::abs(static_cast<double>(x[i]) - y[i]));
        }
        return most;
      },
      a);
}

constexpr const char* kModes[] = {"materialize", "save", "checkpoint",
                                  "selective", "fused"};

// The configs --compare_modes runs: the job's in each mode.
absl::StatusOr<std::vector<v1::ObjectiveConfig>> ModeConfigs(
    const v1::ObjectiveConfig& config) {
  std::vector<v1::ObjectiveConfig> configs;
  for (const char* mode : kModes) {
    v1::ObjectiveConfig mode_config = config;
    if (std::string(mode) == "checkpoint") mode_config.clear_checkpoint();
    DFLASH_RETURN_IF_ERROR(SetModeByName("--mode", mode, mode_config));
    configs.push_back(ResolveDefaults(std::move(mode_config)));
  }
  return configs;
}

// Whether the whole report reached `report`; errno, cleared before the
// report was written, holds the reason of a failed write.
absl::Status CheckStream(std::ostream& report) {
  report.flush();
  if (report) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat(
      "cannot write standard output",
      errno != 0 ? absl::StrCat(": ", std::strerror(errno)) : std::string()));
}


template <typename T>
absl::StatusOr<HeadJobResult> RunJob(
    const HeadJobOptions& options, const v1::ObjectiveConfig& config,
    std::ostream& report, std::function<void(int64_t, int64_t)> progress) {
  // The job's own resident memory is measured from here (the libraries
  // already loaded are the process's, not the job's).
  ResetResidentPeak();
  const std::optional<ResidentMemory> at_start = ProcessResidentMemory();
  // Sizes first: the batch and the gradients the run holds, checked against
  // the memory available before anything is allocated.
  const std::optional<MemoryBudget> budget = JobMemoryBudget(options.memory_limit);
  int64_t b, s, n = config.layout().num_anchors(), transient = 0;
  InputHeaders headers;
  if (options.inputs_dir.empty()) {
    b = options.batch.value_or(kDefaultSyntheticShape.batch);
    s = options.seq.value_or(kDefaultSyntheticShape.seq_len);
  } else {
    DFLASH_ASSIGN_OR_RETURN(InputHeaders read,
                            ReadInputHeaders(options.inputs_dir, config));
    headers = std::move(read);
    b = headers.batch;
    s = headers.seq;
    transient = headers.largest_file_bytes;
  }
  const int64_t sets = options.compare_modes ? 3 : 1;
  DFLASH_ASSIGN_OR_RETURN(auto host,
                          HostBytes(config, b, s, n, transient, sets));
  JobBytes bytes;
  std::tie(bytes.batch, bytes.gradients) = host;
  DFLASH_ASSIGN_OR_RETURN(bytes.layout, PredictProjectionBytes(config));
  DFLASH_ASSIGN_OR_RETURN(const int threads,
                          ResolveThreads(config.head().threads(),
                                         "head.threads"));
  bytes.runtime = RuntimeBytes(threads);
  DFLASH_RETURN_IF_ERROR(CheckFits(budget, bytes));

  const uint64_t seed = options.seed.value_or(kDefaultSeed);
  DFLASH_ASSIGN_OR_RETURN(
      HeadBatch<T> batch,
      options.inputs_dir.empty()
          ? MakeSyntheticBatch<T>(config, {b, s, n}, seed)
          : LoadInputsFrom<T>(options.inputs_dir, headers, config));

  // The head's buffers, from its plan, in every mode the job runs.
  std::vector<v1::ObjectiveConfig> mode_configs;
  if (options.compare_modes) {
    DFLASH_ASSIGN_OR_RETURN(std::vector<v1::ObjectiveConfig> configs,
                            ModeConfigs(config));
    mode_configs = std::move(configs);
  }
  mode_configs.push_back(config);
  for (const v1::ObjectiveConfig& c : mode_configs) {
    DFLASH_ASSIGN_OR_RETURN(
        int64_t peak,
        PredictPeakBytes(c, batch.rows, BytesPerLogit(config.head().dtype())));
    bytes.head = std::max(bytes.head.value_or(0), peak);
  }
  DFLASH_RETURN_IF_ERROR(CheckFits(budget, bytes));
  mode_configs.pop_back();
  // The head's allocator refuses what the prediction missed, rather than
  // the system failing later.
  const int64_t head_limit =
      budget ? std::max<int64_t>(budget->bytes - bytes.batch -
                                     bytes.gradients - bytes.layout -
                                     bytes.runtime,
                                 0)
             : std::numeric_limits<int64_t>::max();

  const std::string source =
      options.inputs_dir.empty()
          ? absl::StrCat("synthetic batch (seed ", seed, ")")
          : absl::StrCat("inputs from ", options.inputs_dir);
  DFLASH_ASSIGN_OR_RETURN(HeadJobResult job,
                          RunOnce<T>(config, batch, head_limit, progress));
  job.predicted_bytes = *bytes.Total();
  if (config.head().threads() > job.result.stats.threads) {
    job.notes.push_back(absl::StrCat(
        "head.threads is ", config.head().threads(), ", more than the ",
        UsableCpus(), " CPU(s) this process may use: ran on ",
        job.result.stats.threads));
  }
  if (job.result.stats.projected_rows == 0) {
    job.notes.push_back(
        "no row of the batch carries weight (every position is unsupervised, "
        "dropped or ignored): loss and accuracy are 0, gradients are 0");
  }
  errno = 0;
  PrintReport(job, source, report);
  if (options.compare_modes) {
    v1::ObjectiveConfig fused_config = config;
    fused_config.mutable_head()->set_mode(v1::HeadConfig::FUSED);
    DFLASH_ASSIGN_OR_RETURN(
        HeadJobResult fused,
        RunOnce<T>(fused_config, batch, head_limit, nullptr));
    report << "\n  mode          seconds   GEMMs   peak MiB   max |grad - "
              "fused|\n";
    for (size_t i = 0; i < mode_configs.size(); ++i) {
      DFLASH_ASSIGN_OR_RETURN(
          HeadJobResult run,
          RunOnce<T>(mode_configs[i], batch, head_limit, nullptr));
      report << absl::StrFormat(
          "  %-12s %8.3f %7.3g %10.1f   %.3g\n", kModes[i],
          run.metrics.seconds(), run.metrics.gemms(),
          run.metrics.peak_bytes() / 1048576.0,
          MaxDifference(run.grad_hidden, fused.grad_hidden));
    }
  }
  job.metrics.set_predicted_bytes(job.predicted_bytes);
  if (const std::optional<ResidentMemory> now = ProcessResidentMemory();
      now && at_start) {
    job.metrics.set_resident_peak_bytes(now->peak_bytes -
                                        at_start->current_bytes);
  }
  // The outputs never depend on standard output (a closed pipe, a full
  // disk): they are written first, and a report that failed is said after.
  const absl::Status reported = CheckStream(report);
  if (!options.out_dir.empty()) {
    OutputFileSet files;
    DFLASH_RETURN_IF_ERROR(StageOutputs(job, b, options.out_dir, files));
    DFLASH_RETURN_IF_ERROR(files.Commit());
    if (!reported.ok()) {
      return absl::Status(reported.code(),
                          absl::StrCat(reported.message(), " (the outputs in ",
                                       options.out_dir, " were written)"));
    }
    report << "  wrote        " << JoinPath(options.out_dir, kMetricsFile) << ", "
           << kGradHiddenFile
           << (Empty(job.grad_weight) ? ""
                                      : absl::StrCat(", ", kGradWeightFile))
           << (Empty(job.grad_correction_inputs)
                   ? ""
                   : absl::StrCat(", ", kGradCorrectionInputsFile, ", ",
                                  kGradCorrectionWeightFile))
           << "\n";
  }
  DFLASH_RETURN_IF_ERROR(reported);
  return job;
}

}  // namespace

absl::StatusOr<v1::ObjectiveConfig> DefaultObjectiveConfig() {
  return LoadObjectiveConfigFromString(DefaultObjectiveConfigText(),
                                       kDefaultConfigSource);
}

namespace {

// The --config file, or the built-in default, as written.
absl::StatusOr<v1::ObjectiveConfig> ParseJobConfig(
    const HeadJobOptions& options) {
  if (options.config_path.empty()) {
    return ParseObjectiveConfig(DefaultObjectiveConfigText(),
                                kDefaultConfigSource);
  }
  return ParseObjectiveConfigFile(options.config_path, "--config: ");
}

// The synthetic batch's shapes in `config`. Anchor blocks: --anchors, else
// the config's own layout.num_anchors, else the default; refused when the
// sequence cannot hold that many (SampleAnchors would make fewer, and the
// gradient's shape would disagree with the layout after the whole run).
absl::Status SetSyntheticShapes(const HeadJobOptions& options,
                                v1::ObjectiveConfig& config) {
  v1::BatchLayout& layout = *config.mutable_layout();
  if (options.block) layout.set_block_size(*options.block);
  if (options.hidden) config.mutable_head()->set_hidden_size(*options.hidden);
  if (options.vocab) config.mutable_head()->set_vocab_size(*options.vocab);
  const int64_t seq = options.seq.value_or(kDefaultSyntheticShape.seq_len);
  if (seq < 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--seq: a synthetic sequence needs at least 2 tokens, got ", seq));
  }
  const int64_t most = SyntheticAnchorCapacity(seq);
  std::string from = "--anchors";
  if (options.anchors) {
    layout.set_num_anchors(*options.anchors);
  } else if (!layout.has_num_anchors() || options.config_path.empty()) {
    // Nobody asked for a number: the default, or what a short sequence
    // holds.
    layout.set_num_anchors(
        std::min(kDefaultSyntheticShape.num_anchors, std::max<int64_t>(most, 1)));
    from = "--anchors (default)";
  } else {
    from = absl::StrCat("layout.num_anchors (", options.config_path, ")");
  }
  const int64_t anchors = layout.num_anchors();
  if (anchors <= most) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      from, ": ", anchors, " anchor blocks do not fit a synthetic sequence of ",
      seq, " tokens (--seq", options.seq ? "" : ", the default",
      "): it holds at most ", most,
      " (an anchor needs two consecutive supervised tokens, and every 7th "
      "token is unsupervised); ask for fewer anchor blocks or more tokens"));
}

// The shapes of the --inputs files in `config`. A --config that sets
// layout.num_anchors or layout.block_size must agree with the files (the
// built-in config's layout is the synthetic batch's, and yields to them).
absl::Status SetFileShapes(const HeadJobOptions& options,
                           v1::ObjectiveConfig& config) {
  DFLASH_ASSIGN_OR_RETURN(InputHeaders in,
                          ReadInputHeaders(options.inputs_dir, config));
  v1::BatchLayout& layout = *config.mutable_layout();
  const struct {
    const char* field;
    bool set;
    int64_t value, files;
    const char* axis;
  } fields[] = {
      {"layout.num_anchors", layout.has_num_anchors(), layout.num_anchors(),
       in.anchors, "N"},
      {"layout.block_size", layout.has_block_size(), layout.block_size(),
       in.block, "K"},
  };
  for (const auto& f : fields) {
    if (options.config_path.empty() || !f.set || f.value == f.files) continue;
    return absl::InvalidArgumentError(absl::StrCat(
        f.field, ": ", options.config_path, " sets ", f.value, ", but ",
        JoinPath(options.inputs_dir, "hidden.npy"), " [B, N, K, H] = [",
        absl::StrJoin(in.headers.at("hidden.npy").shape, ", "), "] has ",
        f.axis, " = ", f.files,
        "; remove the field from the config or make them agree"));
  }
  layout.set_block_size(in.block);
  layout.set_num_anchors(in.anchors);
  config.mutable_head()->set_hidden_size(in.hidden);
  config.mutable_head()->set_vocab_size(in.vocab);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<v1::ObjectiveConfig> JobConfig(const HeadJobOptions& options) {
  DFLASH_RETURN_IF_ERROR(CheckSyntheticFlags(options));
  DFLASH_ASSIGN_OR_RETURN(v1::ObjectiveConfig config, ParseJobConfig(options));
  // What check_config refuses, refused before flags or files replace it.
  DFLASH_RETURN_IF_ERROR(ValidateConfigAsWritten(config));
  DFLASH_RETURN_IF_ERROR(
      ApplyOverrides(options.overrides, OverrideNames::kFlags, config));
  // The shapes the run will use, before the one validation.
  DFLASH_RETURN_IF_ERROR(options.inputs_dir.empty()
                             ? SetSyntheticShapes(options, config)
                             : SetFileShapes(options, config));
  config = ResolveDefaults(std::move(config));
  DFLASH_RETURN_IF_ERROR(ValidateObjectiveConfig(config));
  if (config.head().backend() != v1::HeadConfig::CPU) {
    return absl::InvalidArgumentError(absl::StrCat(
        "head.backend: dflash_head runs the CPU backend; CUDA heads run from "
        "C++ (RunCudaHead) or Python, got ",
        v1::HeadConfig::Backend_Name(config.head().backend())));
  }
  return config;
}

absl::StatusOr<HeadJobResult> RunHeadJob(
    const HeadJobOptions& options, std::ostream& report,
    std::function<void(int64_t, int64_t)> progress) {
  // --out is made and proven writable before any work.
  if (!options.out_dir.empty()) {
    if (absl::Status ok = PrepareOutputDirectory(options.out_dir); !ok.ok()) {
      return absl::Status(ok.code(), absl::StrCat("--out: ", ok.message()));
    }
  }
  DFLASH_ASSIGN_OR_RETURN(v1::ObjectiveConfig config, JobConfig(options));
  if (config.head().dtype() == v1::HeadConfig::FLOAT64) {
    return RunJob<double>(options, config, report, std::move(progress));
  }
  return RunJob<float>(options, config, report, std::move(progress));
}

}  // namespace dflash
