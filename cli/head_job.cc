#include "cli/head_job.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/tracking_allocator.h"
#include "google/protobuf/util/json_util.h"
#include "heads/projection.h"
#include "io/npy.h"
#include "proto/config.h"

namespace dflash {
namespace {

constexpr char kDefaultConfig[] =
#include "cli/default_config.inc"
    ;

std::string Join(const std::string& dir, const std::string& name) {
  return dir.empty() || dir.back() == '/' ? dir + name : dir + "/" + name;
}

absl::Status SetLoss(const std::string& name, v1::LossConfig& loss) {
  const v1::CrossEntropyOptions ce = loss.cross_entropy();
  v1::LossConfig fresh;
  if (name == "dflash") {
    fresh.mutable_dflash();
  } else if (name == "dpace") {
    fresh.mutable_dpace()->set_variant(v1::DPaceLoss::DPACE);
  } else if (name == "dpace-cumulative-confidence-only") {
    fresh.mutable_dpace()->set_variant(
        v1::DPaceLoss::CUMULATIVE_CONFIDENCE_ONLY);
  } else if (name == "dpace-continuation-value-only") {
    fresh.mutable_dpace()->set_variant(v1::DPaceLoss::CONTINUATION_VALUE_ONLY);
  } else if (name == "tv") {
    fresh.mutable_tv();
  } else if (name == "lk-lambda") {
    fresh.mutable_lk_lambda();
  } else if (name == "dspark") {
    fresh.mutable_dspark();
  } else if (name == "kl") {
    fresh.mutable_distillation()->set_divergence(v1::DistillationLoss::FORWARD_KL);
  } else if (name == "reverse-kl") {
    fresh.mutable_distillation()->set_divergence(v1::DistillationLoss::REVERSE_KL);
  } else if (name == "jsd") {
    fresh.mutable_distillation()->set_divergence(v1::DistillationLoss::JSD);
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "--loss: must be one of dflash, dpace, "
        "dpace-cumulative-confidence-only, dpace-continuation-value-only, tv, "
        "lk-lambda, dspark, kl, reverse-kl, jsd, got '",
        name, "'"));
  }
  *fresh.mutable_cross_entropy() = ce;
  loss = fresh;
  return absl::OkStatus();
}

absl::Status SetGamma(double gamma, v1::LossConfig& loss) {
  switch (loss.family_case()) {
    case v1::LossConfig::kDflash:
      loss.mutable_dflash()->set_gamma(gamma);
      break;
    case v1::LossConfig::kTv:
      loss.mutable_tv()->set_gamma(gamma);
      break;
    case v1::LossConfig::kLkLambda:
      loss.mutable_lk_lambda()->set_gamma(gamma);
      break;
    case v1::LossConfig::kDspark:
      loss.mutable_dspark()->set_gamma(gamma);
      break;
    case v1::LossConfig::kDistillation:
      loss.mutable_distillation()->set_gamma(gamma);
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("--gamma: D-PACE has no decay, got ", gamma));
  }
  return absl::OkStatus();
}

// A mode and, for selective, the frozen-projection preset when the config
// names no policy of its own.
absl::Status SetMode(const std::string& name, v1::ObjectiveConfig& config) {
  v1::HeadConfig::ExecutionMode mode;
  if (name == "materialize") {
    mode = v1::HeadConfig::MATERIALIZE;
  } else if (name == "save") {
    mode = v1::HeadConfig::SAVE_CHUNKS;
  } else if (name == "checkpoint") {
    mode = v1::HeadConfig::CHECKPOINT;
  } else if (name == "selective") {
    mode = v1::HeadConfig::SELECTIVE;
  } else if (name == "fused") {
    mode = v1::HeadConfig::FUSED;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "--mode: must be one of materialize, save, checkpoint, selective, "
        "fused, got '",
        name, "'"));
  }
  config.mutable_head()->set_mode(mode);
  v1::CheckpointPolicy& policy = *config.mutable_checkpoint();
  if (mode == v1::HeadConfig::SELECTIVE && !policy.has_preset() &&
      policy.rules_size() == 0) {
    policy.set_preset(v1::CheckpointPolicy::SELECTIVE_FROZEN_PROJECTION);
  }
  return absl::OkStatus();
}

