// dflash._core: the Python extension module. Tensors arrive as torch
// objects and are read through their Python attributes (data_ptr, dtype,
// shape, stride, device), so no torch header or library is needed to build
// it and one build serves every torch version.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <limits>
#include <optional>
#include <type_traits>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "losses/device_results.h"
#include "losses/loss_family.h"
#include "losses/loss_math.h"
#include "losses/vocab_shard.h"
#include "proto/config.h"
#include "proto/config_overrides.h"
#include "python/native/config_sources.h"
#include "base/threads.h"
#include "python/native/cuda_run.h"
#include "python/native/interrupt.h"
#include "python/native/objective.h"

namespace py = pybind11;

namespace dflash::python {
namespace {

// The Python exception for `status`, with its message: ValueError for bad
// arguments, MemoryError when memory ran out, FileNotFoundError for a config
// file that cannot be read, RuntimeError for the rest (a device failing).
[[noreturn]] void Raise(const absl::Status& status) {
  PyObject* type = PyExc_RuntimeError;
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
      type = PyExc_ValueError;
      break;
    case absl::StatusCode::kResourceExhausted:
      type = PyExc_MemoryError;
      break;
    case absl::StatusCode::kNotFound:
      type = PyExc_FileNotFoundError;
      break;
    case absl::StatusCode::kUnimplemented:
      type = PyExc_NotImplementedError;
      break;
    default:
      break;
  }
  // Messages may quote input bytes that are not UTF-8 (a config's): kept
  // as \x escapes rather than failing to become a str.
  const absl::string_view message = status.message();
  PyObject* text = PyUnicode_DecodeUTF8(
      message.data(), static_cast<Py_ssize_t>(message.size()),
      "backslashreplace");
  if (text != nullptr) {
    PyErr_SetObject(type, text);
    Py_DECREF(text);
  }
  throw py::error_already_set();
}

template <typename T>
T ValueOrRaise(absl::StatusOr<T> value) {
  if (!value.ok()) Raise(value.status());
  return *std::move(value);
}

[[noreturn]] void RaiseType(const std::string& message) {
  PyErr_SetString(PyExc_TypeError, message.c_str());
  throw py::error_already_set();
}

// A torch tensor's metadata; None stays absent. Sparse, mkldnn and meta
// tensors have no strided data to read in place: a TypeError.
std::optional<TensorArg> ArgOf(const char* name, py::handle tensor) {
  if (tensor.is_none()) return std::nullopt;
  if (!py::hasattr(tensor, "data_ptr") || !py::hasattr(tensor, "stride") ||
      !py::hasattr(tensor, "layout")) {
    RaiseType(absl::StrCat(name, ": must be a torch.Tensor, got ",
                           std::string(py::str(tensor.get_type()))));
  }
  const std::string layout = py::str(tensor.attr("layout"));
  if (layout != "torch.strided") {
    RaiseType(absl::StrCat(name, ": must be a dense (strided) tensor, got ",
                           layout, " (call .to_dense())"));
  }
  if (py::hasattr(tensor, "is_meta") && tensor.attr("is_meta").cast<bool>()) {
    RaiseType(absl::StrCat(name,
                           ": must hold data, got a meta tensor (shape and "
                           "dtype only)"));
  }
  // A lazily negated view's memory holds the values un-negated.
  if (py::hasattr(tensor, "is_neg") && tensor.attr("is_neg")().cast<bool>()) {
    RaiseType(absl::StrCat(name,
                           ": must not be a lazily negated view (call "
                           ".resolve_neg(), one copy)"));
  }
  TensorArg arg;
  arg.name = name;
  arg.data = tensor.attr("data_ptr")().cast<uintptr_t>();
  std::string dtype = py::str(tensor.attr("dtype"));
  arg.dtype = dtype.rfind("torch.", 0) == 0 ? dtype.substr(6) : dtype;
  arg.shape = tensor.attr("shape").cast<std::vector<int64_t>>();
  arg.strides = tensor.attr("stride")().cast<std::vector<int64_t>>();
  arg.device = py::str(tensor.attr("device"));
  return arg;
}

TensorArg RequiredArgOf(const char* name, py::handle tensor) {
  std::optional<TensorArg> arg = ArgOf(name, tensor);
  if (!arg.has_value())
    RaiseType(absl::StrCat(name, ": must be a tensor, got None"));
  return *std::move(arg);
}

// `value` as T, or a TypeError naming the keyword. A bool is not a number
// here (True would read as 1).
template <typename T>
T Cast(const std::string& key, py::handle value, const char* expected) {
  if constexpr (!std::is_same_v<T, std::string>) {
    // NumPy's bools too (numpy.bool_, named bool from NumPy 2).
    const std::string type = py::str(value.get_type().attr("__name__"));
    if (type == "bool" || type == "bool_") {
      RaiseType(absl::StrCat(key, ": must be ", expected, ", got ",
                             std::string(py::repr(value))));
    }
  }
  try {
    return value.cast<T>();
  } catch (const py::cast_error&) {
    if constexpr (std::is_integral_v<T>) {
      if (py::isinstance<py::int_>(value)) {
        Raise(absl::InvalidArgumentError(
            absl::StrCat(key, ": must fit in ", sizeof(T) * 8,
                         " bits, got ", std::string(py::repr(value)))));
      }
    }
    RaiseType(absl::StrCat(key, ": must be ", expected, ", got ",
                           std::string(py::repr(value))));
  }
}

ConfigOverrides OverridesOf(const py::kwargs& kwargs) {
  ConfigOverrides o;
  for (const auto& [key_handle, value] : kwargs) {
    const std::string key = py::str(key_handle);
    if (key == "loss_type") {
      o.loss = Cast<std::string>(key, value, "a str");
    } else if (key == "lk_loss_type") {
      o.lk = Cast<std::string>(key, value, "a str");
    } else if (key == "kl_scale") {
      o.kl_scale = Cast<double>(key, value, "a float");
    } else if (key == "kl_decay") {
      o.kl_decay = Cast<double>(key, value, "a float");
    } else if (key == "gamma") {
      o.gamma = Cast<double>(key, value, "a float");
    } else if (key == "mode") {
      o.mode = Cast<std::string>(key, value, "a str");
    } else if (key == "chunk_blocks") {
      o.chunk_blocks = Cast<int64_t>(key, value, "an int");
    } else if (key == "segment_chunks") {
      o.segment_chunks = Cast<int64_t>(key, value, "an int");
    } else if (key == "threads") {
      o.threads = Cast<int64_t>(key, value, "an int");
    } else if (key == "ignore_index") {
      o.ignore_index = Cast<int64_t>(key, value, "an int");
    } else if (key == "label_smoothing") {
      o.label_smoothing = Cast<double>(key, value, "a float");
    } else if (key == "z_loss_scale") {
      o.z_loss_scale = Cast<double>(key, value, "a float");
    } else {
      RaiseType(absl::StrCat(
          "unexpected keyword override '", key,
          "'; the overrides are loss_type, lk_loss_type, kl_scale, "
          "kl_decay, gamma, mode, chunk_blocks, "
          "segment_chunks, threads, ignore_index, label_smoothing, "
          "z_loss_scale (anything else: text format in config=)"));
    }
  }
  return o;
}

py::object OptionalName(bool has, const std::string& name) {
  return has ? py::object(py::str(name)) : py::object(py::none());
}

// The checkpoint policy with its preset expanded into rules, validated.
py::dict CheckpointPolicyOf(const v1::ObjectiveConfig& config) {
  const v1::CheckpointPolicy policy = ResolveDefaults(config).checkpoint();
  const absl::Status valid = ValidateCheckpointPolicy(policy);
  if (!valid.ok()) Raise(valid);
  const std::vector<v1::CheckpointRule> rules =
      policy.has_preset() ? PresetRules(policy.preset())
                          : std::vector<v1::CheckpointRule>(
                                policy.rules().begin(), policy.rules().end());
  py::list list;
  for (const v1::CheckpointRule& rule : rules) {
    py::dict d;
    d["kind"] =
        OptionalName(rule.has_kind(), v1::IntermediateKind_Name(rule.kind()));
    d["name"] = OptionalName(rule.has_name(), rule.name());
    d["weight_frozen"] = rule.has_weight_frozen()
                             ? py::object(py::bool_(rule.weight_frozen()))
                             : py::object(py::none());
    d["input_requires_grad"] =
        rule.has_input_requires_grad()
            ? py::object(py::bool_(rule.input_requires_grad()))
            : py::object(py::none());
    d["action"] = v1::CheckpointAction_Name(rule.action());
    list.append(d);
  }
  py::dict d;
  d["rules"] = list;
  d["default_action"] = v1::CheckpointAction_Name(policy.default_action());
  d["memory_budget_bytes"] =
      policy.has_memory_budget_bytes()
          ? py::object(py::int_(policy.memory_budget_bytes()))
          : py::object(py::none());
  d["segment_chunks"] = policy.segment_chunks();
  return d;
}

py::dict ResultOf(const HeadResult& r) {
  py::dict stats;
  stats["mode"] = v1::HeadConfig::ExecutionMode_Name(r.mode);
  stats["chunks"] = r.stats.chunks;
  stats["projected_rows"] = r.stats.projected_rows;
  stats["gemm_calls"] = r.stats.gemm_calls;
  stats["gemm_passes"] = r.stats.gemm_passes;
  stats["segment_recomputes"] = r.stats.segment_recomputes;
  stats["peak_bytes"] = r.stats.peak_bytes;
  stats["saved_bytes"] = r.stats.saved_bytes;
  stats["forward_seconds"] = r.stats.forward_seconds;
  stats["backward_seconds"] = r.stats.backward_seconds;
  stats["threads"] = r.stats.threads;
  // The terms go where losses/chunk_terms.inc says: the top level (`core`),
  // FamilyTerms (`family`, SpecForge's DSpark and Domino terms by their
  // names there) or ObjectiveDiagnostics.metrics (`diagnostics`).
  py::dict d, family, diagnostics;
  py::dict& core = d;
#define DFLASH_SUMMED_TERM(field, slot, dict, key) dict[key] = r.terms.field;
#define DFLASH_POSITION_TERM(field, slot, dict, key) dict[key] = r.terms.field;
#define DFLASH_BLOCK_TERM(field, dict, key) \
  dict[key] = r.terms.accepted_length.field;
#include "losses/chunk_terms.inc"
  d["lk_kl_weight"] = r.lk_kl_weight ? py::object(py::float_(*r.lk_kl_weight))
                                     : py::object(py::none());
  d["loss_denominator"] = r.loss_denominator;
  d["loss_den_offset"] = r.loss_den_offset;
  d["family_terms"] = family;
  d["diagnostics"] = diagnostics;
  d["stats"] = stats;
  return d;
}

// dflash::VocabExchange over a Python callable all_gather(local, out):
// local and out are float64 memoryviews of the head's own buffers (n and
// size * n values; local is read, not written), and the callable fills out
// with every process's local in rank order (dflash.torch runs
// torch.distributed's all_gather on them). The head calls it with the GIL
// released, from whichever thread runs the loss: it takes the GIL. Whatever
// the callable raises (a Python exception, KeyboardInterrupt, a C++
// exception through pybind11) becomes an error Status kept as this
// process's own error (own_error), never an exception through the head's
// C++ frames. Whether the record went decides what the head does next:
// out's record heads are set to NaN before the call, and a transport that
// delivered has overwritten every one. Not delivered: the error is
// returned, and GatherRecords sends the record again with it (the others
// wait in this gather). Delivered (an exception as the transport returned,
// as a KeyboardInterrupt from Ctrl-C is): the data is good, OK is returned,
// and the error goes in the head of the next record, where every process
// stops (a run always has a next gather: its closing one).
class PythonVocabExchange final : public VocabExchange {
 public:
  PythonVocabExchange(int rank, int size, py::object all_gather)
      : rank_(rank), size_(size), all_gather_(std::move(all_gather)) {}

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  absl::Status AllGather(absl::Span<const double> local,
                         absl::Span<double> out) override {
    const size_t n = local.size();
    if (out.size() != n * static_cast<size_t>(size_)) {
      return absl::InternalError(absl::StrCat(
          "vocab exchange: out holds ", out.size(), " values, expected ",
          size_, " x ", n));
    }
    if (!pending_.ok() && n >= kRecordHead) {
      sent_.assign(local.begin(), local.end());
      SetRecordHead(pending_, absl::MakeSpan(sent_));
      local = sent_;
      pending_ = absl::OkStatus();
    }
    for (size_t at = 0; at < out.size(); at += n) {
      out[at] = std::numeric_limits<double>::quiet_NaN();
    }
    absl::Status raised = Call(local, out);
    if (raised.ok()) return raised;
    if (own_error_.ok()) own_error_ = raised;
    bool delivered = n > 0;
    for (size_t at = 0; at < out.size(); at += n) {
      delivered = delivered && !std::isnan(out[at]);
    }
    if (!delivered) return raised;
    pending_ = raised;
    return absl::OkStatus();
  }

