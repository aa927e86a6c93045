#include "cli/head_job.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <map>
#include <tuple>
#include <type_traits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "base/checked_math.h"
#include "base/file.h"
#include "base/status_macros.h"
#include "base/system_memory.h"
#include "base/threads.h"
#include "base/tracking_allocator.h"
#include "configs/default_config.h"
#include "google/protobuf/util/json_util.h"
#include "heads/cpu_head.h"
#include "heads/cpu_projection.h"
#include "heads/head_metrics.h"
#include "heads/head_plan.h"
#include "io/npy.h"
#include "losses/loss_family.h"
#include "proto/config.h"

namespace dflash {
namespace {

std::string Join(const std::string& dir, const std::string& name) {
  return dir.empty() || dir.back() == '/' ? dir + name : dir + "/" + name;
}

const std::vector<NpyType> kFloats = {NpyType::kFloat32, NpyType::kFloat64};
const std::vector<NpyType> kInts = {NpyType::kInt32, NpyType::kInt64};
const std::vector<NpyType> kFlags = {NpyType::kBool, NpyType::kUint8,
                                     NpyType::kInt32, NpyType::kInt64};

// Outputs of ours in --out; a run removes those it does not write.
constexpr char kMetricsFile[] = "metrics.json";
constexpr char kGradHiddenFile[] = "grad_hidden.npy";
constexpr char kGradWeightFile[] = "grad_lm_head.npy";
constexpr char kGradCorrectionInputsFile[] = "grad_correction_inputs.npy";
constexpr char kGradCorrectionWeightFile[] = "grad_correction_weight.npy";

int64_t ElementBytes(const v1::ObjectiveConfig& config) {
  return config.head().dtype() == v1::HeadConfig::FLOAT64 ? 8 : 4;
}

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

// One .npy file of --inputs: its expected shape (-1: any extent) and types.
struct InputSpec {
  const char* name;
  std::vector<int64_t> shape;
  const std::vector<NpyType>* types;
  // How its indices read in messages.
  const char* axes;
};

// The files a config reads, their headers checked against each other.
struct InputHeaders {
  int64_t batch = 0, seq = 0, anchors = 0, block = 0, hidden = 0, vocab = 0;
  std::map<std::string, NpyHeader> headers;
  std::vector<InputSpec> specs;  // In reading order.
  int64_t largest_file_bytes = 0;
};

// An empty axis would reach the config as a zero layout.block_size or
// vocab_size: name it against the file instead.
absl::Status CheckNoEmptyAxis(const NpyHeader& header, const std::string& path,
                              const InputSpec& spec) {
  const std::vector<std::string> axes = absl::StrSplit(
      absl::StripSuffix(absl::StripPrefix(spec.axes, "("), ")"), ", ");
  for (size_t i = 0; i < header.shape.size() && i < axes.size(); ++i) {
    if (header.shape[i] != 0) continue;
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": axis ", axes[i], " of ", spec.axes, " has extent 0 (shape [",
        absl::StrJoin(header.shape, ", "), "]); every axis needs at least 1"));
  }
  return absl::OkStatus();
}

