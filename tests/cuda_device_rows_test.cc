// Row metadata built on the device (BuildCudaRows) and the CUDA head run
// from it (HeadInputs::device_rows), under head.row_selection COMPACT and
// ALL_ROWS:
// - the rows equal an independent host implementation of RowsOf's rules
//   (python/native/objective.cc), bit for bit, for every dtype of
//   target_ids and weight_mask and non-contiguous strides, D-PACE's
//   SEQUENCE_BALANCED shares equal to SetSequenceShares on the host;
// - every RowsOf error (mask negative, NaN or inf, the masks' sum past
//   float32, a target outside [0, V) or ignore_index) names RowsOf's
//   element, the first in its order, and the head reports it;
// - COMPACT from device rows gives terms and gradients bit-equal to the
//   host rows'; ALL_ROWS equals COMPACT within float32 rounding (the extra
//   zero rows change the GEMMs' blocking, so not bitwise);
// - a NaN in the hidden state of a row without weight leaves a trainable
//   head's grad_W finite under ALL_ROWS (the masked gather).
// Skipped, with the reason, where no GPU is usable.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/cuda_stream.h"
#include "base/error_norms.h"
#include "base/gpu_test.h"
#include "base/tracking_allocator.h"
#include "gtest/gtest.h"
#include "heads/cuda_head.h"
#include "losses/chunk_loss.h"
#include "losses/loss_family.h"
#include "losses/row_error.h"
#include "tests/cuda_test_util.h"
#include "tests/head_test_util.h"

