// The binding's own logic: how tensors are described, checked and turned
// into rows, and how keyword overrides change a config. The numbers the head
// computes are checked from Python against an independent reference.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/config.h"
#include "proto/config_overrides.h"
#include "python/native/config_sources.h"
#include "python/native/interrupt.h"
#include "python/native/objective.h"
#include "python/native/tensor_arg.h"

namespace dflash::python {
namespace {

using ::testing::HasSubstr;

template <typename T>
TensorArg Arg(const char* name, std::vector<T>& data, const char* dtype,
              std::vector<int64_t> shape, std::vector<int64_t> strides = {}) {
  TensorArg arg;
  arg.name = name;
  arg.data = reinterpret_cast<uintptr_t>(data.data());
  arg.dtype = dtype;
  arg.shape = shape;
  if (strides.empty()) {
    strides.assign(shape.size(), 1);
    for (int64_t i = static_cast<int64_t>(shape.size()) - 2; i >= 0; --i) {
      strides[i] = strides[i + 1] * shape[i + 1];
    }
  }
  arg.strides = strides;
  return arg;
}

TEST(TensorArgTest, ContiguityIgnoresUnitDimensions) {
  std::vector<float> data(6);
  EXPECT_TRUE(Arg("x", data, "float32", {2, 3}).contiguous());
  EXPECT_TRUE(Arg("x", data, "float32", {2, 1, 3}, {3, 99, 1}).contiguous());
  EXPECT_FALSE(Arg("x", data, "float32", {2, 3}, {1, 2}).contiguous());
  const absl::Status status =
      ExpectContiguous(Arg("hidden", data, "float32", {2, 3}, {1, 2}));
  EXPECT_THAT(status.message(),
              HasSubstr("hidden: must be contiguous (dflash reads it in "
                        "place; call .contiguous(), one copy), got strides "
                        "(1, 2) for shape (2, 3)"));
}

TEST(TensorArgTest, MessagesNameArgumentValueAndExpectation) {
  std::vector<int64_t> data(6);
  const absl::string_view floats[] = {"float32", "float64"};
  EXPECT_EQ(ExpectDType(Arg("hidden", data, "int64", {6}), floats, "on the CPU")
                .message(),
            "hidden: must be float32 or float64 (on the CPU), got int64");
  EXPECT_EQ(ExpectShape(Arg("bias", data, "int64", {6}), {5}, "[V]").message(),
            "bias: must have shape [V] = (5,), got (6,)");
  TensorArg cuda = Arg("w", data, "float32", {6});
  cuda.device = "cuda:1";
  EXPECT_TRUE(cuda.on_cuda());
  EXPECT_EQ(cuda.cuda_index(), 1);
  EXPECT_EQ(ExpectDevice(cuda, "cpu", "hidden's device").message(),
            "w: must be on cpu (hidden's device), got cuda:1");
}

TEST(RowsOfTest, RowsAreBlocksOfPositionsAtAnyStrides) {
  // [B=1, N=2, K=3] targets stored transposed ([K, N] memory), a bool mask.
  std::vector<int64_t> ids = {5, 8, 6, 9, 7, -100};  // ids[k][n]
  std::vector<uint8_t> mask = {1, 1, 0, 1, 1, 1};
  const TensorArg target_ids =
      Arg("target_ids", ids, "int64", {1, 2, 3}, {6, 1, 2});
  const TensorArg weight_mask = Arg("weight_mask", mask, "bool", {1, 2, 3});
  absl::StatusOr<std::vector<RowMeta>> rows =
      RowsOf(target_ids, weight_mask, /*vocab=*/10, /*ignore_index=*/-100);
  ASSERT_TRUE(rows.ok()) << rows.status();
  ASSERT_EQ(rows->size(), 6u);
  const int32_t targets[] = {5, 6, 0, 8, 9, 0};  // Masked and ignored: 0.
  const float masks[] = {1, 1, 0, 1, 1, 0};      // Ignored: no weight.
  for (int r = 0; r < 6; ++r) {
    EXPECT_EQ((*rows)[r].target, targets[r]) << r;
    EXPECT_EQ((*rows)[r].mask, masks[r]) << r;
    EXPECT_EQ((*rows)[r].position, r % 3) << r;
    EXPECT_EQ((*rows)[r].block, r / 3) << r;
  }
  // Counted (ignored_target_weight COUNT): the ignored row keeps its mask
  // and its target; the rest as before.
  rows = RowsOf(target_ids, weight_mask, 10, -100, /*count_ignored=*/true);
  ASSERT_TRUE(rows.ok()) << rows.status();
  EXPECT_EQ((*rows)[5].target, -100);
  EXPECT_EQ((*rows)[5].mask, 1);
  for (int r = 0; r < 5; ++r) {
    EXPECT_EQ((*rows)[r].target, targets[r]) << r;
    EXPECT_EQ((*rows)[r].mask, masks[r]) << r;
  }
}

TEST(RowsOfTest, BadTargetsAndMasksNameTheElement) {
  std::vector<int64_t> ids = {0, 1, 10, 3};
  std::vector<float> mask = {0, 1, 1, 1};
  const TensorArg target_ids = Arg("target_ids", ids, "int64", {1, 2, 2});
  EXPECT_EQ(RowsOf(target_ids, Arg("weight_mask", mask, "float32", {1, 2, 2}),
                   10, -100)
                .status()
                .message(),
            "target_ids[0, 1, 0]: must lie in [0, V = 10) or be ignore_index "
            "(-100) where weight_mask > 0, got 10");
  mask[1] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(RowsOf(target_ids, Arg("weight_mask", mask, "float32", {1, 2, 2}),
                   10, -100)
                .status()
                .message(),
            "weight_mask[0, 0, 1]: must be finite and >= 0, got nan");
}

TEST(RowsOfTest, MasksInTheTermsDtype) {
  std::vector<int64_t> ids = {0, 1};
  std::vector<double> mask = {1.0 / 3, 0.1};
  const TensorArg target_ids = Arg("target_ids", ids, "int64", {1, 1, 2});
  const TensorArg weight_mask = Arg("weight_mask", mask, "float64", {1, 1, 2});
  // A float64 run keeps float64 masks exactly; a float32 run rounds them.
  absl::StatusOr<std::vector<RowMeta>> rows =
      RowsOf(target_ids, weight_mask, 10, -100, false, /*float64_terms=*/true);
  ASSERT_TRUE(rows.ok()) << rows.status();
  EXPECT_EQ((*rows)[0].mask, 1.0 / 3);
  EXPECT_EQ((*rows)[1].mask, 0.1);
  rows = RowsOf(target_ids, weight_mask, 10, -100);
  ASSERT_TRUE(rows.ok()) << rows.status();
  EXPECT_EQ((*rows)[0].mask, static_cast<double>(1.0f / 3));
  EXPECT_EQ((*rows)[1].mask, static_cast<double>(0.1f));
  // Their sum may then exceed float32, not float64.
  mask[0] = mask[1] = 3e38;
  EXPECT_TRUE(RowsOf(target_ids, weight_mask, 10, -100, false, true).ok());
  EXPECT_EQ(RowsOf(target_ids, weight_mask, 10, -100).status().message(),
            "weight_mask: its values sum to more than float32 holds "
            "(3.40282e+38) by weight_mask[0, 0, 1] = 3e+38; the loss and "
            "accuracy denominators would be inf");
  mask[0] = mask[1] = 1e308;
  EXPECT_EQ(RowsOf(target_ids, weight_mask, 10, -100, false, true)
                .status()
                .message(),
            "weight_mask: its values sum to more than float64 holds "
            "(1.79769e+308) by weight_mask[0, 0, 1] = 1e+308; the loss and "
            "accuracy denominators would be inf");
}

TEST(ConfigFromFileTest, NamesTheFileAndTheReason) {
  EXPECT_EQ(ConfigFromFile("/nonexistent.textproto").status().message(),
            "config: /nonexistent.textproto: cannot open: No such file or "
            "directory");
  EXPECT_EQ(ConfigFromFile("/dev/zero").status().message(),
            "config: /dev/zero: is a character device, expected a regular "
            "file");
}

// B=1, N=2, K=2, H=3, V=5 on the CPU.
struct Tiny {
  std::vector<float> hidden = std::vector<float>(12, 0.5f);
  std::vector<float> weight = std::vector<float>(15, 0.25f);
  std::vector<float> teacher = std::vector<float>(12, 0.5f);
  std::vector<int64_t> ids = {0, 1, 2, 3};
  std::vector<float> mask = {0, 1, 0, 1};
  std::vector<float> grad = std::vector<float>(12);

