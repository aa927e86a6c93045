#include <cuda_runtime.h>

#include "base/bfloat16.h"
#include "base/cuda_launch.h"
#include "heads/cuda_head_kernels.h"
#include "losses/device_results.h"
#include "losses/loss_math.h"
#include "losses/row_rules.h"

namespace dflash {
namespace cuda {
namespace {

constexpr int kThreads = 256;


// One block per row; 16-byte copies when the rows allow them.
template <typename T>
__global__ void CopyRowsKernel(const T* source, int64_t width,
                               const int64_t* rows, bool gather, T* out) {
  const int64_t i = blockIdx.x;
  if (rows[i] < 0) {
    // A row without weight: gathered as zeros, its gradient not written.
    if (gather) {
      for (int64_t j = threadIdx.x; j < width; j += blockDim.x) {
        out[i * width + j] = FromFloat<T>(0.0f);
      }
    }
    return;
  }
  const int64_t from = gather ? rows[i] : i;
  const int64_t to = gather ? i : rows[i];
  const T* src = source + from * width;
  T* dst = out + to * width;
  constexpr int kVec = 16 / sizeof(T);
  if (width % kVec == 0 &&
      ((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) &
       15) == 0) {
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* d = reinterpret_cast<uint4*>(dst);
    for (int64_t j = threadIdx.x; j < width / kVec; j += blockDim.x)
      d[j] = s[j];
  } else {
    for (int64_t j = threadIdx.x; j < width; j += blockDim.x) dst[j] = src[j];
  }
}

template <typename T>
__global__ void AddBiasKernel(T* logits, const T* bias, int64_t total,
                              int64_t vocab, int64_t stride) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x) {
    T& logit = logits[i / vocab * stride + i % vocab];
    logit = FromFloat<T>(ToFloat(logit) + ToFloat(bias[i % vocab]));
  }
}

// One thread per vocabulary column, rows summed in order, into the bias's
// type or an FP32 sum.
template <typename T, typename S>
__global__ void BiasGradientKernel(const T* grad, int64_t count, int64_t vocab,
                                   int64_t stride, S* grad_bias) {
  const int64_t v = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (v >= vocab) return;
  float sum = 0;
  for (int64_t i = 0; i < count; ++i) sum += ToFloat(grad[i * stride + v]);
  grad_bias[v] = FromFloat<S>(ToFloat(grad_bias[v]) + sum);
}

__global__ void FillKernel(int32_t* data, int64_t count, int32_t value) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    data[i] = value;
  }
}

__device__ int64_t Min(int64_t a, int64_t b) { return a < b ? a : b; }

__device__ int64_t ReadId(const RowsTensor& t, int64_t offset) {
  return t.dtype == kRowsInt64 ? static_cast<const int64_t*>(t.data)[offset]
                               : static_cast<const int32_t*>(t.data)[offset];
}

__device__ double ReadMask(const RowsTensor& t, int64_t offset) {
  if (t.dtype == kRowsFloat64) return static_cast<const double*>(t.data)[offset];
  if (t.dtype == kRowsFloat32) return static_cast<const float*>(t.data)[offset];
  return static_cast<const uint8_t*>(t.data)[offset];
}

// Element e = b N K + n K + k of a [B, N, K] tensor, at its strides.
__device__ int64_t Offset(const RowsTensor& t, const BuildRowsParams& p,
                          int64_t e) {
  const int64_t k = e % p.block, n = (e / p.block) % p.anchors,
                b = e / (p.block * p.anchors);
  return b * t.strides[0] + n * t.strides[1] + k * t.strides[2];
}

__global__ void FillErrorKernel(unsigned long long* error) {
  *error = kNoRowsError;
}

