#include "python/native/objective.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <unistd.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/bfloat16.h"
#include "base/status_macros.h"
#include "base/threads.h"
#include "base/tracking_allocator.h"
#include "heads/top_k_gradient.h"
#include "losses/device_results.h"
#include "losses/loss_family.h"
#include "losses/loss_math.h"
#include "losses/row_rules.h"
#include "proto/config.h"
#include "python/native/cuda_run.h"
#include "python/native/objective_checks.h"

namespace dflash::python {
namespace {

using absl::string_view;

int64_t ReadId(const TensorArg& t, int64_t offset) {
  return t.dtype == "int64" ? t.as<const int64_t>()[offset]
                            : t.as<const int32_t>()[offset];
}

double ReadMask(const TensorArg& t, int64_t offset) {
  if (t.dtype == "float64") return t.as<const double>()[offset];
  if (t.dtype == "float32") return t.as<const float>()[offset];
  return t.as<const uint8_t>()[offset];  // bool: one byte, 0 or 1.
}

// "target_ids[1, 0, 3]".
std::string Element(const TensorArg& t, int64_t b, int64_t n, int64_t k) {
  return absl::StrCat(t.name, "[", b, ", ", n, ", ", k, "]");
}

TrackingAllocator& HostAllocator() {
  static auto& allocator = *new TrackingAllocator(
      std::numeric_limits<int64_t>::max(), /*cache_blocks=*/true);
  return allocator;
}

// CPU runs use every core and share the caching allocator: one at a time,
// under `mu`. `owner` is the thread holding it, and `deferred` the split
// runs destroyed on that thread meanwhile: a run may call into Python (a
// vocab-parallel exchange), whose garbage collector may free a split
// state there, and that state's destructor cannot take `mu` again. The
// holder frees them when it lets go (HostLock).
struct Host {
  std::mutex mu;
  std::atomic<std::thread::id> owner{};
  std::vector<std::shared_ptr<void>> deferred;
};

Host& HostState() {
  static auto& host = *new Host();
  return host;
}

// The host lock for a call; frees the split runs deferred meanwhile
// (freeing one may defer more) before letting go.
class HostLock {
 public:
  HostLock() : lock_(HostState().mu) {
    HostState().owner.store(std::this_thread::get_id());
  }
  ~HostLock() {
    Host& host = HostState();
    while (!host.deferred.empty()) {
      std::vector<std::shared_ptr<void>> freed = std::move(host.deferred);
      host.deferred.clear();
    }
    host.owner.store(std::thread::id());
  }
  HostLock(const HostLock&) = delete;
  HostLock& operator=(const HostLock&) = delete;

  // Whether this thread holds the lock (it is inside a run).
  static bool Held() {
    return HostState().owner.load() == std::this_thread::get_id();
  }