std::string LossFamily(const v1::LossConfig& loss) {
  switch (loss.family_case()) {
    case v1::LossConfig::kDflash:
      return "dflash";
    case v1::LossConfig::kDpace:
      return "dpace";
    case v1::LossConfig::kTv:
      return "tv";
    case v1::LossConfig::kLkLambda:
      return "lk_lambda";
    case v1::LossConfig::kDspark:
      return "dspark";
    case v1::LossConfig::kDistillation:
      return absl::StrCat("distillation/",
                          v1::DistillationLoss::Divergence_Name(
                              loss.distillation().divergence()));
    default:
      return "none";
  }
}

absl::StatusOr<NpyArray> ReadChecked(const std::string& dir,
                                     const std::string& name,
                                     std::vector<int64_t> shape,
                                     std::vector<NpyType> types) {
  absl::StatusOr<NpyArray> array = ReadNpy(Join(dir, name));
  if (!array.ok()) return array.status();
  if (absl::Status ok = CheckNpy(*array, Join(dir, name), shape, types);
      !ok.ok()) {
    return ok;
  }
  return array;
}

const std::vector<NpyType> kFloats = {NpyType::kFloat32, NpyType::kFloat64};
const std::vector<NpyType> kInts = {NpyType::kInt32, NpyType::kInt64};
const std::vector<NpyType> kFlags = {NpyType::kBool, NpyType::kUint8,
                                     NpyType::kInt32, NpyType::kInt64};

}  // namespace

v1::HeadMetrics HeadMetricsOf(const v1::ObjectiveConfig& config,
                              const HeadResult& r) {
  v1::HeadMetrics m;
  m.set_mode(v1::HeadConfig::ExecutionMode_Name(r.mode));
  m.set_loss_family(LossFamily(config.loss()));
  m.set_loss(r.loss);
  m.set_loss_num(r.terms.loss_num);
  m.set_loss_den(r.terms.loss_den);
  m.set_accuracy(r.accuracy);
  for (double a : r.accuracy_per_position) m.add_accuracy_per_position(a);
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
  m.set_segment_recomputes(r.stats.segment_recomputes);
  return m;
}