// Reads the headers of every file `config`'s objective needs; shapes are
// checked as each file's extents become known (hidden.npy gives B, N, K, H).
absl::StatusOr<InputHeaders> ReadInputHeaders(
    const std::string& dir, const v1::ObjectiveConfig& config) {
  InputHeaders in;
  auto read = [&](InputSpec spec) -> absl::StatusOr<const NpyHeader*> {
    const std::string path = Join(dir, spec.name);
    DFLASH_ASSIGN_OR_RETURN(NpyHeader header, ReadNpyHeader(path));
    DFLASH_RETURN_IF_ERROR(CheckNpy(header, path, spec.shape, *spec.types));
    DFLASH_RETURN_IF_ERROR(CheckNoEmptyAxis(header, path, spec));
    in.largest_file_bytes = std::max(in.largest_file_bytes, header.data_bytes);
    in.specs.push_back(spec);
    return &(in.headers[spec.name] = std::move(header));
  };
  DFLASH_ASSIGN_OR_RETURN(
      const NpyHeader* hidden,
      read({"hidden.npy", {-1, -1, -1, -1}, &kFloats, "(b, n, k, h)"}));
  in.batch = hidden->shape[0];
  in.anchors = hidden->shape[1];
  in.block = hidden->shape[2];
  in.hidden = hidden->shape[3];
  const int64_t b = in.batch, n = in.anchors, k = in.block, h = in.hidden;
  DFLASH_ASSIGN_OR_RETURN(const NpyHeader* weight,
                          read({"lm_head.npy", {-1, h}, &kFloats, "(v, h)"}));
  in.vocab = weight->shape[0];
  DFLASH_ASSIGN_OR_RETURN(const NpyHeader* ids,
                          read({"input_ids.npy", {b, -1}, &kInts, "(b, s)"}));
  in.seq = ids->shape[1];
  std::vector<InputSpec> rest = {
      {"loss_mask.npy", {b, in.seq}, &kFlags, "(b, s)"},
      {"anchors.npy", {b, n}, &kInts, "(b, n)"},
      {"keep.npy", {b, n}, &kFlags, "(b, n)"}};
  if (config.head().bias()) {
    rest.push_back({"lm_head_bias.npy", {in.vocab}, &kFloats, "(v)"});
  }
  if (ProjectsTeacher(config)) {
    rest.push_back(
        {"teacher_hidden.npy", {b, n, k, h}, &kFloats, "(b, n, k, h)"});
  }
  if (NeedsConfidence(config)) {
    rest.push_back({"confidence_logits.npy", {b, n, k}, &kFloats, "(b, n, k)"});
  }
  if (const int64_t r = config.head().correction_rank(); r > 0) {
    rest.push_back(
        {"correction_inputs.npy", {b, n, k, r}, &kFloats, "(b, n, k, r)"});
    rest.push_back({"correction_weight.npy", {in.vocab, r}, &kFloats, "(v, r)"});
  }
  for (const InputSpec& spec : rest) {
    if (absl::StatusOr<const NpyHeader*> ok = read(spec); !ok.ok()) {
      return ok.status();
    }
  }
  return in;
}

// A float tensor of --inputs in the head's type; non-finite values and,
// for float, float64 values beyond float32 are errors naming the element.
absl::StatusOr<NpyArray> ReadChecked(const std::string& dir,
                                     const InputSpec& spec) {
  const std::string path = Join(dir, spec.name);
  DFLASH_ASSIGN_OR_RETURN(NpyArray array, ReadNpy(path));
  DFLASH_RETURN_IF_ERROR(CheckNpy(array, path, spec.shape, *spec.types));
  return array;
}

template <typename T>
absl::StatusOr<std::vector<T>> ReadFloats(const std::string& dir,
                                          const InputSpec& spec,
                                          const v1::ObjectiveConfig& config) {
  const std::string path = Join(dir, spec.name);
  DFLASH_ASSIGN_OR_RETURN(NpyArray array, ReadChecked(dir, spec));
  auto where = [&](const NpyElement& e) {
    return absl::StrCat(spec.axes, " = (", absl::StrJoin(e.index, ", "), ")");
  };
  if (std::optional<NpyElement> bad = FirstNonFinite(array)) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": value ", bad->value, " at ", where(*bad),
                     " is not finite; inputs must be finite"));
  }
  if constexpr (std::is_same_v<T, float>) {
    if (std::optional<NpyElement> big = FirstFloat32Overflow(array)) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": value ", big->value, " at ", where(*big),
                       " overflows float32, the head's dtype (",
                       v1::HeadConfig::DType_Name(config.head().dtype()),
                       "); rescale it or use head.dtype FLOAT64"));
    }
    return NpyToFloat(array);
  } else {
    return NpyToFloat64(array);
  }
}

absl::StatusOr<std::vector<int64_t>> ReadInts(const std::string& dir,
                                              const InputSpec& spec) {
  DFLASH_ASSIGN_OR_RETURN(NpyArray array, ReadChecked(dir, spec));
  return NpyToInt64(array);
}