 private:
  std::lock_guard<std::mutex> lock_;
};

// The tensor's values as doubles, copied from its device when on one (in
// the order of torch's `stream`).
absl::StatusOr<std::vector<double>> HostValues(const TensorArg& t,
                                               uintptr_t stream) {
  const int64_t bytes = t.numel() * (t.dtype == "float64"    ? 8
                                     : t.dtype == "bfloat16" ? 2
                                                             : 4);
  std::vector<char> raw(static_cast<size_t>(bytes));
  if (t.on_cuda()) {
    DFLASH_RETURN_IF_ERROR(
        CopyFromDevice(t.cuda_index(), stream, t.data, raw.data(), bytes));
  } else {
    std::copy_n(t.as<const char>(), bytes, raw.data());
  }
  std::vector<double> values(static_cast<size_t>(t.numel()));
  for (size_t i = 0; i < values.size(); ++i) {
    if (t.dtype == "float64") {
      values[i] = reinterpret_cast<const double*>(raw.data())[i];
    } else if (t.dtype == "bfloat16") {
      values[i] = ToFloat(reinterpret_cast<const BFloat16*>(raw.data())[i]);
    } else {
      values[i] = reinterpret_cast<const float*>(raw.data())[i];
    }
  }
  return values;
}

// "hidden[1, 0, 2, 5]" for element `index` of `t`, C order.
std::string ElementAt(const TensorArg& t, int64_t index) {
  std::vector<int64_t> at(t.shape.size());
  for (int64_t d = static_cast<int64_t>(t.shape.size()) - 1; d >= 0; --d) {
    at[d] = index % t.shape[d];
    index /= t.shape[d];
  }
  return absl::StrCat(t.name, "[", absl::StrJoin(at, ", "), "]");
}

// After the head failed: the first non-finite value it read (the weighted
// rows of hidden, teacher_hidden and confidence_logits; the weight and
// bias), named, with the head's message; else the head's error as it is.
// Runs on failure only, so a correct run never pays for the scan.
absl::Status ExplainFailure(const absl::Status& failure,
                            const ObjectiveTensors& t,
                            absl::Span<const RowMeta> rows,
                            uintptr_t cuda_stream) {
  struct Scanned {
    const TensorArg* tensor;
    int64_t row_width;  // Values per row; 0 where the tensor is not per row.
  };
  const int64_t hidden_size = t.hidden.shape[3];
  std::vector<Scanned> scanned = {{&t.hidden, hidden_size}};
  if (t.teacher_hidden.has_value()) {
    scanned.push_back({&*t.teacher_hidden, hidden_size});
  }
  if (t.confidence_logits.has_value()) {
    scanned.push_back({&*t.confidence_logits, 1});
  }
  if (t.correction_inputs.has_value()) {
    scanned.push_back({&*t.correction_inputs, t.correction_inputs->shape[3]});
    scanned.push_back({&*t.correction_weight, 0});
  }
  scanned.push_back({&t.weight, 0});
  if (t.bias.has_value()) scanned.push_back({&*t.bias, 0});
  for (const auto& [tensor, width] : scanned) {
    absl::StatusOr<std::vector<double>> values =
        HostValues(*tensor, cuda_stream);
    if (!values.ok()) return failure;  // Unreadable: the head's error stands.
    for (size_t j = 0; j < values->size(); ++j) {
      const double x = (*values)[j];
      if (std::isfinite(x) || (width > 0 && rows[j / width].mask == 0)) {
        continue;
      }
      return absl::InvalidArgumentError(absl::StrCat(
          ElementAt(*tensor, static_cast<int64_t>(j)), ": must be finite, got ",
          x, " (the head reported: ", failure.message(), ")"));
    }
  }
  return failure;
}

template <typename T>
absl::Span<const T> SpanOf(const std::optional<TensorArg>& t) {
  return t.has_value() ? t->span<const T>() : absl::Span<const T>();
}
template <typename T>
absl::Span<T> MutableSpanOf(const std::optional<TensorArg>& t) {
  return t.has_value() ? t->span<T>() : absl::Span<T>();
}

// The head's view of the tensors and buffers, read and written in place.
template <typename T>
HeadInputs<T> InputsOf(const ObjectiveTensors& t,
                       absl::Span<const RowMeta> rows) {
  HeadInputs<T> inputs;
  inputs.hidden = t.hidden.span<const T>();
  inputs.teacher_hidden = SpanOf<T>(t.teacher_hidden);
  inputs.confidence_logits = SpanOf<ConfidenceOf<T>>(t.confidence_logits);
  inputs.rows = rows;
  inputs.weight = t.weight.span<const T>();
  inputs.bias = SpanOf<T>(t.bias);
  inputs.correction_inputs = SpanOf<T>(t.correction_inputs);
  inputs.correction_weight = SpanOf<T>(t.correction_weight);
  return inputs;
}

template <typename T>
HeadGradients<T> GradientsOf(const ObjectiveOutputs& o) {
  HeadGradients<T> gradients;
  gradients.correction_inputs = MutableSpanOf<T>(o.grad_correction_inputs);
  gradients.correction_weight = MutableSpanOf<T>(o.grad_correction_weight);
  gradients.hidden = MutableSpanOf<T>(o.grad_hidden);
  gradients.weight = MutableSpanOf<T>(o.grad_weight);
  gradients.bias = MutableSpanOf<T>(o.grad_bias);
  gradients.confidence = MutableSpanOf<ConfidenceOf<T>>(o.grad_confidence);
  return gradients;
}

// The head writes top-k values in float32: a float64 run gives it none and
// computes them afterwards (TopKValuesInFloat64).
HeadRowOutputs RowOutputsOf(const ObjectiveOutputs& o, bool float64) {
  HeadRowOutputs row_outputs;
  row_outputs.neg_log_q = MutableSpanOf<double>(o.neg_log_q);
  row_outputs.argmax = MutableSpanOf<int32_t>(o.argmax);
  row_outputs.base_argmax = MutableSpanOf<int32_t>(o.base_argmax);
  row_outputs.teacher_argmax = MutableSpanOf<int32_t>(o.teacher_argmax);
  row_outputs.top_k = MutableSpanOf<int32_t>(o.top_k);
  row_outputs.k =
      o.top_k.has_value() ? static_cast<int32_t>(o.top_k->shape[3]) : 0;
  if (!float64) row_outputs.top_k_values = MutableSpanOf<float>(o.top_k_values);
  row_outputs.loss_weight = MutableSpanOf<double>(o.loss_weight);
  return row_outputs;
}

// The loss's logits z' at the head's top-k ids, in float64, as the head
// formed them: hidden . W[id] (+ bias[id]) (+ the correction's z . M[id];
// domino, the one loss that reads the correction apart, takes no top-k),
// then the head's logit transform; 0 where an id is -1. k dot products a
// row, after the run. With a vocab shard the weight holds rows
// [offset, offset + vocab_size) alone: ids outside them get 0 here, and the
// caller sums the processes' values (each id has one owner, so the sum is
// exact).
void TopKValuesInFloat64(const v1::ObjectiveConfig& config,
                         const HeadInputs<double>& in,
                         absl::Span<const int32_t> ids, int64_t k,
                         int64_t offset, absl::Span<double> values) {
  const v1::HeadConfig& head = config.head();
  const int64_t h = head.hidden_size(), rank = head.correction_rank();
  const int64_t rows = head.vocab_size();
  const LogitTransform transform(head.logit_scale(), head.logit_softcap());
  const auto dot = [](const double* a, const double* b, int64_t n) {
    double sum = 0;
    for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
    return sum;
  };
  for (size_t i = 0; i < ids.size(); ++i) {
    const int64_t r = static_cast<int64_t>(i) / k, id = ids[i] - offset;
    if (ids[i] < 0 || id < 0 || id >= rows) {
      values[i] = 0;
      continue;
    }
    double z = dot(in.hidden.data() + r * h, in.weight.data() + id * h, h);
    if (!in.bias.empty()) z += in.bias[id];
    if (rank > 0) {
      z += dot(in.correction_inputs.data() + r * rank,
               in.correction_weight.data() + id * rank, rank);
    }
    values[i] = transform(z);
  }
}

template <typename T>
absl::StatusOr<HeadResult> Run(const v1::ObjectiveConfig& config,
                               const ObjectiveTensors& t,
                               const ObjectiveOutputs& o,
                               absl::Span<const RowMeta> rows,
                               const std::optional<DeviceMetadata>& metadata,
                               const ObjectiveOptions& objective_options) {
  const uintptr_t cuda_stream = objective_options.cuda_stream;
  const HeadInputs<T> inputs = InputsOf<T>(t, rows);
  const HeadGradients<T> gradients = GradientsOf<T>(o);
  const HeadRowOutputs row_outputs = RowOutputsOf(o, std::is_same_v<T, double>);
  // CheckHidden allows float64 on the CPU only, bfloat16 on CUDA only.
  if constexpr (!std::is_same_v<T, double>) {
    if (t.hidden.on_cuda()) {
      const std::optional<TensorArg>& results =
          objective_options.device_results;
      return RunOnTorchStream<T>(
          config, inputs, gradients, row_outputs, t.hidden.cuda_index(),
          cuda_stream, objective_options.forward_only,
          metadata.has_value() ? &*metadata : nullptr,
          results.has_value() ? reinterpret_cast<double*>(results->data)
                              : nullptr,
          objective_options.vocab_shard);
    }
  }
  if constexpr (std::is_same_v<T, BFloat16>) {
    return Invalid(t.hidden, "bfloat16 runs on CUDA only");
  } else {
    HostLock lock;
    HeadOptions options;
    options.prepared_projection = objective_options.prepared_projection;
    options.interrupt = objective_options.interrupt;
    options.forward_only = objective_options.forward_only;
    options.vocab_shard = objective_options.vocab_shard;
    absl::StatusOr<HeadResult> result = RunHead<T>(
        config, inputs, gradients, HostAllocator(), row_outputs, options);
    if constexpr (std::is_same_v<T, double>) {
      if (result.ok() && o.top_k_values.has_value()) {
        const VocabShard* shard = objective_options.vocab_shard;
        TopKValuesInFloat64(config, inputs, row_outputs.top_k, row_outputs.k,
                            shard != nullptr ? shard->offset : 0,
                            o.top_k_values->span<double>());
      }
    }
    return result;
  }
}

}  // namespace

absl::StatusOr<v1::ObjectiveConfig> BindConfig(
    const v1::ObjectiveConfig& config, const ObjectiveTensors& tensors,
    bool trainable) {
  v1::ObjectiveConfig bound = config;
  const std::vector<int64_t>& s = tensors.hidden.shape;
  bound.mutable_layout()->set_num_anchors(s[1]);
  bound.mutable_layout()->set_block_size(s[2]);
  v1::HeadConfig& head = *bound.mutable_head();
  head.set_vocab_size(tensors.weight.shape[0]);
  head.set_hidden_size(s[3]);
  head.set_dtype(tensors.hidden.dtype == "float64" ? v1::HeadConfig::FLOAT64
                 : tensors.hidden.dtype == "bfloat16"
                     ? v1::HeadConfig::BFLOAT16
                     : v1::HeadConfig::FLOAT32);
  head.set_backend(tensors.hidden.on_cuda() ? v1::HeadConfig::CUDA
                                            : v1::HeadConfig::CPU);
  head.set_trainable(trainable);
  head.set_bias(tensors.bias.has_value());
  head.set_correction_rank(tensors.correction_inputs.has_value()
                               ? tensors.correction_inputs->shape[3]
                               : 0);
  head.set_teacher_diagnostics(tensors.teacher_hidden.has_value() &&
                               !LossTraitsOf(bound.loss()).needs_teacher);
  bound = ResolveDefaults(std::move(bound));
  DFLASH_RETURN_IF_ERROR(ValidateObjectiveConfig(bound));
  DFLASH_RETURN_IF_ERROR(CheckLossInputs(bound, tensors));
  return bound;
}

absl::StatusOr<std::vector<RowMeta>> RowsOf(const TensorArg& target_ids,
                                            const TensorArg& weight_mask,
                                            int64_t vocab,
                                            int64_t ignore_index,
                                            bool count_ignored,
                                            bool float64_terms) {
  const int64_t b_size = target_ids.shape[0], n_size = target_ids.shape[1],
                k_size = target_ids.shape[2];
  std::vector<RowMeta> rows;
  rows.reserve(static_cast<size_t>(b_size * n_size * k_size));
  // The masks are kept in the terms' dtype and their sums (loss_den,
  // accuracy_den) returned in it: a sum beyond it would be inf.
  const double max_sum = float64_terms ? std::numeric_limits<double>::max()
                                       : std::numeric_limits<float>::max();
  const char* terms_dtype = float64_terms ? "float64" : "float32";
  double mask_sum = 0;
  const RowRules rules{vocab, ignore_index, count_ignored, float64_terms};
  const std::vector<int64_t>& ts = target_ids.strides;
  const std::vector<int64_t>& ms = weight_mask.strides;
  for (int64_t b = 0; b < b_size; ++b) {
    for (int64_t n = 0; n < n_size; ++n) {
      for (int64_t k = 0; k < k_size; ++k) {
        const double mask =
            ReadMask(weight_mask, b * ms[0] + n * ms[1] + k * ms[2]);
        if (!ValidMask(mask)) {
          return absl::InvalidArgumentError(
              absl::StrCat(Element(weight_mask, b, n, k),
                           ": must be finite and >= 0, got ", mask));
        }
        mask_sum += mask;
        if (!(mask_sum <= max_sum)) {
          return absl::InvalidArgumentError(absl::StrCat(
              weight_mask.name, ": its values sum to more than ", terms_dtype,
              " holds (", max_sum, ") by ",
              Element(weight_mask, b, n, k), " = ", mask,
              "; the loss and accuracy denominators would be inf"));
        }
        const int64_t target =
            ReadId(target_ids, b * ts[0] + n * ts[1] + k * ts[2]);
        RowMeta meta;
        if (!RowOfElement(mask, target, k, b * n_size + n, rules, meta)) {
          return absl::InvalidArgumentError(absl::StrCat(
              Element(target_ids, b, n, k), ": must lie in [0, V = ", vocab,
              ") or be ignore_index (", ignore_index,
              ") where weight_mask > 0, got ", target));
        }
        rows.push_back(meta);
      }
    }
  }
  return rows;
}

namespace {

int64_t MetadataElementBytes(const std::string& dtype) {
  return dtype == "int64" || dtype == "float64" ? 8
         : dtype == "bool"                      ? 1
                                                : 4;
}

// Row metadata copied to the host when it lives on a device: `arg` reads
// `bytes`, at the tensor's strides.
struct HostMetadata {
  std::vector<int64_t> bytes;  // int64_t: aligned for every dtype.
  TensorArg arg;
};

absl::StatusOr<HostMetadata> OnHost(const TensorArg& t, uintptr_t stream) {
  HostMetadata host;
  host.arg = t;
  if (!t.on_cuda()) return host;
  // The elements the strides reach (CheckTensors: one stride per dimension).
  int64_t extent = 1;
  for (size_t d = 0; d < t.shape.size(); ++d) {
    extent += (t.shape[d] - 1) * t.strides[d];
  }
  const int64_t bytes = extent * MetadataElementBytes(t.dtype);
  host.bytes.resize(static_cast<size_t>((bytes + 7) / 8));
  DFLASH_RETURN_IF_ERROR(
      CopyFromDevice(t.cuda_index(), stream, t.data, host.bytes.data(),
                     bytes));
  host.arg.device = "cpu";
  host.arg.data = reinterpret_cast<uintptr_t>(host.bytes.data());
  return host;
}

// RowsOf for the bound config, the metadata read on the host (copied there
// from a device in the order of torch's `stream`).
absl::StatusOr<std::vector<RowMeta>> HostRowsOf(
    const v1::ObjectiveConfig& bound, const ObjectiveTensors& tensors,
    const VocabShard* shard, uintptr_t stream) {
  DFLASH_ASSIGN_OR_RETURN(const HostMetadata ids,
                          OnHost(tensors.target_ids, stream));
  DFLASH_ASSIGN_OR_RETURN(const HostMetadata masks,
                          OnHost(tensors.weight_mask, stream));
  return RowsOf(ids.arg, masks.arg,
                shard != nullptr ? shard->vocab : bound.head().vocab_size(),
                bound.loss().cross_entropy().ignore_index(),
                LossParamsOf(bound.loss()).count_ignored,
                tensors.hidden.dtype == "float64");
}

DeviceMetadataTensor DeviceTensorOf(const TensorArg& t) {
  DeviceMetadataTensor out;
  out.data = t.data;
  out.dtype = t.dtype;
  std::copy_n(t.strides.begin(), 3, out.strides);
  return out;
}

// After a run from device metadata failed: RowsOf's error where the
// metadata has a bad element (the head reports it about its row alone),
// else ExplainFailure's with the rows read on the host. Runs on failure
// only: a correct run never copies the metadata.
absl::Status ExplainDeviceFailure(const absl::Status& failure,
                                  const v1::ObjectiveConfig& bound,
                                  const ObjectiveTensors& tensors,
                                  uintptr_t cuda_stream) {
  absl::StatusOr<std::vector<RowMeta>> rows =
      HostRowsOf(bound, tensors, /*shard=*/nullptr, cuda_stream);
  if (rows.ok()) return ExplainFailure(failure, tensors, *rows, cuda_stream);
  if (rows.status().code() == absl::StatusCode::kInvalidArgument) {
    return rows.status();
  }
  return failure;  // Unreadable: the head's error stands.
}

// RunObjective's checks and the rows, for a run (RunObjective) or a split
// forward (StartObjective): on the host, or `metadata` where the CUDA head
// builds them on the device (rows empty).
struct Checked {
  v1::ObjectiveConfig bound;
  std::vector<RowMeta> rows;
  std::optional<DeviceMetadata> metadata;
};

// A split forward's state: on the CPU the SplitHeadRun itself, under the
// host lock for each pass; on CUDA a TorchStreamRun, under its stream's
// lock.
template <typename T>
class SavedObjectiveOf : public SavedObjective {
 public:
  SavedObjectiveOf(v1::ObjectiveConfig config, const ObjectiveTensors& tensors,
                   std::vector<RowMeta> rows,
                   std::optional<DeviceMetadata> metadata)
      : config_(std::move(config)),
        tensors_(tensors),
        rows_(std::move(rows)),
        metadata_(std::move(metadata)),
        pid_(getpid()) {}