namespace {

absl::StatusOr<HeadJobResult> RunOnce(
    const v1::ObjectiveConfig& config, const HeadBatch<float>& batch,
    std::function<void(int64_t, int64_t)> progress) {
  HeadJobResult job;
  job.config = config;
  const int64_t rows = static_cast<int64_t>(batch.rows.size());
  const int64_t hidden = config.head().hidden_size();
  job.grad_hidden.assign(rows * hidden, 0);
  if (config.head().trainable()) {
    job.grad_weight.assign(config.head().vocab_size() * hidden, 0);
  }
  std::vector<float> grad_bias(
      config.head().trainable() && config.head().bias()
          ? config.head().vocab_size()
          : 0);
  std::vector<float> grad_confidence(rows);
  const bool confidence = config.loss().has_dspark() &&
                          config.loss().dspark().confidence_weight() > 0;
  HeadGradients<float> gradients{
      absl::MakeSpan(job.grad_hidden), absl::MakeSpan(job.grad_weight),
      absl::MakeSpan(grad_bias),
      confidence ? absl::MakeSpan(grad_confidence) : absl::Span<float>()};
  TrackingAllocator allocator;
  HeadOptions options;
  options.progress = std::move(progress);
  absl::StatusOr<HeadResult> result = RunHead<float>(
      config, batch.Inputs(config), gradients, allocator, {}, options);
  if (!result.ok()) return result.status();
  job.result = *std::move(result);
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
  out << absl::StrFormat(
      "dflash_head: %s head, %s loss, %s\n",
      v1::HeadConfig::ExecutionMode_Name(r.mode), job.metrics.loss_family(),
      source);
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
  out << absl::StrFormat("  accuracy     %.4f; per position: %s\n", r.accuracy,
                         absl::StrJoin(per_k, "  "));
  out << absl::StrFormat("  GEMMs        %.3g passes (%d calls), %.3f TFLOP\n",
                         s.gemm_passes, s.gemm_calls, s.gemm_flops / 1e12);
  out << absl::StrFormat(
      "  time         %.3f s (forward %.3f, backward %.3f; GEMMs %.3f, loss "
      "%.3f), %.1f GFLOP/s\n",
      seconds, s.forward_seconds, s.backward_seconds, s.gemm_seconds,
      s.loss_seconds, seconds > 0 ? s.gemm_flops / seconds / 1e9 : 0);
  out << absl::StrFormat("  peak memory  %.1f MiB (tracking allocator)\n",
                         s.peak_bytes / 1048576.0);
  out << "  BLAS         " << CpuBlasName() << "\n";
  if (s.segment_recomputes > 0) {
    out << absl::StrFormat("  recomputed   %d segment(s)\n",
                           s.segment_recomputes);
  }
}

absl::Status WriteOutputs(const HeadJobResult& job, const HeadBatch<float>& b,
                          const std::string& dir) {
  google::protobuf::util::JsonPrintOptions json;
  json.add_whitespace = true;
  json.always_print_primitive_fields = true;
  json.preserve_proto_field_names = true;
  std::string text;
  if (auto ok = google::protobuf::util::MessageToJsonString(job.metrics, &text,
                                                            json);
      !ok.ok()) {
    return absl::InternalError(std::string(ok.message()));
  }
  const std::string path = Join(dir, "metrics.json");
  FILE* file = std::fopen(path.c_str(), "w");
  if (file == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--out: cannot write ", path, " (does the directory exist?)"));
  }
  std::fputs(text.c_str(), file);
  std::fclose(file);
  const v1::ObjectiveConfig& c = job.config;
  const int64_t k_size = c.layout().block_size();
  const int64_t blocks = static_cast<int64_t>(b.rows.size()) / k_size;
  const int64_t n = b.anchors.num_anchors;
  if (absl::Status ok = WriteNpy(
          Join(dir, "grad_hidden.npy"),
          MakeNpy<float>(job.grad_hidden, {blocks / n, n, k_size,
                                           c.head().hidden_size()}));
      !ok.ok()) {
    return ok;
  }
  if (!job.grad_weight.empty()) {
    return WriteNpy(Join(dir, "grad_lm_head.npy"),
                    MakeNpy<float>(job.grad_weight, {c.head().vocab_size(),
                                                     c.head().hidden_size()}));
  }
  return absl::OkStatus();
}

double MaxDifference(const std::vector<float>& a, const std::vector<float>& b) {
  double most = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    most = std::max(most, static_cast<double>(std::abs(a[i] - b[i])));
  }
  return most;
}

}  // namespace

absl::StatusOr<v1::ObjectiveConfig> DefaultObjectiveConfig() {
  return LoadObjectiveConfigFromString(kDefaultConfig,
                                       "configs/dflash_default.textproto");
}

absl::StatusOr<v1::ObjectiveConfig> JobConfig(const HeadJobOptions& options) {
  absl::StatusOr<v1::ObjectiveConfig> loaded =
      options.config_path.empty()
          ? DefaultObjectiveConfig()
          : LoadObjectiveConfigFromFile(options.config_path);
  if (!loaded.ok()) return loaded.status();
  v1::ObjectiveConfig config = *std::move(loaded);
  if (!options.loss.empty()) {
    if (absl::Status ok = SetLoss(options.loss, *config.mutable_loss());
        !ok.ok()) {
      return ok;
    }
  }
  if (options.gamma.has_value()) {
    if (absl::Status ok = SetGamma(*options.gamma, *config.mutable_loss());
        !ok.ok()) {
      return ok;
    }
  }
  if (!options.mode.empty()) {
    if (absl::Status ok = SetMode(options.mode, config); !ok.ok()) return ok;
  }
  if (options.chunk_blocks != 0) {
    config.mutable_chunking()->set_blocks_per_chunk(options.chunk_blocks);
  }
  if (options.threads.has_value()) {
    config.mutable_head()->set_threads(*options.threads);
  }
  if (options.block != 0) config.mutable_layout()->set_block_size(options.block);
  if (options.hidden != 0) {
    config.mutable_head()->set_hidden_size(options.hidden);
  }
  if (options.vocab != 0) config.mutable_head()->set_vocab_size(options.vocab);
  config.mutable_layout()->set_num_anchors(options.shape.num_anchors);
  config = ResolveDefaults(std::move(config));
  if (absl::Status ok = ValidateObjectiveConfig(config); !ok.ok()) return ok;
  return config;
}