// A [rows, columns] mask of 0 and 1: any other value (a -1 padding
// sentinel, a 255) is an error naming its index, not read as 1.
absl::StatusOr<std::vector<uint8_t>> ReadMask(const std::string& dir,
                                              const InputSpec& spec) {
  DFLASH_ASSIGN_OR_RETURN(std::vector<int64_t> values, ReadInts(dir, spec));
  const int64_t columns = spec.shape[1];
  std::vector<uint8_t> mask(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    if (values[i] != 0 && values[i] != 1) {
      const int64_t at = static_cast<int64_t>(i);
      return absl::InvalidArgumentError(absl::StrCat(
          Join(dir, spec.name), ": value ", values[i], " at ", spec.axes,
          " = (", at / columns, ", ", at % columns,
          ") is not 0 or 1; a mask holds 0 (off) or 1 (on)"));
    }
    mask[i] = static_cast<uint8_t>(values[i]);
  }
  return mask;
}

const InputSpec* FindSpec(const InputHeaders& in, absl::string_view name) {
  for (const InputSpec& spec : in.specs) {
    if (spec.name == name) return &spec;
  }
  return nullptr;
}

// How much the job holds, and how much it may hold.
struct MemoryBudget {
  int64_t bytes = 0;
  std::string source;
};

std::optional<MemoryBudget> Budget(const HeadJobOptions& options) {
  if (options.memory_limit.has_value()) {
    return MemoryBudget{*options.memory_limit, "--memory_limit"};
  }
  if (std::optional<AvailableMemory> system = SystemAvailableMemory()) {
    return MemoryBudget{system->bytes, system->source};
  }
  return std::nullopt;
}

std::string Bytes(int64_t bytes) {
  if (bytes < 1024) return absl::StrCat(bytes, " B");
  if (bytes < (int64_t{1} << 20))
    return absl::StrFormat("%.1f KiB", bytes / 1024.0);
  if (bytes < (int64_t{1} << 30)) {
    return absl::StrFormat("%.1f MiB", bytes / 1048576.0);
  }
  return absl::StrFormat("%.1f GiB", bytes / 1073741824.0);
}

absl::Status TooBig(const std::string& what) {
  return absl::ResourceExhaustedError(absl::StrCat(
      what, "; use a smaller batch, sequence, hidden size or vocabulary"));
}

// The batch's host tensors and the gradients of `sets` runs held at once,
// overflow-checked: B sequences of S tokens, N anchors.
absl::StatusOr<std::pair<int64_t, int64_t>> HostBytes(
    const v1::ObjectiveConfig& config, int64_t b, int64_t s, int64_t n,
    int64_t transient, int64_t sets) {
  const int64_t k = config.layout().block_size(),
                h = config.head().hidden_size(), v = config.head().vocab_size(),
                e = ElementBytes(config);
  const bool teacher = ProjectsTeacher(config);
  const bool trainable = config.head().trainable();
  const std::optional<int64_t> rows = CheckedProduct({b, n, k});
  const std::optional<int64_t> tokens = CheckedMul(b, s);
  const std::optional<int64_t> blocks = CheckedMul(b, n);
  const std::optional<int64_t> row_values =
      rows ? CheckedMul(*rows, h) : std::nullopt;
  const std::optional<int64_t> weight = CheckedProduct({v, h, e});
  // A correction's z and M, and as much again for their gradients.
  const int64_t rank = config.head().correction_rank();
  const std::optional<int64_t> correction =
      rows ? CheckedProduct({*rows + v, rank, e}) : std::nullopt;
  if (!rows || !tokens || !blocks || !row_values || !weight || !correction) {
    return TooBig(absl::StrCat("the batch's sizes (", b, " x ", n, " x ", k,
                               " rows of ", h, ", ", b, " x ", s, " tokens, V ",
                               v, ") overflow 64 bits"));
  }
  const std::optional<int64_t> hidden = CheckedMul(*row_values, e);
  const std::optional<int64_t> tokens_bytes = CheckedMul(*tokens, 17);
  const std::optional<int64_t> rows_bytes =
      CheckedMul(*rows, static_cast<int64_t>(sizeof(RowMeta)) + 4);
  const std::optional<int64_t> batch =
      hidden && tokens_bytes && rows_bytes
          ? CheckedSum({*tokens_bytes, *blocks * 9, *rows_bytes, *hidden,
                        teacher ? *hidden : 0, *weight, v * e, *correction,
                        transient})
          : std::nullopt;
  const std::optional<int64_t> grads =
      hidden ? CheckedSum({*hidden, trainable ? *weight : 0,
                           trainable ? v * e : 0, *rows * 4, *correction})
             : std::nullopt;
  const std::optional<int64_t> all_grads =
      grads ? CheckedMul(*grads, sets) : std::nullopt;
  if (!batch || !all_grads) {
    return TooBig(absl::StrCat("the batch's bytes (", b, " x ", n, " x ", k,
                               " rows of ", h, ", V ", v,
                               ") overflow 64 bits"));
  }
  return std::make_pair(*batch, *all_grads);
}