  ~SavedObjectiveOf() override {
    ScopedLibraryCall call;
    if (cuda_run_ != nullptr) {
      if (getpid() != pid_) {
        // A forked child has no CUDA context: the parent's device memory
        // is not the child's to free.
        (void)cuda_run_.release();
      } else {
        cuda_run_.reset();
      }
      return;
    }
    // The run frees what it holds into the shared host allocator, under
    // its lock; inside a run on this thread, when that run lets go. Its
    // destructor reads nothing it borrows.
    if (run_ == nullptr) return;
    if (HostLock::Held()) {
      HostState().deferred.push_back(std::shared_ptr<void>(std::move(run_)));
      return;
    }
    HostLock lock;
    run_.reset();
  }

  // The forward pass into `o`'s row outputs (on CUDA ordered on
  // `cuda_stream`); the run borrows `rows_` and `config_` (on CUDA from
  // `metadata_`, it makes and keeps its rows).
  absl::StatusOr<HeadResult> Forward(const ObjectiveOutputs& o,
                                     const HeadOptions& options,
                                     uintptr_t cuda_stream) {
    const HeadInputs<T> inputs = InputsOf<T>(tensors_, rows_);
    const HeadRowOutputs row_outputs =
        RowOutputsOf(o, std::is_same_v<T, double>);
    // CheckHidden allows float64 on the CPU only, bfloat16 on CUDA only.
    if constexpr (!std::is_same_v<T, double>) {
      if (tensors_.hidden.on_cuda()) {
        DFLASH_ASSIGN_OR_RETURN(
            cuda_run_,
            StartOnTorchStream<T>(
                config_, inputs, row_outputs, tensors_.hidden.cuda_index(),
                cuda_stream, options,
                metadata_.has_value() ? &*metadata_ : nullptr));
        return cuda_run_->forward();
      }
    }
    if constexpr (std::is_same_v<T, BFloat16>) {
      return Invalid(tensors_.hidden, "bfloat16 runs on CUDA only");
    } else {
      HostLock lock;
      DFLASH_ASSIGN_OR_RETURN(run_, StartHead<T>(config_, inputs,
                                                 HostAllocator(), row_outputs,
                                                 options));
      if constexpr (std::is_same_v<T, double>) {
        if (o.top_k_values.has_value()) {
          TopKValuesInFloat64(config_, inputs, row_outputs.top_k,
                              row_outputs.k, 0,
                              o.top_k_values->span<double>());
        }
      }
      return run_->forward();
    }
  }