absl::StatusOr<HeadBatch<float>> LoadInputs(const std::string& dir,
                                            v1::ObjectiveConfig& config) {
  absl::StatusOr<NpyArray> hidden =
      ReadChecked(dir, "hidden.npy", {-1, -1, -1, -1}, kFloats);
  if (!hidden.ok()) return hidden.status();
  const int64_t b = hidden->shape[0], n = hidden->shape[1],
                k = hidden->shape[2], h = hidden->shape[3];
  absl::StatusOr<NpyArray> weight =
      ReadChecked(dir, "lm_head.npy", {-1, h}, kFloats);
  if (!weight.ok()) return weight.status();
  const int64_t v = weight->shape[0];
  absl::StatusOr<NpyArray> ids = ReadChecked(dir, "input_ids.npy", {b, -1}, kInts);
  if (!ids.ok()) return ids.status();
  const int64_t s = ids->shape[1];
  absl::StatusOr<NpyArray> mask =
      ReadChecked(dir, "loss_mask.npy", {b, s}, kFlags);
  absl::StatusOr<NpyArray> anchors =
      ReadChecked(dir, "anchors.npy", {b, n}, kInts);
  absl::StatusOr<NpyArray> keep = ReadChecked(dir, "keep.npy", {b, n}, kFlags);
  for (const auto* array : {&mask, &anchors, &keep}) {
    if (!array->ok()) return array->status();
  }
  config.mutable_layout()->set_block_size(k);
  config.mutable_layout()->set_num_anchors(n);
  config.mutable_head()->set_hidden_size(h);
  config.mutable_head()->set_vocab_size(v);
  if (absl::Status ok = ValidateObjectiveConfig(config); !ok.ok()) return ok;

  HeadBatch<float> batch;
  batch.input_ids = NpyToInt64(*ids);
  for (int64_t x : NpyToInt64(*mask)) batch.loss_mask.push_back(x != 0);
  batch.anchors.num_anchors = n;
  batch.anchors.positions = NpyToInt64(*anchors);
  for (int64_t x : NpyToInt64(*keep)) batch.anchors.keep.push_back(x != 0);
  absl::StatusOr<std::vector<RowMeta>> rows = LabelRows(
      {b, s, batch.input_ids, batch.loss_mask}, batch.anchors.positions,
      batch.anchors.keep, n, k, v,
      config.loss().has_dspark() ? Labeling::kDSpark : Labeling::kDFlash);
  if (!rows.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(dir, ": ", rows.status().message()));
  }
  batch.rows = *std::move(rows);
  batch.hidden = NpyToFloat(*hidden);
  batch.weight = NpyToFloat(*weight);
  if (LossNeedsTeacher(config.loss())) {
    absl::StatusOr<NpyArray> teacher =
        ReadChecked(dir, "teacher_hidden.npy", {b, n, k, h}, kFloats);
    if (!teacher.ok()) return teacher.status();
    batch.teacher_hidden = NpyToFloat(*teacher);
  }
  if (config.loss().has_dspark() &&
      config.loss().dspark().confidence_weight() > 0) {
    absl::StatusOr<NpyArray> confidence =
        ReadChecked(dir, "confidence_logits.npy", {b, n, k}, kFloats);
    if (!confidence.ok()) return confidence.status();
    batch.confidence_logits = NpyToFloat(*confidence);
  }
  return batch;
}