  // The first error the callable raised in this call (OK: none), and
  // whether it was a KeyboardInterrupt (CANCELLED).
  const absl::Status& own_error() const { return own_error_; }
  // A new call: no error yet.
  void Reset() {
    own_error_ = absl::OkStatus();
    pending_ = absl::OkStatus();
  }

 private:
  absl::Status Call(absl::Span<const double> local, absl::Span<double> out) {
    py::gil_scoped_acquire gil;
    const auto view = [](const double* data, size_t n) {
      return py::memoryview::from_buffer(
          const_cast<double*>(data), {static_cast<py::ssize_t>(n)},
          {static_cast<py::ssize_t>(sizeof(double))}, /*readonly=*/false);
    };
    try {
      all_gather_(view(local.data(), local.size()),
                  view(out.data(), out.size()));
      return absl::OkStatus();
    } catch (py::error_already_set& error) {
      // The exception's type and message (its traceback is the head's
      // frames, of no use to the caller); a __str__ that raises must not
      // send an exception through the head's frames.
      std::string what = "an exception whose message cannot be read";
      try {
        what =
            absl::StrCat(std::string(py::str(error.type().attr("__name__"))),
                         ": ", std::string(py::str(error.value())));
      } catch (...) {
        PyErr_Clear();
      }
      if (error.matches(PyExc_KeyboardInterrupt)) {
        return absl::CancelledError(absl::StrCat(
            "vocab_group: interrupted in the vocab-parallel head's "
            "all-gather (",
            what, ")"));
      }
      return absl::AbortedError(absl::StrCat(
          "vocab_group: the all-gather of the vocab-parallel head raised ",
          what));
    } catch (const std::exception& error) {
      return absl::AbortedError(absl::StrCat(
          "vocab_group: the all-gather of the vocab-parallel head raised ",
          error.what()));
    } catch (...) {
      return absl::AbortedError(
          "vocab_group: the all-gather of the vocab-parallel head raised an "
          "unknown exception");
    }
  }