  int64_t saved_bytes() const override {
    ScopedLibraryCall call;  // A fork waits: the child gets the lock free.
    if (cuda_run_ != nullptr) return cuda_run_->saved_bytes();
    HostLock lock;
    return run_ == nullptr ? 0 : run_->saved_bytes();
  }

  absl::StatusOr<HeadStats> Backward(
      double upstream, const ObjectiveOutputs& gradients,
      uintptr_t cuda_stream, const std::atomic<bool>* interrupt) override {
    ScopedLibraryCall call;
    if (getpid() != pid_) {
      return absl::FailedPreconditionError(
          absl::StrCat(
              "dflash_objective backward: this forward's state was made "
              "before fork() in the parent process; a forked child cannot "
              "run its backward ",
              cuda_run_ != nullptr
                  ? "(a forked child cannot use CUDA either: run the step in "
                    "the parent, or start the child with the spawn method)"
                  : "(run the forward in the child)"));
    }
    if (!std::isfinite(upstream)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "upstream gradient: must be finite, got ", upstream));
    }
    DFLASH_RETURN_IF_ERROR(
        CheckOutputs(gradients, tensors_, config_, /*forward_only=*/false));
    const HeadGradients<T> into = GradientsOf<T>(gradients);
    if (cuda_run_ != nullptr) {
      return cuda_run_->Backward(upstream, into, cuda_stream, interrupt);
    }
    HostLock lock;
    return run_->Backward(upstream, into, interrupt);
  }