// RowsOf's loop body (its rules: row_rules.h), one element a thread.
__global__ void BuildRowsKernel(RowsTensor target_ids, RowsTensor weight_mask,
                                BuildRowsParams p, int64_t total,
                                RowMeta* rows, unsigned long long* error) {
  const RowRules rules{p.vocab, p.ignore_index, p.count_ignored,
                       p.float64_terms};
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < total;
       e += int64_t{gridDim.x} * blockDim.x) {
    RowMeta meta;
    meta.position = static_cast<int32_t>(e % p.block);
    meta.block = e / p.block;
    const double mask = ReadMask(weight_mask, Offset(weight_mask, p, e));
    if (!ValidMask(mask)) {
      atomicMin(error, RowsErrorCode(e, kRowsMaskInvalid));
    } else if (!RowOfElement(mask,
                             ReadId(target_ids, Offset(target_ids, p, e)),
                             meta.position, meta.block, rules, meta)) {
      atomicMin(error, RowsErrorCode(e, kRowsTargetInvalid));
    }
    rows[e] = meta;
  }
}

// The raw masks' sum of each tile, in element order; +inf for a tile with
// a bad mask (negative or not finite), which MaskSumKernel then scans
// element by element: a negative mask could bring a tile's sum back under
// max_sum after an element whose running sum passed it.
__global__ void TileSumsKernel(RowsTensor weight_mask, BuildRowsParams p,
                               int64_t total, double* tile_sums) {
  const int64_t tiles = (total + kRowsSumTile - 1) / kRowsSumTile;
  for (int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; t < tiles;
       t += int64_t{gridDim.x} * blockDim.x) {
    double sum = 0;
    const int64_t end = Min(total, (t + 1) * kRowsSumTile);
    for (int64_t e = t * kRowsSumTile; e < end; ++e) {
      const double mask = ReadMask(weight_mask, Offset(weight_mask, p, e));
      if (!ValidMask(mask)) {
        sum = INFINITY;
        break;
      }
      sum += mask;
    }
    tile_sums[t] = sum;
  }
}

// One thread: the running sum tile by tile, and element by element inside
// the tile where it passes max_sum, so the first element past it is found
// in a fixed order. (Not RowsOf's exact additions, which go one element at
// a time: the two can differ in the last bits of a sum right at the
// limit.) The tiles skipped hold valid masks only, so every running sum
// inside them is at most the tile's end's; the scan of a tile with a bad
// mask reaches the masks before it as RowsOf does, and whatever it reports
// at or after the bad mask BuildRowsKernel reports at a smaller code.
__global__ void MaskSumKernel(RowsTensor weight_mask, BuildRowsParams p,
                              int64_t total, const double* tile_sums,
                              unsigned long long* error) {
  const int64_t tiles = (total + kRowsSumTile - 1) / kRowsSumTile;
  double running = 0;
  for (int64_t t = 0; t < tiles; ++t) {
    if (running + tile_sums[t] <= p.max_sum) {
      running += tile_sums[t];
      continue;
    }
    const int64_t end = Min(total, (t + 1) * kRowsSumTile);
    for (int64_t e = t * kRowsSumTile; e < end; ++e) {
      running += ReadMask(weight_mask, Offset(weight_mask, p, e));
      if (!(running <= p.max_sum)) {
        atomicMin(error, RowsErrorCode(e, kRowsMaskSumOverflow));
        return;
      }
    }
  }
}

// SetSequenceShares (losses/chunk_loss.h), one thread a sequence.
__global__ void SequenceSharesKernel(BuildRowsParams p, int64_t total,
                                     RowMeta* rows) {
  const int64_t sequences = (total + p.sequence_rows - 1) / p.sequence_rows;
  for (int64_t s = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
       s < sequences; s += int64_t{gridDim.x} * blockDim.x) {
    const int64_t begin = s * p.sequence_rows;
    const int64_t end = Min(total, begin + p.sequence_rows);
    const double share = SequenceShareOf(p.loss, rows, begin, end, p.block);
    for (int64_t r = begin; r < end; ++r) rows[r].sequence_share = share;
  }
}

__global__ void RowListsKernel(const RowMeta* rows, int64_t count,
                               LossParams loss, int64_t* all,
                               int64_t* weighted) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    all[i] = i;
    weighted[i] =
        EffectiveMask(loss, rows[i].target, rows[i].mask) > 0 ? i : -1;
  }
}