absl::Status SaveInputs(const HeadBatch<float>& batch,
                        const v1::ObjectiveConfig& config, int64_t batch_size,
                        int64_t seq_len, const std::string& dir) {
  const int64_t n = batch.anchors.num_anchors, k = config.layout().block_size();
  const int64_t h = config.head().hidden_size(), v = config.head().vocab_size();
  const std::vector<std::pair<std::string, NpyArray>> files = {
      {"hidden.npy", MakeNpy<float>(batch.hidden, {batch_size, n, k, h})},
      {"lm_head.npy", MakeNpy<float>(batch.weight, {v, h})},
      {"input_ids.npy", MakeNpy<int64_t>(batch.input_ids, {batch_size, seq_len})},
      {"loss_mask.npy", MakeNpy<uint8_t>(batch.loss_mask, {batch_size, seq_len})},
      {"anchors.npy", MakeNpy<int64_t>(batch.anchors.positions, {batch_size, n})},
      {"keep.npy", MakeNpy<uint8_t>(batch.anchors.keep, {batch_size, n})},
      {"teacher_hidden.npy",
       MakeNpy<float>(batch.teacher_hidden, {batch_size, n, k, h})},
      {"confidence_logits.npy",
       MakeNpy<float>(batch.confidence_logits, {batch_size, n, k})},
  };
  for (const auto& [name, array] : files) {
    if (array.data.empty() && name != "hidden.npy") continue;
    if (absl::Status ok = WriteNpy(Join(dir, name), array); !ok.ok()) return ok;
  }
  return absl::OkStatus();
}

absl::StatusOr<HeadJobResult> RunHeadJob(
    const HeadJobOptions& options, std::ostream& report,
    std::function<void(int64_t, int64_t)> progress) {
  absl::StatusOr<v1::ObjectiveConfig> config = JobConfig(options);
  if (!config.ok()) return config.status();
  absl::StatusOr<HeadBatch<float>> batch =
      options.inputs_dir.empty()
          ? MakeSyntheticBatch<float>(*config, options.shape, options.seed)
          : LoadInputs(options.inputs_dir, *config);
  if (!batch.ok()) return batch.status();
  const std::string source =
      options.inputs_dir.empty()
          ? absl::StrCat("synthetic batch (seed ", options.seed, ")")
          : absl::StrCat("inputs from ", options.inputs_dir);
  absl::StatusOr<HeadJobResult> job = RunOnce(*config, *batch, progress);
  if (!job.ok()) return job.status();
  PrintReport(*job, source, report);
  if (!options.out_dir.empty()) {
    if (absl::Status ok = WriteOutputs(*job, *batch, options.out_dir);
        !ok.ok()) {
      return ok;
    }
    report << "  wrote        " << Join(options.out_dir, "metrics.json")
           << ", grad_hidden.npy"
           << (job->grad_weight.empty() ? "" : ", grad_lm_head.npy") << "\n";
  }
  if (options.compare_modes) {
    v1::ObjectiveConfig fused_config = *config;
    fused_config.mutable_head()->set_mode(v1::HeadConfig::FUSED);
    absl::StatusOr<HeadJobResult> fused = RunOnce(fused_config, *batch, nullptr);
    if (!fused.ok()) return fused.status();
    report << "\n  mode          seconds   GEMMs   peak MiB   max |grad - "
              "fused|\n";
    for (const char* mode :
         {"materialize", "save", "checkpoint", "selective", "fused"}) {
      v1::ObjectiveConfig mode_config = *config;
      if (std::string(mode) == "checkpoint") mode_config.clear_checkpoint();
      if (absl::Status ok = SetMode(mode, mode_config); !ok.ok()) return ok;
      mode_config = ResolveDefaults(std::move(mode_config));
      absl::StatusOr<HeadJobResult> run = RunOnce(mode_config, *batch, nullptr);
      if (!run.ok()) return run.status();
      report << absl::StrFormat(
          "  %-12s %8.3f %7.3g %10.1f   %.3g\n", mode, run->metrics.seconds(),
          run->metrics.gemms(), run->metrics.peak_bytes() / 1048576.0,
          MaxDifference(run->grad_hidden, fused->grad_hidden));
    }
  }
  return job;
}

}  // namespace dflash