  absl::StatusOr<HeadStats> BackwardFromDevice(
      const TensorArg& upstream, bool of_loss_num,
      const ObjectiveOutputs& gradients, uintptr_t cuda_stream,
      const std::atomic<bool>* interrupt) override {
    ScopedLibraryCall call;
    if (cuda_run_ == nullptr || getpid() != pid_) {
      return absl::InvalidArgumentError(
          "upstream: a tensor upstream is read on the device, by a CUDA run "
          "started in this process with head.device_results; pass a float");
    }
    if (!upstream.on_cuda() || upstream.device != tensors_.hidden.device ||
        (upstream.dtype != "float32" && upstream.dtype != "float64") ||
        upstream.numel() != 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "upstream: must be one float32 or float64 value on hidden's device "
          "(",
          tensors_.hidden.device, "), got ", upstream.dtype, " with ",
          upstream.numel(), " values on ", upstream.device));
    }
    DFLASH_RETURN_IF_ERROR(
        CheckOutputs(gradients, tensors_, config_, /*forward_only=*/false));
    const HeadGradients<T> into = GradientsOf<T>(gradients);
    DeviceUpstream on_device;
    on_device.value = reinterpret_cast<const void*>(upstream.data);
    on_device.is_float = upstream.dtype == "float32";
    on_device.of_loss_num = of_loss_num;
    return cuda_run_->BackwardFromDevice(on_device, into, cuda_stream,
                                         interrupt);
  }

 private:
  const v1::ObjectiveConfig config_;
  const ObjectiveTensors tensors_;
  const std::vector<RowMeta> rows_;
  const std::optional<DeviceMetadata> metadata_;
  const pid_t pid_;
  std::unique_ptr<SplitHeadRun<T>> run_;         // On the CPU.
  std::unique_ptr<TorchStreamRun<T>> cuda_run_;  // On CUDA.
};