// BlockTermsKernel's threads: one CUDA block, so that its sums are taken
// in one fixed order (a result does not depend on scheduling).
constexpr int kBlockTermsThreads = 256;

// The accepted lengths (AcceptedLengths, losses/accepted_length.h) and
// SEQUENCE_BALANCED's weighted sequences (WeightedSequences) of rows in
// batch order (row r at block r / K, position r % K), by the host's
// formulas (AcceptanceOfSlot, ChainLength: loss_math.h): each thread sums
// its anchor blocks, then a tree over the threads.
__global__ void BlockTermsKernel(const RowMeta* rows, int64_t count,
                                 int64_t block_size, int64_t first_position,
                                 LossParams loss, const double* q,
                                 const int32_t* rank, const double* teacher,
                                 double* out) {
  DFLASH_SHARED_ARRAY(double, sums, kBlockTermsSize * kBlockTermsThreads);
  double mine[kBlockTermsSize] = {};
  const int64_t blocks = count / block_size;
  for (int64_t b = threadIdx.x; b < blocks; b += blockDim.x) {
    const int64_t base = b * block_size;
    auto slot = [&](int64_t k) {
      const int64_t r = base + k;
      return AcceptanceOfSlot(rows[r].mask, q[r],
                              rank == nullptr ? -1 : rank[r],
                              teacher == nullptr ? 0.0 : teacher[r]);
    };
    bool valid = false, weighted = false;
    for (int64_t k = 0; k < block_size; ++k) {
      if (k >= first_position) valid = valid || slot(k).supervised;
      const RowMeta& row = rows[base + k];
      weighted = weighted || EffectiveMask(loss, row.target, row.mask) > 0;
    }
    if (weighted) mine[kBlockWeightedSequences] += rows[base].sequence_share;
    if (!valid) continue;
    mine[kDeviceBlockDen] += 1;
    mine[kDeviceBlockExpectedNum] +=
        ChainLength([&](int64_t k) { return slot(k).expected; },
                    first_position, block_size);
    if (rank != nullptr) {
      mine[kDeviceBlockOracleNum] +=
          ChainLength([&](int64_t k) { return slot(k).oracle; },
                      first_position, block_size);
    }
    if (teacher != nullptr) {
      mine[kDeviceBlockTeacherExpectedNum] +=
          ChainLength([&](int64_t k) { return slot(k).teacher; },
                      first_position, block_size);
    }
  }
  const int t = static_cast<int>(threadIdx.x);
  for (int i = 0; i < kBlockTermsSize; ++i) {
    sums[i * kBlockTermsThreads + t] = mine[i];
  }
  __syncthreads();
  for (int half = kBlockTermsThreads / 2; half > 0; half /= 2) {
    if (t < half) {
      for (int i = 0; i < kBlockTermsSize; ++i) {
        sums[i * kBlockTermsThreads + t] +=
            sums[i * kBlockTermsThreads + t + half];
      }
    }
    __syncthreads();
  }
  if (t == 0) {
    for (int i = 0; i < kBlockTermsSize; ++i) {
      out[i] = sums[i * kBlockTermsThreads];
    }
  }
}

unsigned Blocks(int64_t count) {
  const int64_t blocks = (count + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 65535 ? (blocks > 0 ? blocks : 1)
                                              : 65535);
}

}  // namespace

template <typename T>
void LaunchGatherRows(const T* source, int64_t width, const int64_t* rows,
                      int64_t count, T* out, CUstream_st* stream) {
  if (count == 0) return;
  DFLASH_LAUNCH(CopyRowsKernel<T>, static_cast<unsigned>(count), kThreads, 0,
                stream)
  (source, width, rows, /*gather=*/true, out);
}

template <typename T>
void LaunchScatterRows(const T* values, int64_t width, const int64_t* rows,
                       int64_t count, T* out, CUstream_st* stream) {
  if (count == 0) return;
  DFLASH_LAUNCH(CopyRowsKernel<T>, static_cast<unsigned>(count), kThreads, 0,
                stream)
  (values, width, rows, /*gather=*/false, out);
}