  ObjectiveTensors Tensors() {
    return {Arg("hidden", hidden, "float32", {1, 2, 2, 3}),
            Arg("lm_head_weight", weight, "float32", {5, 3}),
            Arg("target_ids", ids, "int64", {1, 2, 2}),
            Arg("weight_mask", mask, "float32", {1, 2, 2})};
  }
  ObjectiveOutputs Outputs() {
    return {Arg("grad_hidden", grad, "float32", {1, 2, 2, 3})};
  }
};

TEST(BindConfigTest, TensorsDecideShapesDtypeAndBackend) {
  Tiny tiny;
  absl::StatusOr<v1::ObjectiveConfig> bound =
      BindConfig(*DefaultConfig(), tiny.Tensors(), /*trainable=*/false);
  ASSERT_TRUE(bound.ok()) << bound.status();
  EXPECT_EQ(bound->layout().block_size(), 2);
  EXPECT_EQ(bound->layout().num_anchors(), 2);
  EXPECT_EQ(bound->head().vocab_size(), 5);
  EXPECT_EQ(bound->head().hidden_size(), 3);
  EXPECT_EQ(bound->head().dtype(), v1::HeadConfig::FLOAT32);
  EXPECT_EQ(bound->head().backend(), v1::HeadConfig::CPU);
  EXPECT_FALSE(bound->head().bias());
}

// A teacher loss needs teacher_hidden; with another loss it asks for the
// teacher diagnostics.
TEST(BindConfigTest, TeacherMustMatchTheLoss) {
  Tiny tiny;
  ObjectiveTensors tensors = tiny.Tensors();
  tensors.teacher_hidden =
      Arg("teacher_hidden", tiny.teacher, "float32", {1, 2, 2, 3});
  absl::StatusOr<v1::ObjectiveConfig> diagnostics =
      BindConfig(*DefaultConfig(), tensors, false);
  ASSERT_TRUE(diagnostics.ok()) << diagnostics.status();
  EXPECT_TRUE(diagnostics->head().teacher_diagnostics());
  EXPECT_FALSE(BindConfig(*DefaultConfig(), tiny.Tensors(), false)
                   ->head()
                   .teacher_diagnostics());
  ConfigOverrides kl;
  kl.loss = "kl";
  v1::ObjectiveConfig config = *DefaultConfig();
  ASSERT_TRUE(ApplyOverrides(kl, OverrideNames::kKeywords, config).ok());
  EXPECT_FALSE(
      BindConfig(config, tensors, false)->head().teacher_diagnostics());
  EXPECT_EQ(BindConfig(config, tiny.Tensors(), false).status().message(),
            "teacher_hidden: loss.distillation reads the teacher's hidden "
            "states [B, N, K, H], got None");
}

// neg_log_q and loss_weight are float64 whatever hidden's dtype; the
// confidence logits and their gradient float64 beside float64 hidden, else
// float32 (ConfidenceOf).
TEST(RunObjectiveTest, RowOutputAndConfidenceDTypes) {
  Tiny tiny;
  std::vector<float> rows32(4);
  std::vector<double> rows64(4);
  for (const char* name : {"neg_log_q", "loss_weight"}) {
    ObjectiveOutputs outputs = tiny.Outputs();
    (std::string(name) == "neg_log_q" ? outputs.neg_log_q
                                      : outputs.loss_weight) =
        Arg(name, rows32, "float32", {1, 2, 2});
    EXPECT_EQ(RunObjective(*DefaultConfig(), tiny.Tensors(), outputs, {})
                  .status()
                  .message(),
              std::string(name) + ": must be float64, got float32");
  }
  std::vector<double> hidden(12, 0.5), weight(15, 0.25), grad(12);
  std::vector<double> mask = {0, 1, 0, 1};
  ObjectiveTensors t{Arg("hidden", hidden, "float64", {1, 2, 2, 3}),
                     Arg("lm_head_weight", weight, "float64", {5, 3}),
                     Arg("target_ids", tiny.ids, "int64", {1, 2, 2}),
                     Arg("weight_mask", mask, "float64", {1, 2, 2})};
  t.teacher_hidden = Arg("teacher_hidden", hidden, "float64", {1, 2, 2, 3});
  t.confidence_logits = Arg("confidence_logits", rows32, "float32", {1, 2, 2});
  ObjectiveOutputs o;
  o.grad_hidden = Arg("grad_hidden", grad, "float64", {1, 2, 2, 3});
  o.grad_confidence = Arg("grad_confidence", rows32, "float32", {1, 2, 2});
  absl::StatusOr<v1::ObjectiveConfig> config =
      ParseObjectiveConfig("loss { dspark { } }", "test");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(RunObjective(*config, t, o, {}).status().message(),
            "confidence_logits: must be float64 (the loss reads confidence "
            "logits in float64 beside float64 hidden, else in float32; hidden "
            "is float64), got float32");
  t.confidence_logits = Arg("confidence_logits", rows64, "float64", {1, 2, 2});
  EXPECT_EQ(RunObjective(*config, t, o, {}).status().message(),
            "grad_confidence: must be float64, got float32");
  std::vector<double> grad_confidence(4, 7);
  o.grad_confidence =
      Arg("grad_confidence", grad_confidence, "float64", {1, 2, 2});
  EXPECT_TRUE(RunObjective(*config, t, o, {}).ok());
}

TEST(RunObjectiveTest, ChecksEveryTensorBeforeWork) {
  Tiny tiny;
  ObjectiveTensors tensors = tiny.Tensors();
  tensors.weight.shape = {5, 4};
  EXPECT_EQ(RunObjective(*DefaultConfig(), tensors, tiny.Outputs(), {})
                .status()
                .message(),
            "lm_head_weight: must have shape [V, H] with V > 0 and H = 3 "
            "(hidden's last dimension), got (5, 4)");
  tensors = tiny.Tensors();
  tensors.hidden.device = "cuda:0";
  EXPECT_THAT(RunObjective(*DefaultConfig(), tensors, tiny.Outputs(), {})
                  .status()
                  .message(),
              HasSubstr("lm_head_weight: must be on cuda:0 (hidden's "
                        "device), got cpu"));
  tensors = tiny.Tensors();
  ObjectiveOutputs outputs = tiny.Outputs();
  EXPECT_EQ(
      RunObjective(*DefaultConfig(), tensors, outputs, {/*trainable=*/true})
          .status()
          .message(),
      "grad_weight: required (with a trainable head), got None");
}

// Row metadata lives on the CPU, or beside a CUDA hidden on its device;
// a third device is refused, naming the tensor, its device and hidden's.
TEST(RunObjectiveTest, MetadataOnTheCpuOrHiddensDevice) {
  Tiny tiny;
  ObjectiveTensors tensors = tiny.Tensors();
  tensors.target_ids.device = "cuda:0";
  EXPECT_EQ(RunObjective(*DefaultConfig(), tensors, tiny.Outputs(), {})
                .status()
                .message(),
            "target_ids: must be on the CPU as hidden is, got cuda:0");
  tensors = tiny.Tensors();
  tensors.hidden.device = "cuda:0";
  tensors.weight.device = "cuda:0";
  tensors.weight_mask.device = "cuda:1";
  EXPECT_EQ(RunObjective(*DefaultConfig(), tensors, tiny.Outputs(), {})
                .status()
                .message(),
            "weight_mask: must be on the CPU or on hidden's device (cuda:0), "
            "got cuda:1");
  tensors.weight_mask.device = "cpu";
  tensors.target_ids.device = "cuda:1";
  EXPECT_EQ(RunObjective(*DefaultConfig(), tensors, tiny.Outputs(), {})
                .status()
                .message(),
            "target_ids: must be on the CPU or on hidden's device (cuda:0), "
            "got cuda:1");
}

TEST(RunObjectiveTest, RunsOnTheCpu) {
  Tiny tiny;
  absl::StatusOr<HeadResult> result =
      RunObjective(*DefaultConfig(), tiny.Tensors(), tiny.Outputs(), {});
  ASSERT_TRUE(result.ok()) << result.status();
  // Two weighted rows at k = 1 (no decay), uniform logits: loss log(5).
  EXPECT_DOUBLE_EQ(result->terms.loss_den, 2);
  EXPECT_NEAR(result->terms.loss_num, 2 * std::log(5.0), 1e-5);
}

// The exchange of a group of one process: its own values.
class SelfExchange final : public VocabExchange {
 public:
  explicit SelfExchange(int rank = 0, int size = 1)
      : rank_(rank), size_(size) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  absl::Status AllGather(absl::Span<const double> local,
                         absl::Span<double> out) override {
    std::copy(local.begin(), local.end(), out.begin());
    return absl::OkStatus();
  }