// options.device_results against the bound config: exactly with
// head.device_results, float64 [DeviceResultsSize(K)], contiguous, on
// hidden's device.
absl::Status CheckDeviceResultsTensor(const std::optional<TensorArg>& results,
                                      const ObjectiveTensors& tensors,
                                      const v1::ObjectiveConfig& bound) {
  const int64_t size = DeviceResultsSize(bound.layout().block_size());
  if (!bound.head().device_results()) {
    if (!results.has_value()) return absl::OkStatus();
    return absl::InvalidArgumentError(
        "device_results: given, but head.device_results is not set (the "
        "terms are returned on the host)");
  }
  if (!results.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "device_results: head.device_results is set, so a float64 tensor of ",
        size, " values on hidden's device (", tensors.hidden.device,
        ") is required, got None"));
  }
  if (results->device != tensors.hidden.device || results->dtype != "float64" ||
      results->shape != std::vector<int64_t>{size} ||
      (size > 1 && results->strides[0] != 1)) {
    return Invalid(*results,
                   absl::StrCat("must be a contiguous float64 tensor [", size,
                                "] on hidden's device (", tensors.hidden.device,
                                ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<Checked> CheckObjective(const v1::ObjectiveConfig& config,
                                       const ObjectiveTensors& tensors,
                                       const ObjectiveOutputs& outputs,
                                       const ObjectiveOptions& options) {
  DFLASH_RETURN_IF_ERROR(CheckTensors(tensors));
  if (tensors.hidden.on_cuda() && !BuiltWithCuda()) {
    return Invalid(tensors.hidden,
                   absl::StrCat("is on ", tensors.hidden.device,
                                ", but this dflash was built without CUDA "
                                "(no toolkit when it was built)"));
  }
  if (options.forward_only && options.trainable) {
    return absl::InvalidArgumentError(
        "trainable: a forward-only run computes no gradient, so it cannot "
        "train the head; pass trainable=False");
  }
  const VocabShard* shard = options.vocab_shard;
  if (shard != nullptr) {
    DFLASH_RETURN_IF_ERROR(CheckVocabShard(*shard, tensors));
  }
  Checked checked;
  DFLASH_ASSIGN_OR_RETURN(checked.bound,
                          BindConfig(config, tensors, options.trainable));
  DFLASH_RETURN_IF_ERROR(
      CheckOutputs(outputs, tensors, checked.bound, options.forward_only));
  DFLASH_RETURN_IF_ERROR(
      CheckPrepared(options.prepared_projection, tensors, checked.bound));
  DFLASH_RETURN_IF_ERROR(
      CheckDeviceResultsTensor(options.device_results, tensors, checked.bound));
  // Host rows would reach the device by a copy from pageable memory, which
  // a CUDA graph cannot capture (and a replay would read a vector freed
  // with this call): device results need the rows built on the device.
  if (options.device_results.has_value() && tensors.hidden.on_cuda() &&
      !(tensors.target_ids.on_cuda() && tensors.weight_mask.on_cuda())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "device_results: needs target_ids and weight_mask on hidden's device (",
        tensors.hidden.device, "), got target_ids on ",
        tensors.target_ids.device, " and weight_mask on ",
        tensors.weight_mask.device,
        " (host labels are copied from pageable memory, which a CUDA graph "
        "cannot capture)"));
  }
  // Metadata on a CUDA hidden's device (CheckTensors: hidden's) stays
  // there: the head builds the rows (nothing read back before its work is
  // queued). Otherwise, and vocab-parallel (whose targets are checked
  // against the whole vocabulary on the host, and whose chunks wait for the
  // device anyway), the rows are made on the host, device tensors copied
  // there.
  if (shard == nullptr && tensors.hidden.on_cuda() &&
      tensors.target_ids.on_cuda() && tensors.weight_mask.on_cuda()) {
    const std::vector<int64_t>& s = tensors.hidden.shape;
    DeviceMetadata& metadata = checked.metadata.emplace();
    metadata.target_ids = DeviceTensorOf(tensors.target_ids);
    metadata.weight_mask = DeviceTensorOf(tensors.weight_mask);
    metadata.batch = s[0];
    metadata.anchors = s[1];
    return checked;
  }
  DFLASH_ASSIGN_OR_RETURN(
      checked.rows,
      HostRowsOf(checked.bound, tensors, shard, options.cuda_stream));
  return checked;
}

template <typename T>
absl::StatusOr<StartedObjective> Start(Checked checked,
                                       const ObjectiveTensors& t,
                                       const ObjectiveOutputs& o,
                                       const ObjectiveOptions& objective_options) {
  HeadOptions options;
  options.prepared_projection = objective_options.prepared_projection;
  options.interrupt = objective_options.interrupt;
  if (objective_options.device_results.has_value()) {
    options.device_results =
        reinterpret_cast<double*>(objective_options.device_results->data);
  }
  auto saved = std::make_unique<SavedObjectiveOf<T>>(
      std::move(checked.bound), t, std::move(checked.rows),
      std::move(checked.metadata));
  absl::StatusOr<HeadResult> forward =
      saved->Forward(o, options, objective_options.cuda_stream);
  if (!forward.ok()) return forward.status();
  return StartedObjective{*std::move(forward), std::move(saved)};
}

}  // namespace