// What a job holds at its peak, by part.
struct JobBytes {
  int64_t batch = 0, gradients = 0;
  // The head's workspaces (PredictPeakBytes), once the rows are known.
  std::optional<int64_t> head;
  int64_t layout = 0;  // The weight laid out for oneDNN, when it is.
  // What the libraries touch as they run: code pages, BLAS packing buffers,
  // thread stacks and per-thread heaps.
  int64_t runtime = 0;

  std::optional<int64_t> Total() const {
    return CheckedSum({batch, gradients, head.value_or(0), layout, runtime});
  }
};

// Measured at 3-24 MiB on two threads (OpenBLAS's packing buffers are most
// of it); //cli:memory_prediction_test checks the whole prediction against
// the peak resident memory.
int64_t RuntimeBytes(int threads) {
  return (int64_t{32} << 20) + threads * (int64_t{8} << 20);
}

absl::Status CheckFits(const std::optional<MemoryBudget>& budget,
                       const JobBytes& bytes) {
  const std::optional<int64_t> total = bytes.Total();
  if (budget && total && *total <= budget->bytes) return absl::OkStatus();
  if (!budget && total) return absl::OkStatus();
  const std::string needs =
      total ? absl::StrCat(*total, " bytes (", Bytes(*total), ")")
            : std::string("more than 2^63 bytes");
  return TooBig(absl::StrCat(
      "this run needs ", bytes.head ? "" : "at least ", needs, ": batch ",
      Bytes(bytes.batch),
      ", gradients ", Bytes(bytes.gradients), ", head buffers ",
      bytes.head ? Bytes(*bytes.head) : "not yet planned", ", weight layout ",
      Bytes(bytes.layout),
      ", libraries and threads ", Bytes(bytes.runtime), "; ",
      budget ? absl::StrCat(budget->bytes, " bytes (", Bytes(budget->bytes),
                            ") are available (", budget->source, ")")
             : std::string("")));
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
  std::vector<float> grad_confidence(confidence ? rows : 0);
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
  DFLASH_RETURN_IF_ERROR(files.Stage(Join(dir, kMetricsFile), text));
  const v1::ObjectiveConfig& c = job.config;
  const int64_t n = c.layout().num_anchors(), k = c.layout().block_size();
  const int64_t h = c.head().hidden_size(), v = c.head().vocab_size();
  if (absl::Status ok =
          StageNpy(files, Join(dir, kGradHiddenFile), TypeOf(job.grad_hidden),
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
      files.StageRemoval(Join(dir, file));
      continue;
    }
    DFLASH_RETURN_IF_ERROR(
        StageNpy(files, Join(dir, file), TypeOf(values), shape, Data(values)));
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

// The --inputs tensors, their headers already read and checked.
template <typename T>
absl::StatusOr<HeadBatch<T>> LoadInputsFrom(const std::string& dir,
                                            const InputHeaders& in,
                                            const v1::ObjectiveConfig& config);

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
  const std::optional<MemoryBudget> budget = Budget(options);
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
        int64_t peak, PredictPeakBytes(c, batch.rows, ElementBytes(config)));
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
    report << "  wrote        " << Join(options.out_dir, kMetricsFile) << ", "
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
  constexpr int64_t kMaxConfigBytes = int64_t{16} << 20;
  absl::StatusOr<std::string> text =
      ReadFileToString(options.config_path, kMaxConfigBytes);
  if (!text.ok()) {
    return absl::Status(text.status().code(),
                        absl::StrCat("--config: ", text.status().message()));
  }
  return ParseObjectiveConfig(*text, options.config_path);
}