 private:
  int rank_, size_;
};

// A vocab shard passes to the head (one process holding the whole
// vocabulary: the plain run's terms); its range, exchange and rank are
// checked first, naming the field.
TEST(RunObjectiveTest, VocabShard) {
  Tiny tiny;
  absl::StatusOr<HeadResult> plain =
      RunObjective(*DefaultConfig(), tiny.Tensors(), tiny.Outputs(), {});
  ASSERT_TRUE(plain.ok()) << plain.status();
  SelfExchange exchange;
  VocabShard shard{0, 5, &exchange};
  ObjectiveOptions options;
  options.vocab_shard = &shard;
  absl::StatusOr<HeadResult> sharded =
      RunObjective(*DefaultConfig(), tiny.Tensors(), tiny.Outputs(), options);
  ASSERT_TRUE(sharded.ok()) << sharded.status();
  EXPECT_EQ(sharded->terms.loss_num, plain->terms.loss_num);
  EXPECT_EQ(sharded->terms.loss_den, plain->terms.loss_den);

  shard.offset = 1;
  EXPECT_EQ(RunObjective(*DefaultConfig(), tiny.Tensors(), tiny.Outputs(),
                         options)
                .status()
                .message(),
            "vocab_shard: rows [offset, offset + V) = [1, 6) of "
            "lm_head_weight must lie in the whole vocabulary [0, 5)");
  shard.offset = 0;
  shard.exchange = nullptr;
  EXPECT_EQ(RunObjective(*DefaultConfig(), tiny.Tensors(), tiny.Outputs(),
                         options)
                .status()
                .message(),
            "vocab_shard.exchange: required, got none");
  SelfExchange outside(/*rank=*/1, /*size=*/1);
  shard.exchange = &outside;
  EXPECT_EQ(RunObjective(*DefaultConfig(), tiny.Tensors(), tiny.Outputs(),
                         options)
                .status()
                .message(),
            "vocab_shard.exchange: rank must lie in [0, size) with size >= "
            "1, got rank 1 of 1");
  // Targets are checked against the whole vocabulary.
  std::vector<int64_t> ids = {0, 1, 2, 7};
  std::vector<float> mask = {0, 1, 0, 1};
  absl::StatusOr<std::vector<RowMeta>> rows =
      RowsOf(Arg("target_ids", ids, "int64", {1, 2, 2}),
             Arg("weight_mask", mask, "float32", {1, 2, 2}), /*vocab=*/8,
             /*ignore_index=*/-100);
  ASSERT_TRUE(rows.ok()) << rows.status();
  EXPECT_EQ((*rows)[3].target, 7);
}

// The exchange of a group of one process that, at its first gather,
// destroys a split state: what Python's garbage collector may do inside
// the binding's exchange callback, on the thread holding the host lock.
class DestroyingExchange final : public VocabExchange {
 public:
  explicit DestroyingExchange(std::unique_ptr<SavedObjective> victim)
      : victim_(std::move(victim)) {}
  int rank() const override { return 0; }
  int size() const override { return 1; }
  absl::Status AllGather(absl::Span<const double> local,
                         absl::Span<double> out) override {
    victim_.reset();
    std::copy(local.begin(), local.end(), out.begin());
    return absl::OkStatus();
  }
  bool destroyed() const { return victim_ == nullptr; }