absl::StatusOr<HeadResult> RunObjective(const v1::ObjectiveConfig& config,
                                        const ObjectiveTensors& tensors,
                                        const ObjectiveOutputs& outputs,
                                        const ObjectiveOptions& options) {
  ScopedLibraryCall call;
  DFLASH_ASSIGN_OR_RETURN(const Checked checked,
                          CheckObjective(config, tensors, outputs, options));
  const v1::ObjectiveConfig& bound = checked.bound;
  const std::vector<RowMeta>& rows = checked.rows;
  const std::optional<DeviceMetadata>& metadata = checked.metadata;
  const std::string& dtype = tensors.hidden.dtype;
  absl::StatusOr<HeadResult> result =
      dtype == "float64"
          ? Run<double>(bound, tensors, outputs, rows, metadata, options)
      : dtype == "bfloat16"
          ? Run<BFloat16>(bound, tensors, outputs, rows, metadata, options)
          : Run<float>(bound, tensors, outputs, rows, metadata, options);
  if (!result.ok() &&
      result.status().code() == absl::StatusCode::kInvalidArgument) {
    if (metadata.has_value()) {
      return ExplainDeviceFailure(result.status(), bound, tensors,
                                  options.cuda_stream);
    }
    return ExplainFailure(result.status(), tensors, rows, options.cuda_stream);
  }
  return result;
}

absl::Status CheckObjectiveResults(const v1::ObjectiveConfig& config,
                                   const ObjectiveTensors& tensors,
                                   const TensorArg& device_results,
                                   uintptr_t cuda_stream) {
  ScopedLibraryCall call;
  DFLASH_RETURN_IF_ERROR(CheckTensors(tensors));
  DFLASH_ASSIGN_OR_RETURN(const v1::ObjectiveConfig bound,
                          BindConfig(config, tensors, /*trainable=*/false));
  DFLASH_RETURN_IF_ERROR(
      CheckDeviceResultsTensor(device_results, tensors, bound));
  const absl::Status latched = ReadDeviceResultsStatus(
      bound, tensors.hidden.cuda_index(), cuda_stream, device_results.data);
  // RunObjective's explanation of a failed run, the same way.
  if (latched.code() != absl::StatusCode::kInvalidArgument) return latched;
  if (tensors.target_ids.on_cuda() && tensors.weight_mask.on_cuda()) {
    return ExplainDeviceFailure(latched, bound, tensors, cuda_stream);
  }
  absl::StatusOr<std::vector<RowMeta>> rows =
      HostRowsOf(bound, tensors, /*shard=*/nullptr, cuda_stream);
  if (!rows.ok()) return rows.status();
  return ExplainFailure(latched, tensors, *rows, cuda_stream);
}

absl::StatusOr<StartedObjective> StartObjective(
    const v1::ObjectiveConfig& config, const ObjectiveTensors& tensors,
    const ObjectiveOutputs& outputs, const ObjectiveOptions& options) {
  ScopedLibraryCall call;
  if (options.forward_only || options.vocab_shard != nullptr) {
    return absl::InvalidArgumentError(
        "a split forward runs with gradients and no vocab shard");
  }
  // Gradient buffers come at Backward: checked as a forward-only run's.
  ObjectiveOptions checked_options = options;
  checked_options.forward_only = true;
  checked_options.trainable = false;
  DFLASH_ASSIGN_OR_RETURN(
      Checked checked,
      CheckObjective(config, tensors, outputs, checked_options));
  // The head's config is bound with the options' trainable.
  DFLASH_ASSIGN_OR_RETURN(checked.bound,
                          BindConfig(config, tensors, options.trainable));
  DFLASH_RETURN_IF_ERROR(
      CheckPrepared(options.prepared_projection, tensors, checked.bound));
  const std::vector<RowMeta> rows = checked.rows;
  const bool device_rows = checked.metadata.has_value();
  const v1::ObjectiveConfig bound = checked.bound;
  const std::string& dtype = tensors.hidden.dtype;
  absl::StatusOr<StartedObjective> started =
      dtype == "float64"
          ? Start<double>(std::move(checked), tensors, outputs, options)
      : dtype == "bfloat16"
          ? Start<BFloat16>(std::move(checked), tensors, outputs, options)
          : Start<float>(std::move(checked), tensors, outputs, options);
  if (!started.ok() &&
      started.status().code() == absl::StatusCode::kInvalidArgument) {
    if (device_rows) {
      return ExplainDeviceFailure(started.status(), bound, tensors,
                                  options.cuda_stream);
    }
    return ExplainFailure(started.status(), tensors, rows,
                          options.cuda_stream);
  }
  return started;
}