// --loss, --gamma, --lk, --mode, --chunk_blocks and --threads.
absl::Status ApplyObjectiveFlags(const HeadJobOptions& options,
                                 v1::ObjectiveConfig& config) {
  if (!options.loss.empty()) {
    DFLASH_RETURN_IF_ERROR(
        SetLossByName("--loss", options.loss, *config.mutable_loss()));
  }
  if (options.gamma.has_value()) {
    DFLASH_RETURN_IF_ERROR(
        SetLossGamma("--gamma", *options.gamma, *config.mutable_loss()));
  }
  if (!options.lk.empty()) {
    DFLASH_RETURN_IF_ERROR(SetLkByName("--lk", options.lk, options.kl_scale,
                                       options.kl_decay,
                                       *config.mutable_loss()));
  } else if (options.kl_scale.has_value() || options.kl_decay.has_value()) {
    return absl::InvalidArgumentError(
        "--kl_scale, --kl_decay: set with --lk=lambda, got no --lk");
  }
  if (!options.mode.empty()) {
    DFLASH_RETURN_IF_ERROR(SetModeByName("--mode", options.mode, config));
  }
  if (options.chunk_blocks.has_value()) {
    if (*options.chunk_blocks <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--chunk_blocks: must be > 0 (anchor blocks a chunk), got ",
          *options.chunk_blocks));
    }
    config.mutable_chunking()->set_blocks_per_chunk(*options.chunk_blocks);
  }
  if (options.threads.has_value()) {
    if (*options.threads < 0 || *options.threads > kMaxThreads) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--threads: must lie in [0, ", kMaxThreads,
          "] (0: every usable CPU), got ", *options.threads));
    }
    config.mutable_head()->set_threads(*options.threads);
  }
  return absl::OkStatus();
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
        Join(options.inputs_dir, "hidden.npy"), " [B, N, K, H] = [",
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
  DFLASH_RETURN_IF_ERROR(ApplyObjectiveFlags(options, config));
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

namespace {

template <typename T>
absl::StatusOr<HeadBatch<T>> LoadInputsFrom(const std::string& dir,
                                            const InputHeaders& in,
                                            const v1::ObjectiveConfig& config) {
  const int64_t b = in.batch, s = in.seq, n = in.anchors, k = in.block,
                v = in.vocab;
  if (k != config.layout().block_size() || n != config.layout().num_anchors() ||
      in.hidden != config.head().hidden_size() ||
      v != config.head().vocab_size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        dir,
        ": the files' shapes changed after the config was made from "
        "them"));
  }
  HeadBatch<T> batch;
  DFLASH_ASSIGN_OR_RETURN(std::vector<int64_t> ids,
                          ReadInts(dir, *FindSpec(in, "input_ids.npy")));
  batch.input_ids = std::move(ids);
  DFLASH_ASSIGN_OR_RETURN(batch.loss_mask,
                          ReadMask(dir, *FindSpec(in, "loss_mask.npy")));
  DFLASH_ASSIGN_OR_RETURN(std::vector<int64_t> anchors,
                          ReadInts(dir, *FindSpec(in, "anchors.npy")));
  DFLASH_ASSIGN_OR_RETURN(batch.anchors.keep,
                          ReadMask(dir, *FindSpec(in, "keep.npy")));
  batch.anchors.num_anchors = n;
  batch.anchors.positions = std::move(anchors);
  absl::StatusOr<std::vector<RowMeta>> rows = LabelRows(
      {b, s, batch.input_ids, batch.loss_mask}, batch.anchors.positions,
      batch.anchors.keep, n, k, v,
      LossTraitsOf(config.loss()).labeling);
  if (!rows.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(dir, ": ", rows.status().message()));
  }
  batch.rows = *std::move(rows);
  const std::pair<const char*, std::vector<T>*> floats[] = {
      {"hidden.npy", &batch.hidden},
      {"lm_head.npy", &batch.weight},
      {"lm_head_bias.npy", &batch.bias},
      {"teacher_hidden.npy", &batch.teacher_hidden},
      {"correction_inputs.npy", &batch.correction_inputs},
      {"correction_weight.npy", &batch.correction_weight}};
  for (const auto& [name, out] : floats) {
    const InputSpec* spec = FindSpec(in, name);
    if (spec == nullptr) continue;
    DFLASH_ASSIGN_OR_RETURN(std::vector<T> values,
                            ReadFloats<T>(dir, *spec, config));
    *out = std::move(values);
  }
  if (const InputSpec* spec = FindSpec(in, "confidence_logits.npy")) {
    v1::ObjectiveConfig as_float = config;
    as_float.mutable_head()->set_dtype(v1::HeadConfig::FLOAT32);
    DFLASH_ASSIGN_OR_RETURN(std::vector<float> values,
                            ReadFloats<float>(dir, *spec, as_float));
    batch.confidence_logits = std::move(values);
  }
  return batch;
}

}  // namespace