  const int rank_, size_;
  py::object all_gather_;
  absl::Status own_error_, pending_;
  std::vector<double> sent_;
};

// _core.VocabShard: a VocabShard and the exchange it borrows, kept alive
// together.
struct VocabShardHandle {
  VocabShardHandle(int64_t offset, int64_t vocab, int rank, int size,
                   py::object all_gather)
      : exchange(rank, size, std::move(all_gather)) {
    shard.offset = offset;
    shard.vocab = vocab;
    shard.exchange = &exchange;
  }
  PythonVocabExchange exchange;
  VocabShard shard;
  // The runs this shard entered (run_objective): a Python failure between
  // the agreement and the run, on a count that has not moved, must send a
  // refusal (refuse) where the others wait in the run's handshake.
  int64_t runs = 0;
};

// A PreparedProjection and the tensors it reads, kept alive with it.
struct PreparedHandle {
  std::unique_ptr<PreparedProjection> projection;
  py::object weight, bias;
};

// A Cancelled status as Python's own SIGINT handling gives it, else raised.
template <typename V>
V CancelledOrValue(absl::StatusOr<V> result) {
  if (result.status().code() == absl::StatusCode::kCancelled) {
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
    PyErr_SetNone(PyExc_KeyboardInterrupt);
    throw py::error_already_set();
  }
  return ValueOrRaise(std::move(result));
}

// Raises this process's own error from its vocab exchange, if any (a
// KeyboardInterrupt for CANCELLED): it wins over the head's report of it,
// which names this process, or any later error.
void RaiseOwnExchangeError(const PythonVocabExchange& exchange) {
  const absl::Status& own = exchange.own_error();
  if (own.code() == absl::StatusCode::kCancelled) {
    PyErr_SetNone(PyExc_KeyboardInterrupt);
    throw py::error_already_set();
  }
  if (!own.ok()) Raise(own);
}

// The objective's input tensors, each named as the caller passes it.
ObjectiveTensors TensorsOf(py::handle hidden, py::handle weight,
                           py::handle target_ids, py::handle weight_mask,
                           py::handle bias, py::handle teacher_hidden,
                           py::handle confidence_logits,
                           py::handle correction_inputs,
                           py::handle correction_weight) {
  return {RequiredArgOf("hidden", hidden),
          RequiredArgOf("lm_head_weight", weight),
          RequiredArgOf("target_ids", target_ids),
          RequiredArgOf("weight_mask", weight_mask),
          ArgOf("lm_head_bias", bias),
          ArgOf("teacher_hidden", teacher_hidden),
          ArgOf("confidence_logits", confidence_logits),
          ArgOf("correction_inputs", correction_inputs),
          ArgOf("correction_weight", correction_weight)};
}

py::dict RunObjectiveFromPython(
    const v1::ObjectiveConfig& config, py::handle hidden, py::handle weight,
    py::handle target_ids, py::handle weight_mask, py::handle bias,
    py::handle teacher_hidden, py::handle confidence_logits,
    py::handle grad_hidden, py::handle grad_weight, py::handle grad_bias,
    py::handle grad_confidence, py::handle neg_log_q, py::handle argmax,
    py::handle top_k, py::handle top_k_values, py::handle loss_weight,
    py::handle correction_inputs, py::handle correction_weight,
    py::handle grad_correction_inputs, py::handle grad_correction_weight,
    const PreparedHandle* prepared, bool trainable, uintptr_t cuda_stream,
    bool interruptible, bool forward_only,
    VocabShardHandle* vocab_shard, py::handle base_argmax,
    py::handle teacher_argmax, py::handle device_results) {
  const ObjectiveTensors tensors =
      TensorsOf(hidden, weight, target_ids, weight_mask, bias,
                teacher_hidden, confidence_logits, correction_inputs,
                correction_weight);
  ObjectiveOutputs outputs{ArgOf("grad_hidden", grad_hidden),
                           ArgOf("grad_weight", grad_weight),
                           ArgOf("grad_bias", grad_bias),
                           ArgOf("grad_confidence", grad_confidence),
                           ArgOf("neg_log_q", neg_log_q),
                           ArgOf("argmax", argmax),
                           ArgOf("base_argmax", base_argmax),
                           ArgOf("teacher_argmax", teacher_argmax),
                           ArgOf("top_k", top_k),
                           ArgOf("top_k_values", top_k_values),
                           ArgOf("loss_weight", loss_weight),
                           ArgOf("grad_correction_inputs",
                                 grad_correction_inputs),
                           ArgOf("grad_correction_weight",
                                 grad_correction_weight)};
  const std::optional<TensorArg> results =
      ArgOf("device_results", device_results);
  absl::StatusOr<HeadResult> result;
  // Vocab-parallel: every process of the group stops together, whatever
  // fails where (docs/scaling.md, "Stopping together").
  std::optional<RunExchange> exchange;
  VocabShard shard;
  if (vocab_shard != nullptr) {
    ++vocab_shard->runs;
    PythonVocabExchange& python = vocab_shard->exchange;
    python.Reset();
    exchange.emplace(python);
    shard = {vocab_shard->shard.offset, vocab_shard->shard.vocab,
             &*exchange};
  }
  {
    std::optional<ScopedInterrupt> interrupt;
    if (interruptible) interrupt.emplace();
    py::gil_scoped_release release;
    ObjectiveOptions options{
        trainable, cuda_stream,
        prepared != nullptr ? prepared->projection.get() : nullptr,
        interrupt ? interrupt->flag() : nullptr, forward_only,
        vocab_shard != nullptr ? &shard : nullptr};
    options.device_results = results;
    result = RunObjective(config, tensors, outputs, options);
    if (exchange && !result.ok() && exchange->gathers() == 0) {
      // Refused before the head's first gather (a check of the binding's
      // the agreement does not cover): the others wait in the run's
      // handshake for this process's record.
      SendError(*exchange, result.status()).IgnoreError();
    }
  }
  if (vocab_shard != nullptr) RaiseOwnExchangeError(vocab_shard->exchange);
  return ResultOf(CancelledOrValue(std::move(result)));
}

// _core.SavedHead: a split forward's state (SavedObjective) and the objects
// whose memory it reads, kept alive with it. Its buffer is 8 bytes, its
// own address, so that torch.frombuffer ties it to a tensor autograd saves
// (the token) and a copy of that tensor still names it.
struct SavedHead {
  ~SavedHead() {
    if (on_cuda && PythonFinalizing()) {
      // Its device memory would go back through torch's allocator, which
      // may be gone: the process is ending anyway.
      (void)saved.release();
      return;
    }
    // Freeing takes the CPU head's lock, which a run holding it may need
    // the GIL to release (a vocab-parallel exchange); on CUDA, the
    // stream's lock, and torch's allocator takes the GIL itself. Where
    // this thread holds that lock (the garbage collector inside such a
    // callback), the run frees it when it lets go.
    py::gil_scoped_release release;
    saved.reset();
  }
  static bool PythonFinalizing() {
#if PY_VERSION_HEX >= 0x030D0000
    return Py_IsFinalizing() != 0;
#else
    return _Py_IsFinalizing() != 0;
#endif
  }
  std::unique_ptr<SavedObjective> saved;
  std::vector<py::object> borrowed;
  bool on_cuda = false;
  int64_t token = 0;
  py::object stats = py::none();  // The caller's record of the forward.
};

py::tuple StartObjectiveFromPython(
    const v1::ObjectiveConfig& config, py::handle hidden, py::handle weight,
    py::handle target_ids, py::handle weight_mask, py::handle bias,
    py::handle teacher_hidden, py::handle confidence_logits,
    py::handle neg_log_q, py::handle argmax, py::handle top_k,
    py::handle top_k_values, py::handle loss_weight,
    py::handle correction_inputs, py::handle correction_weight,
    py::object prepared, bool trainable, bool interruptible,
    py::handle base_argmax, py::handle teacher_argmax, uintptr_t cuda_stream,
    py::handle device_results) {
  const ObjectiveTensors tensors =
      TensorsOf(hidden, weight, target_ids, weight_mask, bias,
                teacher_hidden, confidence_logits, correction_inputs,
                correction_weight);
  ObjectiveOutputs outputs;
  outputs.neg_log_q = ArgOf("neg_log_q", neg_log_q);
  outputs.argmax = ArgOf("argmax", argmax);
  outputs.base_argmax = ArgOf("base_argmax", base_argmax);
  outputs.teacher_argmax = ArgOf("teacher_argmax", teacher_argmax);
  outputs.top_k = ArgOf("top_k", top_k);
  outputs.top_k_values = ArgOf("top_k_values", top_k_values);
  outputs.loss_weight = ArgOf("loss_weight", loss_weight);
  const PreparedHandle* handle =
      prepared.is_none() ? nullptr : prepared.cast<const PreparedHandle*>();
  const std::optional<TensorArg> results =
      ArgOf("device_results", device_results);
  absl::StatusOr<StartedObjective> started;
  {
    std::optional<ScopedInterrupt> interrupt;
    if (interruptible) interrupt.emplace();
    py::gil_scoped_release release;
    ObjectiveOptions options;
    options.trainable = trainable;
    options.cuda_stream = cuda_stream;
    options.prepared_projection =
        handle != nullptr ? handle->projection.get() : nullptr;
    options.interrupt = interrupt ? interrupt->flag() : nullptr;
    options.device_results = results;
    started = StartObjective(config, tensors, outputs, options);
  }
  StartedObjective value = CancelledOrValue(std::move(started));
  auto state = std::make_unique<SavedHead>();
  state->saved = std::move(value.saved);
  state->on_cuda = tensors.hidden.on_cuda();
  // device_results too: the backward reads its status words and latches
  // a non-finite upstream there.
  for (py::handle t : {hidden, weight, bias, teacher_hidden,
                       confidence_logits, correction_inputs,
                       correction_weight, device_results}) {
    state->borrowed.push_back(py::reinterpret_borrow<py::object>(t));
  }
  state->borrowed.push_back(prepared);
  state->token = static_cast<int64_t>(reinterpret_cast<uintptr_t>(&state->token));
  return py::make_tuple(ResultOf(value.forward), std::move(state));
}

// A backward's gradient buffers, as SavedHead.backward takes them.
ObjectiveOutputs BackwardBuffersOf(py::handle grad_hidden,
                                   py::handle grad_weight, py::handle grad_bias,
                                   py::handle grad_confidence,
                                   py::handle grad_correction_inputs,
                                   py::handle grad_correction_weight) {
  ObjectiveOutputs gradients;
  gradients.grad_hidden = ArgOf("grad_hidden", grad_hidden);
  gradients.grad_weight = ArgOf("grad_weight", grad_weight);
  gradients.grad_bias = ArgOf("grad_bias", grad_bias);
  gradients.grad_confidence = ArgOf("grad_confidence", grad_confidence);
  gradients.grad_correction_inputs =
      ArgOf("grad_correction_inputs", grad_correction_inputs);
  gradients.grad_correction_weight =
      ArgOf("grad_correction_weight", grad_correction_weight);
  return gradients;
}

py::dict BackwardStatsOf(const HeadStats& stats) {
  py::dict d;
  d["gemm_calls"] = stats.gemm_calls;
  d["gemm_passes"] = stats.gemm_passes;
  d["segment_recomputes"] = stats.segment_recomputes;
  d["peak_bytes"] = stats.peak_bytes;
  d["backward_seconds"] = stats.backward_seconds;
  return d;
}

py::dict SavedBackwardOnDeviceFromPython(
    SavedHead& state, py::handle upstream, py::handle grad_hidden,
    py::handle grad_weight, py::handle grad_bias, py::handle grad_confidence,
    py::handle grad_correction_inputs, py::handle grad_correction_weight,
    bool of_loss_num, bool interruptible, uintptr_t cuda_stream) {
  const ObjectiveOutputs gradients = BackwardBuffersOf(
      grad_hidden, grad_weight, grad_bias, grad_confidence,
      grad_correction_inputs, grad_correction_weight);
  const TensorArg on_device = RequiredArgOf("upstream", upstream);
  absl::StatusOr<HeadStats> done;
  {
    std::optional<ScopedInterrupt> interrupt;
    if (interruptible) interrupt.emplace();
    py::gil_scoped_release release;
    done = state.saved->BackwardFromDevice(
        on_device, of_loss_num, gradients, cuda_stream,
        interrupt ? interrupt->flag() : nullptr);
  }
  return BackwardStatsOf(CancelledOrValue(std::move(done)));
}

void CheckObjectiveResultsFromPython(
    const v1::ObjectiveConfig& config, py::handle hidden, py::handle weight,
    py::handle target_ids, py::handle weight_mask, py::handle device_results,
    uintptr_t cuda_stream, py::handle bias, py::handle teacher_hidden,
    py::handle confidence_logits, py::handle correction_inputs,
    py::handle correction_weight) {
  const ObjectiveTensors tensors =
      TensorsOf(hidden, weight, target_ids, weight_mask, bias,
                teacher_hidden, confidence_logits, correction_inputs,
                correction_weight);
  const TensorArg results = RequiredArgOf("device_results", device_results);
  absl::Status latched;
  {
    py::gil_scoped_release release;
    latched = CheckObjectiveResults(config, tensors, results, cuda_stream);
  }
  if (!latched.ok()) Raise(latched);
}

// Where each value lies in a head.device_results buffer of blocks of
// `block_size` positions (losses/device_results.h): name -> (first index,
// count), the terms under the binding's keys (losses/chunk_terms.inc).
py::dict DeviceResultsLayout(int64_t block_size) {
  if (block_size < 1) {
    Raise(absl::InvalidArgumentError(absl::StrCat(
        "block_size: must be >= 1, got ", block_size)));
  }
  py::dict d;
  d["size"] = py::make_tuple(0, DeviceResultsSize(block_size));
  d["rows_status"] = py::make_tuple(int{kResultRowsStatus}, 1);
  d["loss_status"] = py::make_tuple(int{kResultLossStatus}, 1);
  d["loss"] = py::make_tuple(int{kResultLoss}, 1);
  d["loss_denominator"] = py::make_tuple(int{kResultDenominator}, 1);
  d["accuracy"] = py::make_tuple(int{kResultAccuracy}, 1);
  d["gradient_scale"] = py::make_tuple(int{kResultGradientScale}, 1);
  d["confidence_scale"] = py::make_tuple(int{kResultConfidenceScale}, 1);
  d["lk_kl_weight"] = py::make_tuple(int{kResultLkKlWeight}, 1);
  int summed = 0, position = 0, block = 0;
#define DFLASH_SUMMED_TERM(field, slot, dict, key) \
  d[key] = py::make_tuple(DeviceSummedResult(summed++), 1);
#define DFLASH_POSITION_TERM(field, slot, dict, key) \
  d[key] = py::make_tuple(                           \
      DevicePositionResult(position++, 0, block_size), block_size);
#define DFLASH_BLOCK_TERM(field, dict, key) \
  d[key] = py::make_tuple(DeviceBlockResult(block++, block_size), 1);
#include "losses/chunk_terms.inc"
  return d;
}

py::dict SavedBackwardFromPython(SavedHead& state, double upstream,
                             py::handle grad_hidden, py::handle grad_weight,
                             py::handle grad_bias, py::handle grad_confidence,
                             py::handle grad_correction_inputs,
                             py::handle grad_correction_weight,
                             bool interruptible, uintptr_t cuda_stream) {
  const ObjectiveOutputs gradients = BackwardBuffersOf(
      grad_hidden, grad_weight, grad_bias, grad_confidence,
      grad_correction_inputs, grad_correction_weight);
  absl::StatusOr<HeadStats> done;
  {
    std::optional<ScopedInterrupt> interrupt;
    if (interruptible) interrupt.emplace();
    py::gil_scoped_release release;
    done = state.saved->Backward(upstream, gradients, cuda_stream,
                                 interrupt ? interrupt->flag() : nullptr);
  }
  return BackwardStatsOf(CancelledOrValue(std::move(done)));
}

void TopKValueBackwardFromPython(const v1::ObjectiveConfig& config,
                                 py::handle hidden, py::handle weight,
                                 py::handle bias, py::handle top_k,
                                 py::handle top_k_values,
                                 py::handle grad_values, py::handle grad_hidden,
                                 py::handle grad_weight, py::handle grad_bias,
                                 bool trainable, uintptr_t cuda_stream,
                                 py::handle correction_inputs,
                                 py::handle correction_weight,
                                 py::handle grad_correction_inputs,
                                 py::handle grad_correction_weight) {
  const TopKBackwardTensors tensors{
      RequiredArgOf("hidden", hidden),
      RequiredArgOf("lm_head_weight", weight),
      ArgOf("lm_head_bias", bias),
      RequiredArgOf("top_k", top_k),
      RequiredArgOf("top_k_values", top_k_values),
      RequiredArgOf("grad_values", grad_values),
      RequiredArgOf("grad_hidden", grad_hidden),
      ArgOf("grad_weight", grad_weight),
      ArgOf("grad_bias", grad_bias),
      ArgOf("correction_inputs", correction_inputs),
      ArgOf("correction_weight", correction_weight),
      ArgOf("grad_correction_inputs", grad_correction_inputs),
      ArgOf("grad_correction_weight", grad_correction_weight)};
  absl::Status done;
  {
    py::gil_scoped_release release;
    done = RunTopKValueBackward(config, tensors, {trainable, cuda_stream});
  }
  if (!done.ok()) Raise(done);
}

// The binding's side of SetTorchAllocator: Python callables (torch's
// caching allocator) called with the GIL taken, as the head runs without
// it. Kept for the life of the process (never released at exit, when
// Python may be gone).
void SetTorchAllocatorFromPython(py::object allocate, py::object free) {
  if (allocate.is_none() && free.is_none()) {
    SetTorchAllocator(std::nullopt);
    return;
  }
  if (!PyCallable_Check(allocate.ptr()) || !PyCallable_Check(free.ptr())) {
    RaiseType(absl::StrCat(
        "set_torch_allocator: allocate and free must both be callables, or "
        "both None, got ",
        std::string(py::str(allocate.get_type())), " and ",
        std::string(py::str(free.get_type()))));
  }
  auto* allocate_fn = new py::object(allocate);
  auto* free_fn = new py::object(free);
  TorchAllocator allocator;
  allocator.allocate = [allocate_fn](int64_t bytes, int device,
                                     uintptr_t stream)
      -> absl::StatusOr<uintptr_t> {
    py::gil_scoped_acquire gil;
    try {
      return (*allocate_fn)(bytes, device, stream).cast<uintptr_t>();
    } catch (py::error_already_set& error) {
      const std::string what = error.what();
      const std::string message = absl::StrCat(
          "allocating ", bytes, " bytes through torch's allocator: ", what);
      return error.matches(PyExc_MemoryError) ||
                     what.find("out of memory") != std::string::npos
                 ? absl::ResourceExhaustedError(message)
                 : absl::InternalError(message);
    } catch (const py::cast_error&) {
      return absl::InternalError(
          "torch's allocator returned something other than an address");
    }
  };
  allocator.free = [free_fn](uintptr_t data) {
    py::gil_scoped_acquire gil;
    try {
      (*free_fn)(data);
    } catch (py::error_already_set& error) {
      // Nothing to report it to: a failed free leaks, as torch's own do.
      error.discard_as_unraisable("dflash: torch's allocator free");
    }
  };
  SetTorchAllocator(std::move(allocator));
}

// os.fork() holds the GIL through fork(), whose prepare handler waits for
// the library calls in progress (base/threads.h); a call may need the GIL
// to finish (a vocab-parallel exchange, torch's allocator) and would never
// get it. This before-fork hook does that wait with the GIL released, so
// such a call finishes, and fork() then waits no more: the child still
// inherits no call's locks or caches. Between this hook and fork() the
// thread takes the GIL back and runs the other hooks; a fork() that
// another thread makes meanwhile without hooks (C code, with the GIL held)
// shares the hold rather than waiting for it. (Releasing the library's locks
// around the callback instead would let another run start on the shared
// host allocator and thread pools mid-run.) Hence every entry point takes
// ScopedLibraryCall with the GIL released: one that waited for this hook
// holding the GIL would keep it from taking the GIL back. Python runs
// before-fork hooks newest first; logging's, which holds its module lock
// (a callback that logs may need it) through the hooks after it, is made
// to come first so that it runs after this one.
void RegisterForkHook() {
  py::module_::import("logging");
  const py::module_ os = py::module_::import("os");
  if (!py::hasattr(os, "register_at_fork")) return;
  os.attr("register_at_fork")(py::arg("before") = py::cpp_function([] {
                                py::gil_scoped_release release;
                                HoldCallsForFork();
                              }));
}

}  // namespace
}  // namespace dflash::python