template <typename T>
void LaunchAddBias(T* logits, const T* bias, int64_t count, int64_t vocab,
                   int64_t stride, CUstream_st* stream) {
  const int64_t total = count * vocab;
  if (total == 0) return;
  DFLASH_LAUNCH(AddBiasKernel<T>, Blocks(total), kThreads, 0, stream)
  (logits, bias, total, vocab, stride);
}

template <typename T, typename S>
void LaunchAccumulateBiasGradient(const T* grad_logits, int64_t count,
                                  int64_t vocab, int64_t stride, S* grad_bias,
                                  CUstream_st* stream) {
  if (count == 0) return;
  void (*const kernel)(const T*, int64_t, int64_t, int64_t, S*) =
      BiasGradientKernel<T, S>;
  DFLASH_LAUNCH(kernel,
                static_cast<unsigned>((vocab + kThreads - 1) / kThreads),
                kThreads, 0, stream)
  (grad_logits, count, vocab, stride, grad_bias);
}

namespace {

// *address += value, atomically: FP32 atomics for float; for bfloat16 a
// compare-and-swap on the aligned 32-bit word that holds it, the sum
// rounded to bfloat16 (as every bfloat16 gradient store is).
__device__ __forceinline__ void AtomicAdd(float* address, float value) {
  atomicAdd(address, value);
}
__device__ __forceinline__ void AtomicAdd(BFloat16* address, float value) {
  const uintptr_t at = reinterpret_cast<uintptr_t>(address);
  unsigned int* word = reinterpret_cast<unsigned int*>(at & ~uintptr_t{3});
  const unsigned int shift = (at & 2) ? 16 : 0;
  unsigned int old = *word, assumed;
  do {
    assumed = old;
    BFloat16 current;
    current.bits = static_cast<uint16_t>(assumed >> shift);
    const unsigned int sum = ToBFloat16(ToFloat(current) + value).bits;
    const unsigned int updated =
        (assumed & ~(0xffffu << shift)) | (sum << shift);
    old = atomicCAS(word, assumed, updated);
  } while (assumed != old);
}

// The most values per row a launch takes (their factors sit in shared
// memory): ValidateTopKValueGradients (heads/top_k_gradient.cc) refuses a
// larger k, and AddCudaTopKValueGradients (heads/cuda_head.cc) calls it
// before every launch.
constexpr int32_t kMaxTopK = 64;
static_assert(kMaxTopK <= kThreads, "one pass of the block loads a row's k");

// One row's products a . b[id_j] (x . W[id] or u . M[id]) over `width`
// values, given the row's ids and chain factors c_j: grad_a += sum_j c_j
// b[id_j] and, atomically, grad_b[id_j] += c_j a and grad_bias[id_j] += c_j,
// each where given.
template <typename T>
__device__ __forceinline__ void AddTopKProducts(
    const T* a, const T* b, const int32_t* ids, const float* chain, int32_t k,
    int64_t width, T* grad_a, T* grad_b, T* grad_bias) {
  for (int64_t h = threadIdx.x; h < width; h += kThreads) {
    float sum = 0;
    const float x = ToFloat(a[h]);
    for (int32_t j = 0; j < k; ++j) {
      const int32_t id = ids[j];
      if (id < 0) continue;
      const float c = chain[j];
      sum += c * ToFloat(b[int64_t{id} * width + h]);
      if (grad_b != nullptr) {
        AtomicAdd(grad_b + int64_t{id} * width + h, c * x);
      }
      if (grad_bias != nullptr && h == 0) AtomicAdd(grad_bias + id, c);
    }
    if (grad_a != nullptr) grad_a[h] = FromFloat<T>(ToFloat(grad_a[h]) + sum);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    TopKValueGradientKernel(const T* hidden, const T* weight,
                            const int32_t* ids, const float* values,
                            const float* grad_values, int32_t k, int64_t width,
                            LogitTransform transform, T* grad_hidden,
                            T* grad_weight, T* grad_bias,
                            const T* correction_inputs,
                            const T* correction_weight, int64_t rank,
                            T* grad_correction_inputs,
                            T* grad_correction_weight) {
  const int64_t r = blockIdx.x;
  // The row's ids and chain factors, once per row (k <= kMaxTopK).
  DFLASH_SHARED_ARRAY(int32_t, row_ids, kMaxTopK);
  DFLASH_SHARED_ARRAY(float, chain, kMaxTopK);
  if (const int32_t j = threadIdx.x; j < k) {
    const int64_t at = r * k + j;
    row_ids[j] = ids[at];
    // In double, as the CPU's AddTopKValueGradients; unread for id -1.
    chain[j] =
        ids[at] < 0
            ? 0.0f
            : static_cast<float>(transform.Chain(grad_values[at], values[at]));
  }
  __syncthreads();
  AddTopKProducts(hidden + r * width, weight, row_ids, chain, k, width,
                  grad_hidden + r * width, grad_weight, grad_bias);
  // With a correction the values' logits hold u[r] . M[id] too.
  const bool correction =
      grad_correction_inputs != nullptr || grad_correction_weight != nullptr;
  if (rank > 0 && correction) {
    AddTopKProducts<T>(correction_inputs + r * rank, correction_weight,
                       row_ids, chain, k, rank,
                       grad_correction_inputs != nullptr
                           ? grad_correction_inputs + r * rank
                           : nullptr,
                       grad_correction_weight, nullptr);
  }
}

}  // namespace

template <typename T>
void LaunchAddTopKValueGradients(const T* hidden, const T* weight,
                                 const int32_t* ids, const float* values,
                                 const float* grad_values, int64_t rows,
                                 int32_t k, int64_t width, double logit_scale,
                                 double logit_softcap, T* grad_hidden,
                                 T* grad_weight, T* grad_bias,
                                 const T* correction_inputs,
                                 const T* correction_weight, int64_t rank,
                                 T* grad_correction_inputs,
                                 T* grad_correction_weight,
                                 CUstream_st* stream) {
  if (rows == 0 || k == 0) return;
  DFLASH_LAUNCH(TopKValueGradientKernel<T>, static_cast<unsigned>(rows),
                kThreads, 0, stream)
  (hidden, weight, ids, values, grad_values, k, width,
   LogitTransform(logit_scale, logit_softcap), grad_hidden, grad_weight,
   grad_bias, correction_inputs, correction_weight, rank,
   grad_correction_inputs, grad_correction_weight);
}

template <typename T>
__global__ void ScaleToStorageKernel(const float* sum, int64_t count,
                                     float scale, const double* device_scale,
                                     T* out) {
  if (device_scale != nullptr) scale = static_cast<float>(*device_scale);
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    out[i] = FromFloat<T>(sum[i] * scale);
  }
}

template <typename T>
void LaunchScaleToStorage(const float* sum, int64_t count, double scale,
                          T* out, CUstream_st* stream,
                          const double* device_scale) {
  if (count == 0) return;
  DFLASH_LAUNCH(ScaleToStorageKernel<T>, Blocks(count), kThreads, 0, stream)
  (sum, count, static_cast<float>(scale), device_scale, out);
}

__global__ void ScaleDoubleToFloatKernel(const double* values, int64_t count,
                                         double scale,
                                         const double* device_scale,
                                         float* out) {
  if (device_scale != nullptr) scale = *device_scale;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    out[i] = static_cast<float>(values[i] * scale);
  }
}