template <typename T>
absl::StatusOr<HeadBatch<T>> LoadInputs(const std::string& dir,
                                        const v1::ObjectiveConfig& config) {
  DFLASH_ASSIGN_OR_RETURN(InputHeaders in, ReadInputHeaders(dir, config));
  return LoadInputsFrom<T>(dir, in, config);
}

template <typename T>
absl::Status SaveInputs(const HeadBatch<T>& batch,
                        const v1::ObjectiveConfig& config, int64_t batch_size,
                        int64_t seq_len, const std::string& dir) {
  const int64_t n = batch.anchors.num_anchors, k = config.layout().block_size();
  const int64_t h = config.head().hidden_size(), v = config.head().vocab_size();
  const std::vector<std::pair<std::string, NpyArray>> files = {
      {"hidden.npy", MakeNpy<T>(batch.hidden, {batch_size, n, k, h})},
      {"lm_head.npy", MakeNpy<T>(batch.weight, {v, h})},
      {"lm_head_bias.npy", MakeNpy<T>(batch.bias, {v})},
      {"input_ids.npy",
       MakeNpy<int64_t>(batch.input_ids, {batch_size, seq_len})},
      {"loss_mask.npy",
       MakeNpy<uint8_t>(batch.loss_mask, {batch_size, seq_len})},
      {"anchors.npy",
       MakeNpy<int64_t>(batch.anchors.positions, {batch_size, n})},
      {"keep.npy", MakeNpy<uint8_t>(batch.anchors.keep, {batch_size, n})},
      {"teacher_hidden.npy",
       MakeNpy<T>(batch.teacher_hidden, {batch_size, n, k, h})},
      {"confidence_logits.npy",
       MakeNpy<float>(batch.confidence_logits, {batch_size, n, k})},
      {"correction_inputs.npy",
       MakeNpy<T>(batch.correction_inputs,
                  {batch_size, n, k, config.head().correction_rank()})},
      {"correction_weight.npy",
       MakeNpy<T>(batch.correction_weight,
                  {v, config.head().correction_rank()})},
  };
  OutputFileSet out;
  for (const auto& [name, array] : files) {
    if (array.data.empty() && name != "hidden.npy") continue;
    if (absl::Status ok =
            StageNpy(out, Join(dir, name), array.type, array.shape, array.data);
        !ok.ok()) {
      return ok;
    }
  }
  return out.Commit();
}

template absl::StatusOr<HeadBatch<float>> LoadInputs<float>(
    const std::string&, const v1::ObjectiveConfig&);
template absl::StatusOr<HeadBatch<double>> LoadInputs<double>(
    const std::string&, const v1::ObjectiveConfig&);
template absl::Status SaveInputs<float>(const HeadBatch<float>&,
                                        const v1::ObjectiveConfig&, int64_t,
                                        int64_t, const std::string&);
template absl::Status SaveInputs<double>(const HeadBatch<double>&,
                                         const v1::ObjectiveConfig&, int64_t,
                                         int64_t, const std::string&);

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