namespace dflash {
namespace {

using head_test::Batch;
using head_test::ConfigBuilder;
using head_test::kK;
using head_test::kV;
using head_test::MakeBatch;

constexpr int64_t kB = 2, kN = 3;  // MakeBatch's batch and anchors.
constexpr int64_t kIgnore = -100;   // cross_entropy's default ignore_index.

// A batch's target_ids and weight_mask, [B, N, K] in row-major order.
struct Labels {
  std::vector<int64_t> ids;
  std::vector<double> masks;
};

// Targets in [0, V) but for a few ignore_index, masks 0, 1, 0.5 and 1/3.
Labels MakeLabels(uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int64_t> token(0, kV - 1);
  Labels l;
  for (int64_t e = 0; e < kB * kN * kK; ++e) {
    l.ids.push_back(e % 7 == 3 ? kIgnore : token(rng));
    const double masks[] = {1, 0, 0.5, 1.0 / 3, 1, 1};
    l.masks.push_back(e % kK == 0 ? 0 : masks[rng() % 6]);
  }
  return l;
}

// RowsOf's rules, written out again: the reference for the device's rows.
std::vector<RowMeta> ReferenceRows(const Labels& l, bool count_ignored) {
  std::vector<RowMeta> rows;
  for (int64_t e = 0; e < kB * kN * kK; ++e) {
    RowMeta meta;
    meta.position = static_cast<int32_t>(e % kK);
    meta.block = e / kK;
    const bool ignored = l.ids[e] == kIgnore;
    if (l.masks[e] > 0 && (!ignored || count_ignored)) {
      meta.target = static_cast<int32_t>(l.ids[e]);
      meta.mask = static_cast<float>(l.masks[e]);
    }
    rows.push_back(meta);
  }
  return rows;
}

template <typename V>
TrackedBuffer<char> UploadBytes(const std::vector<V>& host,
                                CudaStream& stream) {
  const int64_t bytes = static_cast<int64_t>(host.size() * sizeof(V));
  auto buffer = TrackedBuffer<char>::Create(stream.allocator(), bytes);
  EXPECT_TRUE(buffer.ok()) << buffer.status();
  EXPECT_TRUE(stream.CopyToDevice(buffer->data(), host.data(), bytes).ok());
  return *std::move(buffer);
}

// The labels on the device in the given dtypes; `transposed` stores them
// [B, K, N] and passes strides that read them as [B, N, K].
struct DeviceLabels {
  TrackedBuffer<char> ids, masks;
  cuda::RowsTensor target_ids, weight_mask;
};

DeviceLabels UploadLabels(const Labels& l, cuda::RowsDType id_dtype,
                          cuda::RowsDType mask_dtype, bool transposed,
                          CudaStream& stream) {
  std::vector<int64_t> order;  // Storage position -> element.
  int64_t strides[3] = {kN * kK, kK, 1};
  if (transposed) {
    for (int64_t b = 0; b < kB; ++b)
      for (int64_t k = 0; k < kK; ++k)
        for (int64_t n = 0; n < kN; ++n) order.push_back((b * kN + n) * kK + k);
    strides[1] = 1;
    strides[2] = kN;
  } else {
    for (int64_t e = 0; e < kB * kN * kK; ++e) order.push_back(e);
  }
  DeviceLabels d;
  if (id_dtype == cuda::kRowsInt64) {
    std::vector<int64_t> ids;
    for (int64_t e : order) ids.push_back(l.ids[e]);
    d.ids = UploadBytes(ids, stream);
  } else {
    std::vector<int32_t> ids;
    for (int64_t e : order) ids.push_back(static_cast<int32_t>(l.ids[e]));
    d.ids = UploadBytes(ids, stream);
  }
  if (mask_dtype == cuda::kRowsFloat64) {
    std::vector<double> masks;
    for (int64_t e : order) masks.push_back(l.masks[e]);
    d.masks = UploadBytes(masks, stream);
  } else if (mask_dtype == cuda::kRowsFloat32) {
    std::vector<float> masks;
    for (int64_t e : order) masks.push_back(static_cast<float>(l.masks[e]));
    d.masks = UploadBytes(masks, stream);
  } else {
    std::vector<uint8_t> masks;
    for (int64_t e : order) masks.push_back(l.masks[e] > 0 ? 1 : 0);
    d.masks = UploadBytes(masks, stream);
  }
  d.target_ids = {d.ids.data(), id_dtype, {strides[0], strides[1], strides[2]}};
  d.weight_mask = {d.masks.data(), mask_dtype,
                   {strides[0], strides[1], strides[2]}};
  return d;
}

v1::ObjectiveConfig CudaConfig(const std::string& loss, const std::string& mode,
                               v1::HeadConfig::RowSelection selection) {
  // Trainable but for the batch-level LK lambda, which needs a frozen head.
  v1::ObjectiveConfig config =
      ConfigBuilder(loss)
          .Mode(mode)
          .Trainable(loss.find("lk { type: LAMBDA") == std::string::npos)
          .Build();
  config.mutable_head()->set_backend(v1::HeadConfig::CUDA);
  config.mutable_head()->set_dtype(v1::HeadConfig::FLOAT32);
  config.mutable_head()->set_row_selection(selection);
  return config;
}

std::vector<RowMeta> DownloadRows(const CudaRows& rows, CudaStream& stream) {
  std::vector<RowMeta> host(rows.rows.size());
  EXPECT_TRUE(stream.CopyToHost(host.data(), rows.rows.data(),
                                rows.rows.bytes())
                  .ok());
  return host;
}

void ExpectSameRows(const std::vector<RowMeta>& got,
                    const std::vector<RowMeta>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t r = 0; r < got.size(); ++r) {
    SCOPED_TRACE(r);
    EXPECT_EQ(got[r].target, want[r].target);
    EXPECT_EQ(got[r].position, want[r].position);
    EXPECT_EQ(got[r].block, want[r].block);
    // Bitwise: the float32 rounding and the share's division alike.
    EXPECT_EQ(std::memcmp(&got[r].mask, &want[r].mask, sizeof(double)), 0)
        << got[r].mask << " vs " << want[r].mask;
    EXPECT_EQ(std::memcmp(&got[r].sequence_share, &want[r].sequence_share,
                          sizeof(double)),
              0)
        << got[r].sequence_share << " vs " << want[r].sequence_share;
  }
}

TEST(CudaDeviceRowsTest, BuildsRowsOfEveryDTypeAndStride) {
  absl::StatusOr<Gpu> gpu = OpenGpu();
  DFLASH_SKIP_WITHOUT_GPU(gpu.status());
  CudaStream& stream = *gpu->stream;
  const Labels labels = MakeLabels(5);
  struct Case {
    const char* loss;
    bool count_ignored;
  };
  for (const Case& c :
       {Case{"dflash {}", false},
        Case{"dflash {} cross_entropy { ignored_target_weight: COUNT }", true},
        Case{"dpace { alpha: 0.3 denominator: SEQUENCE_BALANCED }", false}}) {
    const v1::ObjectiveConfig config =
        CudaConfig(c.loss, "FUSED", v1::HeadConfig::COMPACT);
    std::vector<RowMeta> want = ReferenceRows(labels, c.count_ignored);
    const LossParams params = LossParamsOf(config.loss());
    if (params.sequence_balanced) {
      SetSequenceShares(params, kK, kN * kK, absl::MakeSpan(want));
    }
    for (cuda::RowsDType ids : {cuda::kRowsInt32, cuda::kRowsInt64}) {
      for (cuda::RowsDType masks :
           {cuda::kRowsFloat32, cuda::kRowsFloat64, cuda::kRowsBool}) {
        for (bool transposed : {false, true}) {
          SCOPED_TRACE(absl::StrCat(c.loss, " ids ", ids, " masks ", masks,
                                    " transposed ", transposed));
          DeviceLabels d =
              UploadLabels(labels, ids, masks, transposed, stream);
          absl::StatusOr<CudaRows> rows = BuildCudaRows(
              config, d.target_ids, d.weight_mask, kB, kN, stream);
          ASSERT_TRUE(rows.ok()) << rows.status();
          auto error = ReadCudaRowsError(rows->view(), stream);
          ASSERT_TRUE(error.ok()) << error.status();
          EXPECT_FALSE(error->has_value());
          std::vector<RowMeta> expected = want;
          if (masks == cuda::kRowsBool) {
            // A bool mask is 0 or 1.
            Labels binary = labels;
            for (double& m : binary.masks) m = m > 0 ? 1 : 0;
            expected = ReferenceRows(binary, c.count_ignored);
            if (params.sequence_balanced) {
              SetSequenceShares(params, kK, kN * kK, absl::MakeSpan(expected));
            }
          }
          ExpectSameRows(DownloadRows(*rows, stream), expected);
        }
      }
    }
  }
}

// One bad-label case: what is set, and what RowsOf reports.
struct BadCase {
  const char* name;
  std::vector<std::pair<int64_t, double>> masks;  // element, mask
  std::vector<std::pair<int64_t, int64_t>> ids;   // element, id
  int64_t element;
  cuda::RowsErrorKind kind;
  const char* detail;
};

TEST(CudaDeviceRowsTest, ReportsRowsOfFirstBadElement) {
  absl::StatusOr<Gpu> gpu = OpenGpu();
  DFLASH_SKIP_WITHOUT_GPU(gpu.status());
  CudaStream& stream = *gpu->stream;
  const double big = 3e38;  // Two of them pass float32's largest.
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  const std::vector<BadCase> cases = {
      {"negative mask", {{9, -0.5}}, {}, 9, cuda::kRowsMaskInvalid,
       "weight_mask: must be finite and >= 0"},
      {"nan mask", {{13, nan}}, {}, 13, cuda::kRowsMaskInvalid,
       "weight_mask: must be finite and >= 0"},
      {"inf mask", {{2, inf}}, {}, 2, cuda::kRowsMaskInvalid,
       "weight_mask: must be finite and >= 0"},
      {"target >= V", {{6, 1}}, {{6, kV}}, 6, cuda::kRowsTargetInvalid,
       "target_ids: must lie in [0, V = 23) or be ignore_index (-100) where "
       "weight_mask > 0"},
      {"negative target", {{17, 1}}, {{17, -1}}, 17, cuda::kRowsTargetInvalid,
       "target_ids: must lie in [0, V = 23)"},
      // A bad target without weight is no error; the later bad mask is.
      {"target without weight", {{5, 0}, {11, -1}}, {{5, kV + 4}}, 11,
       cuda::kRowsMaskInvalid, "weight_mask"},
      // The first element wins, whatever its kind.
      {"first of two", {{5, 1}, {7, -1}}, {{5, 99}}, 5,
       cuda::kRowsTargetInvalid, "target_ids"},
      // Within an element, the mask's check comes first.
      {"mask before target", {{10, nan}}, {{10, 99}}, 10,
       cuda::kRowsMaskInvalid, "weight_mask"},
      {"mask sum overflow", {{3, big}, {14, big}}, {}, 14,
       cuda::kRowsMaskSumOverflow, "sum to more than float32"},
      // Overflow at 14, then a bad mask at 20: the overflow is first.
      {"overflow before bad mask", {{3, big}, {14, big}, {20, -1}}, {}, 14,
       cuda::kRowsMaskSumOverflow, "weight_mask"},
      // The negative mask brings the tile's sum back under float32's
      // largest: the overflow at 14 is still first.
      {"overflow before a negative that cancels it",
       {{3, big}, {14, big}, {20, -big}}, {}, 14, cuda::kRowsMaskSumOverflow,
       "sum to more than float32"},
  };
  for (const BadCase& c : cases) {
    for (const auto selection :
         {v1::HeadConfig::COMPACT, v1::HeadConfig::ALL_ROWS}) {
      SCOPED_TRACE(absl::StrCat(c.name, " ",
                                v1::HeadConfig::RowSelection_Name(selection)));
      Labels labels = MakeLabels(8);
      for (auto [e, m] : c.masks) labels.masks[e] = m;
      for (auto [e, id] : c.ids) labels.ids[e] = id;
      const v1::ObjectiveConfig config = CudaConfig("dflash {}", "FUSED",
                                                    selection);
      DeviceLabels d = UploadLabels(labels, cuda::kRowsInt64,
                                    cuda::kRowsFloat64, true, stream);
      absl::StatusOr<CudaRows> rows =
          BuildCudaRows(config, d.target_ids, d.weight_mask, kB, kN, stream);
      ASSERT_TRUE(rows.ok()) << rows.status();
      auto error = ReadCudaRowsError(rows->view(), stream);
      ASSERT_TRUE(error.ok()) << error.status();
      ASSERT_TRUE(error->has_value());
      EXPECT_EQ((*error)->element, c.element);
      EXPECT_EQ((*error)->kind, c.kind);

      // The head reports it, naming the element's (b, n, k).
      const Batch b = MakeBatch(3);
      TrackedBuffer<float> hidden = Upload<float>(b.hidden, stream);
      TrackedBuffer<float> weight = Upload<float>(b.weight, stream);
      TrackedBuffer<float> bias = Upload<float>(b.bias, stream);
      TrackedBuffer<float> grad_hidden = Upload<float>(b.hidden, stream);
      TrackedBuffer<float> grad_weight = Upload<float>(b.weight, stream);
      TrackedBuffer<float> grad_bias = Upload<float>(b.bias, stream);
      HeadInputs<float> inputs;
      inputs.hidden = Span(hidden);
      inputs.weight = Span(weight);
      inputs.bias = Span(bias);
      inputs.device_rows = rows->view();
      absl::StatusOr<HeadResult> run = RunCudaHead<float>(
          config, inputs,
          {Span(grad_hidden), Span(grad_weight), Span(grad_bias)}, *gpu->blas);
      ASSERT_FALSE(run.ok());
      EXPECT_EQ(run.status().code(), absl::StatusCode::kInvalidArgument);
      const int64_t e = c.element;
      EXPECT_NE(run.status().message().find(absl::StrCat(
                    "row (b, n, k) = (", e / (kN * kK), ", ", e / kK % kN,
                    ", ", e % kK, "): ")),
                std::string::npos)
          << run.status();
      EXPECT_NE(run.status().message().find(c.detail), std::string::npos)
          << run.status();
      const std::optional<RowErrorInfo> row = GetRowError(run.status());
      ASSERT_TRUE(row.has_value());
      EXPECT_EQ(row->row, e);
      // COMPACT fails before writing anything; ALL_ROWS once the forward
      // chunks have run, the FUSED gradients already written
      // (heads/cuda_head.h).
      if (selection == v1::HeadConfig::COMPACT) {
        EXPECT_EQ(Download(grad_hidden, stream), Download(hidden, stream));
        EXPECT_EQ(Download(grad_weight, stream), Download(weight, stream));
      } else {
        EXPECT_NE(Download(grad_hidden, stream), Download(hidden, stream));
      }
    }
  }
}

// A config's own ignore_index: its targets are ignored (no error, no
// weight), and -100 is then a bad target where it has weight.
TEST(CudaDeviceRowsTest, HonoursTheConfigsIgnoreIndex) {
  absl::StatusOr<Gpu> gpu = OpenGpu();
  DFLASH_SKIP_WITHOUT_GPU(gpu.status());
  CudaStream& stream = *gpu->stream;
  const v1::ObjectiveConfig config =
      CudaConfig("dflash {} cross_entropy { ignore_index: 7 }", "FUSED",
                 v1::HeadConfig::COMPACT);
  Labels labels = MakeLabels(9);
  for (int64_t& id : labels.ids) {
    if (id == kIgnore) id = 7;
  }
  std::vector<RowMeta> want = ReferenceRows(labels, false);
  for (int64_t e = 0; e < kB * kN * kK; ++e) {
    if (labels.ids[e] == 7) want[e].mask = 0, want[e].target = 0;
  }
  DeviceLabels d = UploadLabels(labels, cuda::kRowsInt32, cuda::kRowsFloat64,
                                false, stream);
  absl::StatusOr<CudaRows> rows =
      BuildCudaRows(config, d.target_ids, d.weight_mask, kB, kN, stream);
  ASSERT_TRUE(rows.ok()) << rows.status();
  auto error = ReadCudaRowsError(rows->view(), stream);
  ASSERT_TRUE(error.ok()) << error.status();
  EXPECT_FALSE(error->has_value());
  ExpectSameRows(DownloadRows(*rows, stream), want);

  labels.ids[6] = kIgnore;
  labels.masks[6] = 1;
  DeviceLabels bad = UploadLabels(labels, cuda::kRowsInt64,
                                  cuda::kRowsFloat32, false, stream);
  rows = BuildCudaRows(config, bad.target_ids, bad.weight_mask, kB, kN, stream);
  ASSERT_TRUE(rows.ok()) << rows.status();
  error = ReadCudaRowsError(rows->view(), stream);
  ASSERT_TRUE(error.ok()) << error.status();
  ASSERT_TRUE(error->has_value());
  EXPECT_EQ((*error)->element, 6);
  EXPECT_EQ((*error)->kind, cuda::kRowsTargetInvalid);
}

// A run's results in float64 on the host.
struct Result {
  absl::StatusOr<HeadResult> head;
  std::vector<double> grad_hidden, grad_weight, grad_bias;
};

// RunCudaHead on `b`'s tensors (hidden from `hidden`) with host rows
// (`host_rows`) or device rows.
Result RunWith(const v1::ObjectiveConfig& config, const Batch& b,
           const std::vector<double>& hidden,
           absl::Span<const RowMeta> host_rows, DeviceRows device_rows,
           Gpu& gpu) {
  CudaStream& stream = *gpu.stream;
  TrackedBuffer<float> x = Upload<float>(hidden, stream);
  TrackedBuffer<float> weight = Upload<float>(b.weight, stream);
  TrackedBuffer<float> bias = Upload<float>(b.bias, stream);
  TrackedBuffer<float> grad_hidden =
      Upload<float>(std::vector<double>(b.hidden.size(), 7), stream);
  TrackedBuffer<float> grad_weight =
      Upload<float>(std::vector<double>(b.weight.size(), 7), stream);
  TrackedBuffer<float> grad_bias =
      Upload<float>(std::vector<double>(b.bias.size(), 7), stream);
  HeadInputs<float> inputs;
  inputs.hidden = Span(x);
  inputs.weight = Span(weight);
  inputs.bias = Span(bias);
  inputs.rows = host_rows;
  inputs.device_rows = device_rows;
  Result r;
  const bool trainable = config.head().trainable();
  r.head = RunCudaHead<float>(
      config, inputs,
      {Span(grad_hidden), trainable ? Span(grad_weight) : absl::Span<float>(),
       trainable ? Span(grad_bias) : absl::Span<float>()},
      *gpu.blas);
  r.grad_hidden = Download(grad_hidden, stream);
  r.grad_weight = Download(grad_weight, stream);
  r.grad_bias = Download(grad_bias, stream);
  return r;
}

// The loss configs and modes of the equality checks.
const char* const kLosses[] = {
    "dflash {}",
    "dpace { alpha: 0.3 denominator: SEQUENCE_BALANCED }",
    "dpace { alpha: 0.3 }",
    "dflash {} cross_entropy { ignored_target_weight: COUNT }",
    "lk_lambda {}",
    "dflash { lk { type: LAMBDA } }",
};
const char* const kModes[] = {"FUSED", "CHECKPOINT", "MATERIALIZE"};

void ExpectTermsEqual(const ChunkTerms& a, const ChunkTerms& b) {
  EXPECT_EQ(a.loss_num, b.loss_num);
  EXPECT_EQ(a.loss_den, b.loss_den);
  EXPECT_EQ(a.correct, b.correct);
  EXPECT_EQ(a.accuracy_den, b.accuracy_den);
  EXPECT_EQ(a.correct_per_position, b.correct_per_position);
  EXPECT_EQ(a.mask_per_position, b.mask_per_position);
  EXPECT_EQ(a.accepted_length.block_den, b.accepted_length.block_den);
  EXPECT_EQ(a.accepted_length.expected_num, b.accepted_length.expected_num);
  EXPECT_EQ(a.accepted_length.oracle_num, b.accepted_length.oracle_num);
}

TEST(CudaDeviceRowsTest, CompactFromDeviceRowsEqualsHostRowsBitwise) {
  absl::StatusOr<Gpu> gpu = OpenGpu();
  DFLASH_SKIP_WITHOUT_GPU(gpu.status());
  CudaStream& stream = *gpu->stream;
  const Batch b = MakeBatch(11);
  const Labels labels = MakeLabels(12);
  for (const char* loss : kLosses) {
    for (const char* mode : kModes) {
      SCOPED_TRACE(absl::StrCat(loss, " ", mode));
      const v1::ObjectiveConfig config =
          CudaConfig(loss, mode, v1::HeadConfig::COMPACT);
      const LossParams params = LossParamsOf(config.loss());
      // The host rows as the binding's RowsOf makes them (shares: the head).
      const std::vector<RowMeta> host =
          ReferenceRows(labels, params.count_ignored);
      DeviceLabels d = UploadLabels(labels, cuda::kRowsInt32,
                                    cuda::kRowsFloat32, false, stream);
      absl::StatusOr<CudaRows> rows =
          BuildCudaRows(config, d.target_ids, d.weight_mask, kB, kN, stream);
      ASSERT_TRUE(rows.ok()) << rows.status();
      const Result want = RunWith(config, b, b.hidden, host, {}, *gpu);
      const Result got = RunWith(config, b, b.hidden, {}, rows->view(), *gpu);
      ASSERT_TRUE(want.head.ok()) << want.head.status();
      ASSERT_TRUE(got.head.ok()) << got.head.status();
      EXPECT_EQ(got.head->loss, want.head->loss);
      ExpectTermsEqual(got.head->terms, want.head->terms);
      EXPECT_EQ(got.head->stats.projected_rows,
                want.head->stats.projected_rows);
      EXPECT_EQ(got.grad_hidden, want.grad_hidden);
      EXPECT_EQ(got.grad_weight, want.grad_weight);
      EXPECT_EQ(got.grad_bias, want.grad_bias);
    }
  }
}

double Relative(const std::vector<double>& a, const std::vector<double>& b) {
  return RelativeMaxError<double>(a, b);
}

TEST(CudaDeviceRowsTest, AllRowsEqualsCompact) {
  absl::StatusOr<Gpu> gpu = OpenGpu();
  DFLASH_SKIP_WITHOUT_GPU(gpu.status());
  CudaStream& stream = *gpu->stream;
  const Batch b = MakeBatch(21);
  const Labels labels = MakeLabels(22);
  for (const char* loss : kLosses) {
    for (const char* mode : kModes) {
      for (bool device : {false, true}) {
        SCOPED_TRACE(absl::StrCat(loss, " ", mode, device ? " device" : ""));
        const v1::ObjectiveConfig compact =
            CudaConfig(loss, mode, v1::HeadConfig::COMPACT);
        const v1::ObjectiveConfig all =
            CudaConfig(loss, mode, v1::HeadConfig::ALL_ROWS);
        const LossParams params = LossParamsOf(compact.loss());
        const std::vector<RowMeta> host =
            ReferenceRows(labels, params.count_ignored);
        DeviceLabels d = UploadLabels(labels, cuda::kRowsInt64,
                                      cuda::kRowsFloat32, true, stream);
        absl::StatusOr<CudaRows> rows = BuildCudaRows(
            compact, d.target_ids, d.weight_mask, kB, kN, stream);
        ASSERT_TRUE(rows.ok()) << rows.status();
        const Result want = RunWith(compact, b, b.hidden, host, {}, *gpu);
        const Result got =
            device ? RunWith(all, b, b.hidden, {}, rows->view(), *gpu)
                   : RunWith(all, b, b.hidden, host, {}, *gpu);
        ASSERT_TRUE(want.head.ok()) << want.head.status();
        ASSERT_TRUE(got.head.ok()) << got.head.status();
        EXPECT_NEAR(got.head->loss, want.head->loss,
                    1e-6 * std::abs(want.head->loss));
        EXPECT_EQ(got.head->terms.correct, want.head->terms.correct);
        EXPECT_EQ(got.head->terms.mask_per_position,
                  want.head->terms.mask_per_position);
        EXPECT_EQ(got.head->terms.accepted_length.block_den,
                  want.head->terms.accepted_length.block_den);
        EXPECT_NEAR(got.head->terms.accepted_length.expected_num,
                    want.head->terms.accepted_length.expected_num,
                    1e-6 * want.head->terms.accepted_length.expected_num);
        // Every row projected.
        EXPECT_EQ(got.head->stats.projected_rows, kB * kN * kK);
        EXPECT_LT(want.head->stats.projected_rows, kB * kN * kK);
        EXPECT_LT(Relative(got.grad_hidden, want.grad_hidden), 1e-6);
        EXPECT_LT(Relative(got.grad_weight, want.grad_weight), 1e-6);
        EXPECT_LT(Relative(got.grad_bias, want.grad_bias), 1e-6);
      }
    }
  }
}

TEST(CudaDeviceRowsTest, NanInUnweightedRowLeavesWeightGradientFinite) {
  absl::StatusOr<Gpu> gpu = OpenGpu();
  DFLASH_SKIP_WITHOUT_GPU(gpu.status());
  CudaStream& stream = *gpu->stream;
  const Batch b = MakeBatch(31);
  const Labels labels = MakeLabels(32);
  // Every row at block position 0 has no weight (MakeLabels): poison one,
  // and compare with the run where it is zero.
  const int64_t poisoned = 2 * kK;
  ASSERT_EQ(labels.masks[poisoned], 0);
  std::vector<double> nan_hidden = b.hidden, zero_hidden = b.hidden;
  for (int64_t h = 0; h < head_test::kH; ++h) {
    nan_hidden[poisoned * head_test::kH + h] =
        std::numeric_limits<double>::quiet_NaN();
    zero_hidden[poisoned * head_test::kH + h] = 0;
  }
  for (const char* mode : kModes) {
    SCOPED_TRACE(mode);
    const v1::ObjectiveConfig config =
        CudaConfig("dflash {}", mode, v1::HeadConfig::ALL_ROWS);
    DeviceLabels d = UploadLabels(labels, cuda::kRowsInt64,
                                  cuda::kRowsFloat32, false, stream);
    absl::StatusOr<CudaRows> rows =
        BuildCudaRows(config, d.target_ids, d.weight_mask, kB, kN, stream);
    ASSERT_TRUE(rows.ok()) << rows.status();
    const Result got = RunWith(config, b, nan_hidden, {}, rows->view(), *gpu);
    const Result want = RunWith(config, b, zero_hidden, {}, rows->view(), *gpu);
    ASSERT_TRUE(got.head.ok()) << got.head.status();
    ASSERT_TRUE(want.head.ok()) << want.head.status();
    EXPECT_TRUE(std::isfinite(got.head->loss));
    for (double g : got.grad_weight) ASSERT_TRUE(std::isfinite(g));
    for (double g : got.grad_hidden) ASSERT_TRUE(std::isfinite(g));
    EXPECT_EQ(got.grad_weight, want.grad_weight);
    EXPECT_EQ(got.grad_hidden, want.grad_hidden);
    EXPECT_EQ(got.head->loss, want.head->loss);
  }
}

// StartCudaHead from device rows under ALL_ROWS: the forward loss and the
// gradients of RunCudaHead's ALL_ROWS run (to the split run's folding of
// the scale: 1e-6).
TEST(CudaDeviceRowsTest, SplitRunFromDeviceRows) {
  absl::StatusOr<Gpu> gpu = OpenGpu();
  DFLASH_SKIP_WITHOUT_GPU(gpu.status());
  CudaStream& stream = *gpu->stream;
  const Batch b = MakeBatch(41);
  const Labels labels = MakeLabels(42);
  for (const char* loss :
       {"dflash {}", "dpace { alpha: 0.3 denominator: SEQUENCE_BALANCED }"}) {
    SCOPED_TRACE(loss);
    const v1::ObjectiveConfig config =
        CudaConfig(loss, "CHECKPOINT", v1::HeadConfig::ALL_ROWS);
    DeviceLabels d = UploadLabels(labels, cuda::kRowsInt64,
                                  cuda::kRowsFloat32, false, stream);
    absl::StatusOr<CudaRows> rows =
        BuildCudaRows(config, d.target_ids, d.weight_mask, kB, kN, stream);
    ASSERT_TRUE(rows.ok()) << rows.status();
    const Result want = RunWith(config, b, b.hidden, {}, rows->view(), *gpu);
    ASSERT_TRUE(want.head.ok()) << want.head.status();

    TrackedBuffer<float> x = Upload<float>(b.hidden, stream);
    TrackedBuffer<float> weight = Upload<float>(b.weight, stream);
    TrackedBuffer<float> bias = Upload<float>(b.bias, stream);
    HeadInputs<float> inputs;
    inputs.hidden = Span(x);
    inputs.weight = Span(weight);
    inputs.bias = Span(bias);
    inputs.device_rows = rows->view();
    auto split = StartCudaHead<float>(config, inputs, *gpu->blas);
    ASSERT_TRUE(split.ok()) << split.status();
    EXPECT_EQ((*split)->forward().loss, want.head->loss);
    TrackedBuffer<float> grad_hidden = Upload<float>(b.hidden, stream);
    TrackedBuffer<float> grad_weight = Upload<float>(b.weight, stream);
    TrackedBuffer<float> grad_bias = Upload<float>(b.bias, stream);
    auto stats = (*split)->Backward(
        1.0, {Span(grad_hidden), Span(grad_weight), Span(grad_bias)}, nullptr);
    ASSERT_TRUE(stats.ok()) << stats.status();
    EXPECT_LT(Relative(Download(grad_hidden, stream), want.grad_hidden), 1e-6);
    EXPECT_LT(Relative(Download(grad_weight, stream), want.grad_weight), 1e-6);
    EXPECT_LT(Relative(Download(grad_bias, stream), want.grad_bias), 1e-6);
  }
}

TEST(CudaDeviceRowsTest, RefusesBadBuildArguments) {
  absl::StatusOr<Gpu> gpu = OpenGpu();
  DFLASH_SKIP_WITHOUT_GPU(gpu.status());
  CudaStream& stream = *gpu->stream;
  const v1::ObjectiveConfig config =
      CudaConfig("dflash {}", "FUSED", v1::HeadConfig::COMPACT);
  DeviceLabels d = UploadLabels(MakeLabels(1), cuda::kRowsInt64,
                                cuda::kRowsFloat32, false, stream);
  cuda::RowsTensor float_ids = d.target_ids;
  float_ids.dtype = cuda::kRowsFloat32;
  absl::StatusOr<CudaRows> rows =
      BuildCudaRows(config, float_ids, d.weight_mask, kB, kN, stream);
  ASSERT_FALSE(rows.ok());
  EXPECT_NE(rows.status().message().find("target_ids: must be int32 or int64"),
            std::string::npos)
      << rows.status();
  cuda::RowsTensor int_masks = d.weight_mask;
  int_masks.dtype = cuda::kRowsInt32;
  rows = BuildCudaRows(config, d.target_ids, int_masks, kB, kN, stream);
  ASSERT_FALSE(rows.ok());
  EXPECT_NE(rows.status().message().find(
                "weight_mask: must be float32, float64 or bool"),
            std::string::npos)
      << rows.status();
  rows = BuildCudaRows(config, d.target_ids, d.weight_mask, -1, kN, stream);
  ASSERT_FALSE(rows.ok());
  EXPECT_NE(rows.status().message().find("B, N >= 0"), std::string::npos)
      << rows.status();
}

}  // namespace
}  // namespace dflash