namespace {

template <typename T>
absl::Status TopKBackward(const v1::ObjectiveConfig& config,
                          const TopKBackwardTensors& t, int32_t k,
                          uintptr_t cuda_stream) {
  const HeadInputs<T> inputs{t.hidden.span<const T>(),
                             {},
                             {},
                             {},
                             t.weight.span<const T>(),
                             SpanOf<T>(t.bias),
                             SpanOf<T>(t.correction_inputs),
                             SpanOf<T>(t.correction_weight)};
  const HeadGradients<T> gradients{t.grad_hidden.span<T>(),
                                   MutableSpanOf<T>(t.grad_weight),
                                   MutableSpanOf<T>(t.grad_bias),
                                   {},
                                   MutableSpanOf<T>(t.grad_correction_inputs),
                                   MutableSpanOf<T>(t.grad_correction_weight)};
  const auto ids = t.top_k.span<const int32_t>();
  if constexpr (!std::is_same_v<T, double>) {
    if (t.hidden.on_cuda()) {
      return AddTopKValueGradientsOnTorchStream<T>(
          config, inputs, ids, t.values.span<const float>(),
          t.grad_values.span<const float>(), k, gradients,
          t.hidden.cuda_index(), cuda_stream);
    }
  }
  if constexpr (std::is_same_v<T, BFloat16>) {
    return Invalid(t.hidden, "bfloat16 runs on CUDA only");
  } else {
    // On the CPU the values and their gradients are in hidden's dtype.
    return AddTopKValueGradients<T>(
        config, inputs, ids, t.values.span<const T>(),
        t.grad_values.span<const T>(), k, gradients);
  }
}

}  // namespace

absl::Status RunTopKValueBackward(const v1::ObjectiveConfig& config,
                                  const TopKBackwardTensors& t,
                                  const ObjectiveOptions& options) {
  ScopedLibraryCall call;
  DFLASH_RETURN_IF_ERROR(CheckTopKBackward(t, options.trainable));
  const std::vector<int64_t>& s = t.hidden.shape;
  const TensorArg& w = t.weight;
  const int64_t k = t.top_k.shape[3];  // CheckTopKBackward: [B, N, K, k].
  v1::ObjectiveConfig bound = config;
  v1::HeadConfig& head = *bound.mutable_head();
  head.set_vocab_size(w.shape[0]);
  head.set_hidden_size(s[3]);
  head.set_trainable(options.trainable);
  head.set_bias(t.bias.has_value());
  head.set_correction_rank(
      t.correction_inputs.has_value() ? t.correction_inputs->shape[3] : 0);
  const std::string& dtype = t.hidden.dtype;
  const int32_t top_k = static_cast<int32_t>(k);
  return dtype == "float64"
             ? TopKBackward<double>(bound, t, top_k, options.cuda_stream)
         : dtype == "bfloat16"
             ? TopKBackward<BFloat16>(bound, t, top_k, options.cuda_stream)
             : TopKBackward<float>(bound, t, top_k, options.cuda_stream);
}

absl::StatusOr<std::unique_ptr<PreparedProjection>> PrepareProjection(
    const TensorArg& weight, const std::optional<TensorArg>& bias,
    int threads) {
  static constexpr string_view kFloat32[] = {"float32"};
  DFLASH_RETURN_IF_ERROR(ExpectDType(weight, kFloat32,
                                     "a prepared projection is float32"));
  DFLASH_RETURN_IF_ERROR(
      ExpectDevice(weight, "cpu", "a prepared projection runs on the CPU"));
  if (weight.shape.size() != 2 || weight.shape[0] <= 0 ||
      weight.shape[1] <= 0) {
    return Invalid(weight, absl::StrCat("must have shape [V, H], got ",
                                        ShapeString(weight.shape)));
  }
  DFLASH_RETURN_IF_ERROR(ExpectContiguous(weight));
  if (bias.has_value()) {
    DFLASH_RETURN_IF_ERROR(CheckBeside(*bias, weight, {weight.shape[0]},
                                       "[V] (V of lm_head_weight)"));
  }
  return PreparedProjection::Create(
      weight.span<const float>(),
      bias.has_value() ? bias->span<const float>() : absl::Span<const float>(),
      weight.shape[0], weight.shape[1], threads);
}

void ReleaseCachedHostMemory() {
  ScopedLibraryCall call;
  HostLock lock;
  HostAllocator().ReleaseCache();
}

}  // namespace dflash::python