void LaunchScaleDoubleToFloat(const double* values, int64_t count,
                              double scale, float* out, CUstream_st* stream,
                              const double* device_scale) {
  if (count == 0) return;
  DFLASH_LAUNCH(ScaleDoubleToFloatKernel, Blocks(count), kThreads, 0, stream)
  (values, count, scale, device_scale, out);
}

void LaunchBlockTerms(const RowMeta* rows, int64_t count, int64_t block_size,
                      int64_t first_position, const LossParams& loss,
                      const double* q, const int32_t* rank,
                      const double* teacher, double* out,
                      CUstream_st* stream) {
  DFLASH_LAUNCH(BlockTermsKernel, 1, kBlockTermsThreads, 0, stream)
  (rows, count, block_size, first_position, loss, q, rank, teacher, out);
}

void LaunchFillInt32(int32_t* data, int64_t count, int32_t value,
                     CUstream_st* stream) {
  if (count == 0) return;
  DFLASH_LAUNCH(FillKernel, Blocks(count), kThreads, 0, stream)
  (data, count, value);
}

void LaunchBuildRows(const RowsTensor& target_ids,
                     const RowsTensor& weight_mask,
                     const BuildRowsParams& params, RowMeta* rows,
                     unsigned long long* error, double* tile_sums,
                     CUstream_st* stream) {
  DFLASH_LAUNCH(FillErrorKernel, 1, 1, 0, stream)(error);
  const int64_t total = params.batch * params.anchors * params.block;
  if (total == 0) return;
  DFLASH_LAUNCH(BuildRowsKernel, Blocks(total), kThreads, 0, stream)
  (target_ids, weight_mask, params, total, rows, error);
  const int64_t tiles = (total + kRowsSumTile - 1) / kRowsSumTile;
  DFLASH_LAUNCH(TileSumsKernel, Blocks(tiles), kThreads, 0, stream)
  (weight_mask, params, total, tile_sums);
  DFLASH_LAUNCH(MaskSumKernel, 1, 1, 0, stream)
  (weight_mask, params, total, tile_sums, error);
  if (params.loss.sequence_balanced && params.sequence_rows > 0) {
    const int64_t sequences =
        (total + params.sequence_rows - 1) / params.sequence_rows;
    DFLASH_LAUNCH(SequenceSharesKernel, Blocks(sequences), kThreads, 0, stream)
    (params, total, rows);
  }
}