PYBIND11_MODULE(_core, m) {
  namespace dp = dflash::python;
  namespace v1 = dflash::v1;
  using dflash::ParseObjectiveConfig;
  using dflash::ToTextFormat;

  m.doc() = "dflash's C++ heads and configs; use dflash and dflash.torch.";

  py::class_<v1::ObjectiveConfig>(
      m, "ObjectiveConfig",
      "A dflash.v1.ObjectiveConfig (proto/objective.proto). The tensors fill "
      "the layout and head sizes at each call; defaults are resolved and the "
      "whole config validated then.")
      .def_static(
          "default", [] { return dp::ValueOrRaise(dp::DefaultConfig()); },
          "configs/dflash_default.textproto: dflash loss, gamma 7, chunks of "
          "128 blocks, fused head.")
      .def_static(
          "from_text",
          [](const std::string& text, const std::string& source) {
            return dp::ValueOrRaise(ParseObjectiveConfig(text, source));
          },
          py::arg("text"), py::arg("source") = "<string>",
          "Parses protobuf text format.")
      .def_static(
          "from_file",
          [](const std::string& path) {
            return dp::ValueOrRaise(dp::ConfigFromFile(path));
          },
          py::arg("path"), "Parses a text-format file.")
      .def(
          "with_overrides",
          [](const v1::ObjectiveConfig& config, const py::kwargs& kwargs) {
            v1::ObjectiveConfig changed = config;
            const absl::Status applied =
                dflash::ApplyOverrides(dp::OverridesOf(kwargs),
                                       dflash::OverrideNames::kKeywords,
                                       changed);
            if (!applied.ok()) dp::Raise(applied);
            return changed;
          },
          "A copy with keyword overrides: loss_type, lk_loss_type, "
          "kl_scale, kl_decay, gamma, mode, "
          "chunk_blocks, segment_chunks, threads, ignore_index, "
          "label_smoothing, z_loss_scale.")
      .def_property_readonly(
          "text",
          [](const v1::ObjectiveConfig& config) {
            return ToTextFormat(config);
          },
          "The config in text format, as given (defaults not filled).")
      .def_property_readonly(
          "loss_den_offset",
          [](const v1::ObjectiveConfig& config) {
            return dflash::LossDenOffset(
                dflash::LossParamsOf(config.loss()).family);
          },
          "What the loss family adds to the summed loss_den before dividing "
          "(domino's 1e-6, else 0): a run's loss_den_offset, known without "
          "running it.")
      .def("checkpoint_policy", &dp::CheckpointPolicyOf,
           "The checkpoint policy as a dict: rules (preset expanded; each "
           "kind, name, weight_frozen, input_requires_grad, action, None "
           "where unset), default_action, memory_budget_bytes, "
           "segment_chunks.")
      .def("__repr__", [](const v1::ObjectiveConfig& config) {
        return absl::StrCat("ObjectiveConfig('''", ToTextFormat(config),
                            "''')");
      });

  m.def("run_objective", &dp::RunObjectiveFromPython, py::arg("config"),
        py::arg("hidden"), py::arg("weight"), py::arg("target_ids"),
        py::arg("weight_mask"), py::arg("bias"), py::arg("teacher_hidden"),
        py::arg("confidence_logits"), py::arg("grad_hidden"),
        py::arg("grad_weight"), py::arg("grad_bias"),
        py::arg("grad_confidence"), py::arg("neg_log_q"), py::arg("argmax"),
        py::arg("top_k"), py::arg("top_k_values"), py::arg("loss_weight"),
        py::arg("correction_inputs"), py::arg("correction_weight"),
        py::arg("grad_correction_inputs"), py::arg("grad_correction_weight"),
        py::arg("prepared").none(true), py::arg("trainable"),
        py::arg("cuda_stream"), py::arg("interruptible") = false,
        py::arg("forward_only") = false,
        py::arg("vocab_shard").none(true) = py::none(),
        py::arg("base_argmax").none(true) = py::none(),
        py::arg("teacher_argmax").none(true) = py::none(),
        py::arg("device_results").none(true) = py::none(),
        "Runs the head once, forward and backward, into the given buffers; "
        "gradients are of loss_num / loss_denominator. With forward_only the "
        "forward pass alone: no gradient buffer (every grad_* None), no "
        "gradient GEMM. Returns the terms and stats. "
        "The GIL is released while it runs; with interruptible (a call from "
        "the main thread under Python's default SIGINT handler) Ctrl-C stops "
        "it before its next GEMM and raises KeyboardInterrupt. With "
        "vocab_shard (a VocabShard) the weight, bias and correction weight "
        "are this process's rows of the vocabulary, the ids global, and the "
        "gradient of hidden (and of correction_inputs) this process's part "
        "of a sum over the shard's processes. With head.device_results "
        "(CUDA, ALL_ROWS) the terms go to device_results, a float64 tensor "
        "laid out as device_results_layout says, and the run never waits "
        "for the device (the returned terms are NaN; "
        "check_objective_results raises its error).");
  m.def("start_objective", &dp::StartObjectiveFromPython, py::arg("config"),
        py::arg("hidden"), py::arg("weight"), py::arg("target_ids"),
        py::arg("weight_mask"), py::arg("bias"), py::arg("teacher_hidden"),
        py::arg("confidence_logits"), py::arg("neg_log_q"), py::arg("argmax"),
        py::arg("top_k"), py::arg("top_k_values"), py::arg("loss_weight"),
        py::arg("correction_inputs"), py::arg("correction_weight"),
        py::arg("prepared").none(true), py::arg("trainable"),
        py::arg("interruptible") = false,
        py::arg("base_argmax").none(true) = py::none(),
        py::arg("teacher_argmax").none(true) = py::none(),
        py::arg("cuda_stream") = 0,
        py::arg("device_results").none(true) = py::none(),
        "The forward pass of a split run (a mode other than FUSED, "
        "gradients wanted, no vocab shard; splits_backward): run_objective's "
        "checks and row outputs, no gradient buffer; CUDA tensors' work "
        "ordered on cuda_stream. Returns (the terms and stats, a SavedHead "
        "whose backward gives the gradients).");
  m.def(
      "splits_backward",
      [](const v1::ObjectiveConfig& config) {
        // The mode alone decides, on either device (start_objective takes
        // CPU and CUDA tensors alike).
        dflash::HeadOptions options;
        return dflash::SplitsBackward(
            dflash::ResolveDefaults(config), options);
      },
      py::arg("config"),
      "Whether a run of this config with gradients and no vocab shard "
      "splits its forward and backward (start_objective): every mode but "
      "FUSED.");
  py::class_<dp::SavedHead>(
      m, "SavedHead", py::buffer_protocol(),
      "A split forward's state, kept for its backward. Its buffer is 8 "
      "bytes, an int64 naming it: torch.frombuffer ties the state to a "
      "tensor (the token).")
      .def_buffer([](dp::SavedHead& state) {
        return py::buffer_info(&state.token, sizeof(int64_t),
                               py::format_descriptor<int64_t>::format(), 1,
                               {1}, {sizeof(int64_t)});
      })
      .def_readwrite("stats", &dp::SavedHead::stats,
                     "What the caller keeps with the state (dflash.torch: "
                     "the forward's stats, to which backward adds its work); "
                     "None at first.")
      .def_property_readonly(
          "saved_bytes",
          [](const dp::SavedHead& state) {
            py::gil_scoped_release release;  // As ~SavedHead.
            return state.saved->saved_bytes();
          },
          "Bytes the state holds between the passes: of the host "
          "allocator on the CPU, of the device on CUDA.")
      .def("backward", &dp::SavedBackwardFromPython, py::arg("upstream"),
           py::arg("grad_hidden"), py::arg("grad_weight").none(true),
           py::arg("grad_bias").none(true),
           py::arg("grad_confidence").none(true),
           py::arg("grad_correction_inputs").none(true),
           py::arg("grad_correction_weight").none(true),
           py::arg("interruptible") = false, py::arg("cuda_stream") = 0,
           "d(upstream * loss_num / loss_denominator)/d(.) into the given "
           "buffers (overwritten); repeatable. CUDA: ordered on cuda_stream "
           "(torch's current stream now). Returns this pass's stats "
           "(gemm_calls, gemm_passes, segment_recomputes so far, peak_bytes "
           "above the level before the forward, backward_seconds). The GIL "
           "is released while it runs.")
      .def("backward_on_device", &dp::SavedBackwardOnDeviceFromPython,
           py::arg("upstream"), py::arg("grad_hidden"),
           py::arg("grad_weight").none(true), py::arg("grad_bias").none(true),
           py::arg("grad_confidence").none(true),
           py::arg("grad_correction_inputs").none(true),
           py::arg("grad_correction_weight").none(true),
           py::arg("of_loss_num") = true, py::arg("interruptible") = false,
           py::arg("cuda_stream") = 0,
           "backward with upstream a one-value float32 or float64 CUDA "
           "tensor, read on the device (a state started with "
           "device_results): d(objective)/d(loss_num) with of_loss_num (the "
           "head multiplies it by the loss denominator there), else "
           "d(objective)/d(loss). Neither reads the device nor waits.");
  m.def("check_objective_results", &dp::CheckObjectiveResultsFromPython,
        py::arg("config"), py::arg("hidden"), py::arg("weight"),
        py::arg("target_ids"), py::arg("weight_mask"),
        py::arg("device_results"), py::arg("cuda_stream"),
        py::arg("bias").none(true) = py::none(),
        py::arg("teacher_hidden").none(true) = py::none(),
        py::arg("confidence_logits").none(true) = py::none(),
        py::arg("correction_inputs").none(true) = py::none(),
        py::arg("correction_weight").none(true) = py::none(),
        "After a run with device_results: raises the error run_objective "
        "would have raised without them (same type and message), read from "
        "the buffer's status words after the work queued on cuda_stream "
        "(one wait); returns None where the run latched none.");
  m.def("device_results_layout", &dp::DeviceResultsLayout,
        py::arg("block_size"),
        "Where each value of a device_results buffer lies for blocks of "
        "block_size positions: name -> (first index, count); 'size' is "
        "(0, the buffer's length). The status words hold 64-bit codes, "
        "all ones where no error was latched.");
  m.def("top_k_value_backward", &dp::TopKValueBackwardFromPython,
        py::arg("config"), py::arg("hidden"), py::arg("weight"),
        py::arg("bias"), py::arg("top_k"), py::arg("top_k_values"),
        py::arg("grad_values"), py::arg("grad_hidden"), py::arg("grad_weight"),
        py::arg("grad_bias"), py::arg("trainable"), py::arg("cuda_stream"),
        py::arg("correction_inputs") = py::none(),
        py::arg("correction_weight") = py::none(),
        py::arg("grad_correction_inputs") = py::none(),
        py::arg("grad_correction_weight") = py::none(),
        "Adds d(objective)/d(top-k values) to grad_hidden (and grad_weight, "
        "grad_bias when trainable) in place: the sparse update "
        "sum_j g * dz'/dz * W[id]. With the forward's correction (z, M) the "
        "values hold z . M[id] too, and its gradients are added to "
        "grad_correction_inputs and grad_correction_weight where given. The "
        "GIL is released while it runs.");
  py::class_<dp::PreparedHandle>(
      m, "PreparedProjection",
      "A frozen float32 CPU lm_head weight (and bias) laid out once in "
      "oneDNN's blocked format, for every run it is given to "
      "(dflash_objective(prepared_projection=...)). A weight changed in place "
      "since (even through .data) is found by its checksum at the next call "
      "and laid out again there.")
      .def(py::init([](py::object weight, py::object bias, py::handle threads) {
             const int64_t count =
                 dp::Cast<int64_t>("threads", threads, "an int");
             if (count < 0 || count > dflash::kMaxThreads) {
               dp::Raise(absl::InvalidArgumentError(absl::StrCat(
                   "threads: must lie in [0, ", dflash::kMaxThreads,
                   "] (0: every usable CPU), got ", count)));
             }
             const dp::TensorArg w = dp::RequiredArgOf("lm_head_weight", weight);
             const std::optional<dp::TensorArg> b =
                 dp::ArgOf("lm_head_bias", bias);
             absl::StatusOr<std::unique_ptr<dflash::PreparedProjection>> made;
             {
               py::gil_scoped_release release;
               made = dp::PrepareProjection(w, b, static_cast<int>(count));
             }
             auto handle = std::make_unique<dp::PreparedHandle>();
             handle->projection = dp::ValueOrRaise(std::move(made));
             handle->weight = weight;
             handle->bias = bias;
             return handle;
           }),
           py::arg("lm_head_weight"), py::arg("lm_head_bias") = py::none(),
           py::arg("threads") = 0)
      .def_property_readonly(
          "packed_bytes",
          [](const dp::PreparedHandle& h) {
            return h.projection->packed_bytes();
          })
      .def_property_readonly("prepare_seconds",
                             [](const dp::PreparedHandle& h) {
                               return h.projection->prepare_seconds();
                             });
  py::class_<dp::VocabShardHandle>(
      m, "VocabShard",
      "This process's part of a vocabulary split across processes (the "
      "vocab-parallel head, losses/vocab_shard.h): rows [offset, offset + "
      "the weight's rows) of vocab classes, and the exchange the loss merges "
      "the processes' row records through: all_gather(local, out), local "
      "and out float64 memoryviews of n and size * n values, out filled "
      "with every process's local in rank order. dflash.torch makes one per "
      "call from vocab_group.")
      .def(py::init([](py::handle offset, py::handle vocab, py::handle rank,
                       py::handle size, py::object all_gather) {
             const int64_t o = dp::Cast<int64_t>("offset", offset, "an int");
             const int64_t v = dp::Cast<int64_t>("vocab", vocab, "an int");
             const int64_t r = dp::Cast<int64_t>("rank", rank, "an int");
             const int64_t w = dp::Cast<int64_t>("size", size, "an int");
             if (w < 1 || w > (1 << 20) || r < 0 || r >= w) {
               dp::Raise(absl::InvalidArgumentError(absl::StrCat(
                   "rank, size: must satisfy 0 <= rank < size, got rank ", r,
                   " of size ", w)));
             }
             if (v < 1 || o < 0 || o >= v) {
               dp::Raise(absl::InvalidArgumentError(absl::StrCat(
                   "offset: must lie in [0, vocab = ", v, "), got ", o)));
             }
             if (!PyCallable_Check(all_gather.ptr())) {
               dp::RaiseType(absl::StrCat(
                   "all_gather: must be callable, got ",
                   std::string(py::str(all_gather.get_type()))));
             }
             return std::make_unique<dp::VocabShardHandle>(
                 o, v, static_cast<int>(r), static_cast<int>(w),
                 std::move(all_gather));
           }),
           py::arg("offset"), py::arg("vocab"), py::arg("rank"),
           py::arg("size"), py::arg("all_gather"))
      .def_property_readonly(
          "offset",
          [](const dp::VocabShardHandle& h) { return h.shard.offset; })
      .def_property_readonly(
          "vocab", [](const dp::VocabShardHandle& h) { return h.shard.vocab; })
      .def_property_readonly(
          "rank", [](const dp::VocabShardHandle& h) { return h.exchange.rank(); })
      .def_property_readonly(
          "size", [](const dp::VocabShardHandle& h) { return h.exchange.size(); })
      .def("all_gather",
           [](dp::VocabShardHandle& h, const std::vector<double>& local) {
             std::vector<double> out(local.size() *
                                     static_cast<size_t>(h.exchange.size()));
             absl::Status done = h.exchange.AllGather(local, absl::MakeSpan(out));
             if (!done.ok()) dp::Raise(done);
             return out;
           },
           py::arg("local"),
           "The exchange as the head calls it (for tests): every process's "
           "local values in rank order; a failure of the callable is a "
           "RuntimeError.")
      .def_property_readonly(
          "runs", [](const dp::VocabShardHandle& h) { return h.runs; },
          "How many runs (run_objective calls) this shard entered.")
      .def(
          "refuse",
          [](dp::VocabShardHandle& h, py::handle error) {
            // Named by its kind, as the others will see its code; a
            // __str__ that raises must not keep the refusal from going.
            std::string what = "an exception whose message cannot be read";
            try {
              what = absl::StrCat(
                  std::string(py::str(error.get_type().attr("__name__"))),
                  ": ", std::string(py::str(error)));
            } catch (...) {
              PyErr_Clear();
            }
            absl::Status refusal;
            if (PyErr_GivenExceptionMatches(error.ptr(), PyExc_MemoryError)) {
              refusal = absl::ResourceExhaustedError(what);
            } else if (PyErr_GivenExceptionMatches(
                           error.ptr(), PyExc_KeyboardInterrupt)) {
              refusal = absl::CancelledError(what);
            } else {
              refusal = absl::InvalidArgumentError(what);
            }
            h.exchange.Reset();
            py::gil_scoped_release release;
            dflash::SendError(h.exchange, refusal).IgnoreError();
          },
          py::arg("error"),
          "Sends this process's refusal of a call (the exception `error` "
          "raised after the group's agreement, before run_objective) in a "
          "record shaped like the run's handshake, where the others wait: "
          "they raise naming this process. The caller then raises `error`.")
      .def(
          "gather_status",
          [](dp::VocabShardHandle& h) {
            h.exchange.Reset();
            std::vector<double> record(dflash::kHandshakeSize), gathered;
            absl::Status status;
            {
              py::gil_scoped_release release;
              status = dflash::GatherRecords(h.exchange, absl::OkStatus(),
                                             absl::MakeSpan(record), gathered);
            }
            dp::RaiseOwnExchangeError(h.exchange);
            if (!status.ok()) dp::Raise(status);
          },
          "One gather shaped like the run's handshake in which every "
          "process says it is ready: where another process sent its refusal "
          "(refuse) instead, raises the error naming it on this one. Python "
          "steps with collectives of their own (rows=\"local\"'s row "
          "gathers) start after it, so a refusal before them meets it.");
  m.def("set_cuda_library_dirs", &dp::SetCudaLibraryDirs, py::arg("dirs"),
        "Folders where the CUDA head looks for cuBLAS first, before the "
        "system's library path and the build's toolkit.");
  m.def("set_torch_allocator", &dp::SetTorchAllocatorFromPython,
        py::arg("allocate"), py::arg("free"),
        "Lends the CUDA head an allocator: allocate(bytes, device, stream) "
        "-> address and free(address) (torch.cuda.caching_allocator_alloc "
        "and caching_allocator_delete), so torch's memory statistics count "
        "its workspaces; CUDA runs then queue on torch's stream itself. "
        "Both None: the head's own stream and pool again. Does nothing in a "
        "build without CUDA.");
  m.def("built_with_cuda", &dp::BuiltWithCuda,
        "Whether this build runs CUDA tensors.");
  m.def("release_cached_memory", &dp::ReleaseCachedHostMemory,
        py::call_guard<py::gil_scoped_release>(),
        "Returns the host workspaces CPU runs keep between calls.");
  dp::RegisterForkHook();
}