 private:
  std::unique_ptr<SavedObjective> victim_;
};

// A split state destroyed inside a run on the same thread is freed when
// that run lets go of the host lock, not deadlocked on it; the lock is
// free afterwards. A watchdog fails the test rather than let it hang.
TEST(StartObjectiveTest, StateDestroyedInsideARunIsFreedAfterIt) {
  static std::atomic<bool> finished{false};
  std::thread([] {
    for (int i = 0; i < 300 && !finished.load(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    if (!finished.load()) {
      std::fprintf(stderr, "deadlock: a split state's destructor waits on "
                           "the host lock its own thread holds\n");
      std::fflush(stderr);
      _exit(3);
    }
  }).detach();
  ConfigOverrides save;  // SAVE_CHUNKS: the victim holds host memory.
  save.mode = "save";
  v1::ObjectiveConfig config = *DefaultConfig();
  ASSERT_TRUE(ApplyOverrides(save, OverrideNames::kKeywords, config).ok());
  Tiny tiny;
  ObjectiveOutputs no_gradients;
  absl::StatusOr<StartedObjective> victim =
      StartObjective(config, tiny.Tensors(), no_gradients, {});
  ASSERT_TRUE(victim.ok()) << victim.status();
  ASSERT_GT(victim->saved->saved_bytes(), 0);
  DestroyingExchange exchange(std::move(victim->saved));
  VocabShard shard{0, 5, &exchange};
  ObjectiveOptions options;
  options.vocab_shard = &shard;
  absl::StatusOr<HeadResult> sharded =
      RunObjective(config, tiny.Tensors(), tiny.Outputs(), options);
  ASSERT_TRUE(sharded.ok()) << sharded.status();
  EXPECT_TRUE(exchange.destroyed());
  // The lock was let go: a new split runs both passes.
  absl::StatusOr<StartedObjective> next =
      StartObjective(config, tiny.Tensors(), no_gradients, {});
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_TRUE(next->saved->Backward(1.0, tiny.Outputs(), 0, nullptr).ok());
  next->saved.reset();
  finished.store(true);
}

// forward_only: the training run's terms with no gradient buffer; a
// gradient buffer or a trainable head is refused, naming why.
TEST(RunObjectiveTest, RunsForwardOnly) {
  Tiny tiny;
  absl::StatusOr<HeadResult> train =
      RunObjective(*DefaultConfig(), tiny.Tensors(), tiny.Outputs(), {});
  ASSERT_TRUE(train.ok()) << train.status();
  ObjectiveOptions forward_only;
  forward_only.forward_only = true;
  absl::StatusOr<HeadResult> eval =
      RunObjective(*DefaultConfig(), tiny.Tensors(), {}, forward_only);
  ASSERT_TRUE(eval.ok()) << eval.status();
  EXPECT_EQ(eval->terms.loss_num, train->terms.loss_num);
  EXPECT_EQ(eval->terms.loss_den, train->terms.loss_den);
  EXPECT_LT(eval->stats.gemm_passes, train->stats.gemm_passes);
  EXPECT_EQ(
      RunObjective(*DefaultConfig(), tiny.Tensors(), tiny.Outputs(),
                   forward_only)
          .status()
          .message(),
      "grad_hidden: not expected (a forward-only run computes none), got a "
      "tensor");
  forward_only.trainable = true;
  EXPECT_THAT(
      RunObjective(*DefaultConfig(), tiny.Tensors(), {}, forward_only)
          .status()
          .message(),
      HasSubstr("trainable: a forward-only run computes no gradient"));
}

// A float64 run's top-k values are float64, the loss's logits at the
// head's ids as a naive float64 computation gives them (bias, correction,
// softcap); their backward takes float64 values and gradients; a float32
// buffer for them is refused, naming it.
TEST(RunObjectiveTest, TopKValuesInFloat64) {
  constexpr int64_t kRows = 4, kH = 3, kV = 7, kR = 2, kTop = 3;
  std::vector<double> hidden, weight, bias, z, m;
  for (int64_t i = 0; i < kRows * kH; ++i) hidden.push_back(std::sin(i + 1.0));
  for (int64_t i = 0; i < kV * kH; ++i) weight.push_back(std::cos(3.0 * i));
  for (int64_t i = 0; i < kV; ++i) bias.push_back(0.1 * i - 0.3);
  for (int64_t i = 0; i < kRows * kR; ++i) z.push_back(std::sin(2.0 * i));
  for (int64_t i = 0; i < kV * kR; ++i) m.push_back(0.5 * std::cos(i + 0.5));
  std::vector<int64_t> ids = {0, 1, 2, 3};
  std::vector<double> mask = {0, 1, 1, 1};
  ObjectiveTensors t{Arg("hidden", hidden, "float64", {1, 2, 2, kH}),
                     Arg("lm_head_weight", weight, "float64", {kV, kH}),
                     Arg("target_ids", ids, "int64", {1, 2, 2}),
                     Arg("weight_mask", mask, "float64", {1, 2, 2}),
                     Arg("lm_head_bias", bias, "float64", {kV})};
  t.correction_inputs = Arg("correction_inputs", z, "float64", {1, 2, 2, kR});
  t.correction_weight = Arg("correction_weight", m, "float64", {kV, kR});
  std::vector<double> grad(kRows * kH), grad_z(kRows * kR), grad_m(kV * kR);
  std::vector<int32_t> top(kRows * kTop);
  std::vector<double> values(kRows * kTop, -1);
  std::vector<float> float_values(kRows * kTop);
  ObjectiveOutputs o;
  o.grad_hidden = Arg("grad_hidden", grad, "float64", {1, 2, 2, kH});
  o.grad_correction_inputs =
      Arg("grad_correction_inputs", grad_z, "float64", {1, 2, 2, kR});
  o.grad_correction_weight =
      Arg("grad_correction_weight", grad_m, "float64", {kV, kR});
  o.top_k = Arg("top_k", top, "int32", {1, 2, 2, kTop});
  o.top_k_values =
      Arg("top_k_values", float_values, "float32", {1, 2, 2, kTop});
  absl::StatusOr<v1::ObjectiveConfig> config = ParseObjectiveConfig(
      "head { logit_softcap: 2.5 } loss { dflash { gamma: 7 } }", "test");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(RunObjective(*config, t, o, {}).status().message(),
            "top_k_values: must be float64, got float32");
  o.top_k_values = Arg("top_k_values", values, "float64", {1, 2, 2, kTop});
  absl::StatusOr<HeadResult> result = RunObjective(*config, t, o, {});
  ASSERT_TRUE(result.ok()) << result.status();
  auto logit = [&](int64_t r, int32_t id) {
    double x = bias[id];
    for (int64_t i = 0; i < kH; ++i) {
      x += hidden[r * kH + i] * weight[id * kH + i];
    }
    for (int64_t i = 0; i < kR; ++i) x += z[r * kR + i] * m[id * kR + i];
    return 2.5 * std::tanh(x / 2.5);
  };
  for (int64_t r = 0; r < kRows; ++r) {
    for (int64_t j = 0; j < kTop; ++j) {
      const int32_t id = top[r * kTop + j];
      if (r == 0) {  // No mask: no ids, value 0.
        EXPECT_EQ(id, -1);
        EXPECT_EQ(values[r * kTop + j], 0);
        continue;
      }
      ASSERT_GE(id, 0);
      const double want = logit(r, id);
      EXPECT_NEAR(values[r * kTop + j], want, 1e-14 * std::abs(want))
          << r << ", " << j;
      // The strict top-k: each id's logit is at least the next one's.
      if (j + 1 < kTop) {
        EXPECT_GE(want, logit(r, top[r * kTop + j + 1]));
      }
    }
  }
  // Backward of sum(values * g): grad_hidden[r] += g * dz'/dz * W[id].
  std::vector<double> grad_values(kRows * kTop);
  for (size_t i = 0; i < grad_values.size(); ++i) grad_values[i] = 0.25 + i;
  std::vector<double> dh(kRows * kH, 0);
  TopKBackwardTensors back{t.hidden, t.weight, t.bias, *o.top_k,
                           *o.top_k_values};
  back.grad_values =
      Arg("grad_values", grad_values, "float64", {1, 2, 2, kTop});
  back.grad_hidden = Arg("grad_hidden", dh, "float64", {1, 2, 2, kH});
  ASSERT_TRUE(RunTopKValueBackward(*config, back, {}).ok());
  for (int64_t r = 0; r < kRows; ++r) {
    for (int64_t i = 0; i < kH; ++i) {
      double want = 0;
      for (int64_t j = 0; j < kTop; ++j) {
        const int32_t id = top[r * kTop + j];
        if (id < 0) continue;
        const double v = logit(r, id) / 2.5;
        want += grad_values[r * kTop + j] * (1 - v * v) * weight[id * kH + i];
      }
      EXPECT_NEAR(dh[r * kH + i], want, 1e-13 * (1 + std::abs(want)))
          << r << ", " << i;
    }
  }
  std::vector<float> float_grads(kRows * kTop);
  back.grad_values =
      Arg("grad_values", float_grads, "float32", {1, 2, 2, kTop});
  EXPECT_EQ(RunTopKValueBackward(*config, back, {}).message(),
            "grad_values: must be float64, got float32");
}

int handled_before = 0;
void CountSignal(int) { ++handled_before; }

// The chained handler sets the flag and then runs the handler it found
// (Python's, in the binding), which is back in place after the scope.
TEST(ScopedInterruptTest, ChainsBeforeTheHandlerItFinds) {
  struct sigaction counting = {};
  counting.sa_handler = CountSignal;
  sigemptyset(&counting.sa_mask);
  struct sigaction original;
  ASSERT_EQ(sigaction(SIGINT, &counting, &original), 0);
  {
    ScopedInterrupt scope;
    EXPECT_FALSE(scope.flag()->load());
    raise(SIGINT);
    EXPECT_TRUE(scope.flag()->load());
    EXPECT_EQ(handled_before, 1);
  }
  {
    ScopedInterrupt scope;  // A new scope starts unset.
    EXPECT_FALSE(scope.flag()->load());
  }
  raise(SIGINT);
  EXPECT_EQ(handled_before, 2);
  struct sigaction now;
  ASSERT_EQ(sigaction(SIGINT, &original, &now), 0);
  EXPECT_EQ(now.sa_handler, CountSignal);
}

}  // namespace
}  // namespace dflash::python