void LaunchRowLists(const RowMeta* rows, int64_t count, const LossParams& loss,
                    int64_t* all, int64_t* weighted, CUstream_st* stream) {
  if (count == 0) return;
  DFLASH_LAUNCH(RowListsKernel, Blocks(count), kThreads, 0, stream)
  (rows, count, loss, all, weighted);
}

#define DFLASH_INSTANTIATE_HEAD_KERNELS(T)                                     \
  template void LaunchGatherRows<T>(const T*, int64_t, const int64_t*,         \
                                    int64_t, T*, CUstream_st*);                \
  template void LaunchScatterRows<T>(const T*, int64_t, const int64_t*,        \
                                     int64_t, T*, CUstream_st*);               \
  template void LaunchAddBias<T>(T*, const T*, int64_t, int64_t, int64_t,      \
                                 CUstream_st*);                                \
  template void LaunchAccumulateBiasGradient<T, T>(                            \
      const T*, int64_t, int64_t, int64_t, T*, CUstream_st*);                  \
  template void LaunchAddTopKValueGradients<T>(                                \
      const T*, const T*, const int32_t*, const float*, const float*, int64_t, \
      int32_t, int64_t, double, double, T*, T*, T*, const T*, const T*,        \
      int64_t, T*, T*, CUstream_st*);                                          \
  template void LaunchScaleToStorage<T>(const float*, int64_t, double, T*,     \
                                        CUstream_st*, const double*);
DFLASH_INSTANTIATE_HEAD_KERNELS(float)
DFLASH_INSTANTIATE_HEAD_KERNELS(BFloat16)
// A BF16 head's bias gradient summed over chunks in FP32, rounded once.
template void LaunchAccumulateBiasGradient<BFloat16, float>(
    const BFloat16*, int64_t, int64_t, int64_t, float*, CUstream_st*);
#undef DFLASH_INSTANTIATE_HEAD_KERNELS

}  // namespace cuda
}  // namespace dflash
