// The CUDA row kernels; see cuda_row_kernels.h. One thread block per row:
// every pass over a row's V logits is a strided loop with 16-byte vector
// loads, reduced across the block in a fixed tree (deterministic results),
// accumulating in FP32; the per-row scalars are computed in double.
#include <cuda_runtime.h>

#include <cassert>
#include <cfloat>
#include <cmath>
#include <cstdint>

#include "base/bfloat16.h"
#include "base/cuda_launch.h"
#include "losses/cuda_row_kernels.h"
#include "losses/loss_math.h"
#include "losses/top_k_cursor.h"

namespace dflash {
namespace cuda {
namespace {

constexpr int kThreads = 512;  // A power of two: the reduction tree halves.

__device__ __forceinline__ float ToF(float x) { return x; }
__device__ __forceinline__ float ToF(BFloat16 x) { return ToFloat(x); }
template <typename T>
__device__ __forceinline__ T FromF(float f);
template <>
__device__ __forceinline__ float FromF<float>(float f) {
  return f;
}
template <>
__device__ __forceinline__ BFloat16 FromF<BFloat16>(float f) {
  return ToBFloat16(f);
}

// z -> z' (logit scale and tanh softcap) and its chain rule, in double
// and rounded to float, as the CPU's float rows take them.
struct Transform {
  __device__ __forceinline__ explicit Transform(const ChunkLossOptions& o)
      : transform(o.logit_scale, o.logit_softcap),
        identity(transform.identity()) {}
  LogitTransform transform;
  bool identity;
  __device__ __forceinline__ float operator()(float z) const {
    return identity ? z : static_cast<float>(transform(z));
  }
  // d/dz from d/dz', given z'.
  __device__ __forceinline__ float Chain(float g, float zp) const {
    return identity ? g : static_cast<float>(transform.Chain(g, zp));
  }
};

// A 16-byte vector's elements and back, copied rather than reinterpreted (a
// uint4 read through a T* is undefined behaviour that g++ -O2 miscompiles).
// Loads are plain, not __ldg: the kernels write the logits they read.
template <typename T>
struct Packed {
  static constexpr int kSize = 16 / sizeof(T);
  T values[kSize];
  __device__ __forceinline__ explicit Packed(const uint4& bits) {
    memcpy(values, &bits, 16);
  }
  __device__ __forceinline__ uint4 Bits() const {
    uint4 bits;
    memcpy(&bits, values, 16);
    return bits;
  }
};

// Whether a row of n values from `row`, with `readable` values readable
// from its start, takes 16-byte vectors: aligned, and n a whole number of
// them or padded to one.
template <typename T>
__device__ __forceinline__ bool Vectorised(const T* row, int64_t n,
                                           int64_t readable) {
  constexpr int kVec = 16 / sizeof(T);
  const int64_t whole = (n + kVec - 1) / kVec * kVec;
  return (reinterpret_cast<uintptr_t>(row) & 15) == 0 && whole <= readable;
}

// f(i, x[i]) for this thread's elements of a row, with 16-byte loads where
// the row allows them.
template <typename T, typename F>
__device__ __forceinline__ void ForRow(const T* row, int64_t n,
                                       int64_t readable, F&& f) {
  constexpr int kVec = 16 / sizeof(T);
  if (Vectorised(row, n, readable)) {
    const uint4* vec = reinterpret_cast<const uint4*>(row);
    for (int64_t i = threadIdx.x; i * kVec < n; i += kThreads) {
      const Packed<T> e(vec[i]);
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        if (i * kVec + j < n) f(i * kVec + j, ToF(e.values[j]));
      }
    }
  } else {
    for (int64_t i = threadIdx.x; i < n; i += kThreads) f(i, ToF(row[i]));
  }
}

// f(i, z[i], t[i]) over two rows (t may be null: then t[i] = z[i]).
template <typename T, typename F>
__device__ __forceinline__ void ForRows(const T* z, const T* t, int64_t n,
                                        int64_t readable, F&& f) {
  if (t == nullptr) {
    ForRow(z, n, readable, [&](int64_t i, float x) { f(i, x, x); });
    return;
  }
  constexpr int kVec = 16 / sizeof(T);
  if (Vectorised(z, n, readable) && Vectorised(t, n, readable)) {
    const uint4* zv = reinterpret_cast<const uint4*>(z);
    const uint4* tv = reinterpret_cast<const uint4*>(t);
    for (int64_t i = threadIdx.x; i * kVec < n; i += kThreads) {
      const Packed<T> ze(zv[i]), te(tv[i]);
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        if (i * kVec + j < n) {
          f(i * kVec + j, ToF(ze.values[j]), ToF(te.values[j]));
        }
      }
    }
  } else {
    for (int64_t i = threadIdx.x; i < n; i += kThreads) {
      f(i, ToF(z[i]), ToF(t[i]));
    }
  }
}

// row[i] = g(i, row[i], t[i]) in place for i < n, with 16-byte loads and
// stores where the rows allow them (t may be null); padding is stored
// back unchanged.
template <typename T, typename G>
__device__ __forceinline__ void MapRow(T* row, const T* t, int64_t n,
                                       int64_t readable, G&& g) {
  constexpr int kVec = 16 / sizeof(T);
  if (Vectorised(row, n, readable) &&
      (t == nullptr || Vectorised(t, n, readable))) {
    uint4* zv = reinterpret_cast<uint4*>(row);
    const uint4* tv = reinterpret_cast<const uint4*>(t);
    for (int64_t i = threadIdx.x; i * kVec < n; i += kThreads) {
      Packed<T> ze(zv[i]);
      const Packed<T> te(t != nullptr ? tv[i] : zv[i]);
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        if (i * kVec + j < n) {
          ze.values[j] =
              FromF<T>(g(i * kVec + j, ToF(ze.values[j]), ToF(te.values[j])));
        }
      }
      zv[i] = ze.Bits();
    }
  } else {
    for (int64_t i = threadIdx.x; i < n; i += kThreads) {
      const float x = ToF(row[i]);
      row[i] = FromF<T>(g(i, x, t != nullptr ? ToF(t[i]) : x));
    }
  }
}

template <typename T>
__device__ void ZeroRow(T* row, int64_t n) {
  for (int64_t i = threadIdx.x; i < n; i += kThreads) row[i] = FromF<T>(0.0f);
}

// The block's reduction of `value` by `op` in a fixed tree; every thread
// gets the result.
template <typename S, typename Op>
__device__ S BlockReduce(S value, Op op) {
  // The tree below covers kThreads threads, every launch's block size.
  assert(blockDim.x == kThreads);
  DFLASH_SHARED_ARRAY(S, buffer, kThreads);
  buffer[threadIdx.x] = value;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) {
      buffer[threadIdx.x] =
          op(buffer[threadIdx.x], buffer[threadIdx.x + stride]);
    }
    __syncthreads();
  }
  const S result = buffer[0];
  __syncthreads();
  return result;
}

struct Pair {
  float a, b;
};
__device__ __forceinline__ Pair AddPairs(Pair x, Pair y) {
  return {x.a + y.a, x.b + y.b};
}

__device__ __forceinline__ void ReportError(unsigned long long* error,
                                            int64_t row, ErrorKind kind,
                                            int64_t logit = 0,
                                            float value = 0) {
  atomicMin(error, ErrorCode(row, kind, logit, value));
}

// Reports the first i < n whose value_at(i) is not finite (the row's first
// bad logit, which the CPU's message names); every thread calls it.
template <typename F>
__device__ void ReportFirstNonFinite(unsigned long long* error, int64_t row,
                                     ErrorKind kind, int64_t n, F&& value_at) {
  for (int64_t i = threadIdx.x; i < n; i += kThreads) {
    const float x = value_at(i);
    if (!isfinite(x)) {
      ReportError(error, row, kind, i, x);
      return;
    }
  }
}

__device__ __forceinline__ int64_t OutRow(const int64_t* out_rows, int64_t r) {
  return out_rows != nullptr ? out_rows[r] : r;
}

// Teacher logits with a loss that reads none: the teacher diagnostics.
template <typename T>
__device__ __forceinline__ bool TeacherMetrics(const KernelParams& p,
                                               const ChunkArgs<T>& a) {
  return a.teacher != nullptr && p.loss.family != LossFamily::kDSpark &&
         p.loss.family != LossFamily::kDistillation &&
         p.loss.family != LossFamily::kDomino;
}

// e^x by the hardware's exp2 (ex2.approx of x log2(e): a few ulp near the
// row's maximum, where the sums take their value; results below 2^-126
// flush to zero). For the per-logit loops, which expf's exact range
// reduction made compute-bound; per-row scalars keep expf and exp.
__device__ __forceinline__ float FastExp(float x) { return __expf(x); }

// Online logsumexp (and, `tempered`, at 1/inv_t too), argmax (first index
// of the maximum), sum, and a finiteness flag, over this thread's elements.
struct Online {
  // -inf, so a row whose largest value is -FLT_MAX still gets its first
  // index, as on the CPU.
  float max = -INFINITY;
  int32_t argmax = INT32_MAX;
  float sum = 0;    // Sum of exp(x - max).
  float sum_t = 0;  // Sum of exp((x - max) * inv_t).
  float total = 0;  // Sum of x.
  int32_t bad = 0;
};

__device__ __forceinline__ void Add(Online& s, int64_t i, float x, float inv_t,
                                    bool tempered) {
  s.bad |= !isfinite(x);
  if (x > s.max) {
    const float shift = s.max - x;  // -inf at the first element: exp is 0.
    s.sum = s.sum * FastExp(shift) + 1;
    if (tempered) s.sum_t = s.sum_t * FastExp(shift * inv_t) + 1;
    s.max = x;
    s.argmax = static_cast<int32_t>(i);
  } else {
    s.sum += FastExp(x - s.max);
    if (tempered) s.sum_t += FastExp((x - s.max) * inv_t);
  }
  s.total += x;
}

__device__ __forceinline__ Online Merge(Online a, Online b, float inv_t,
                                        bool tempered) {
  Online m;
  m.bad = a.bad | b.bad;
  m.total = a.total + b.total;
  if (b.max > a.max || (b.max == a.max && b.argmax < a.argmax)) {
    const Online t = a;
    a = b;
    b = t;
  }
  m.max = a.max;
  m.argmax = a.argmax;
  if (b.sum == 0) {
    m.sum = a.sum;
    m.sum_t = a.sum_t;
  } else {
    const float shift = b.max - a.max;
    m.sum = a.sum + b.sum * expf(shift);
    m.sum_t = tempered ? a.sum_t + b.sum_t * expf(shift * inv_t) : 0;
  }
  return m;
}

// Pass 1: the row's statistics (of z' and of the teacher's t'). Three
// blocks per multiprocessor (at most 40 registers) rather than two.
template <typename T>
__global__ void __launch_bounds__(kThreads, 3)
    StatsKernel(KernelParams p, ChunkArgs<T> a) {
  const int64_t r = blockIdx.x;
  const Row meta = a.meta[r];
  if (meta.mask == 0) {
    // Defined for the passes that load a row's stats before its mask.
    if (threadIdx.x == 0) a.stats[r] = RowStats{};
    return;
  }
  const int64_t v = p.vocab;
  const int64_t out = OutRow(a.out_rows, r);
  const Transform transform(p.options);
  const bool distill = p.loss.family == LossFamily::kDistillation;
  const float inv_t = static_cast<float>(p.loss.inv_temperature);
  // A second exponential sum only at a temperature other than 1.
  const bool tempered = distill && inv_t != 1.0f;
  const T* z_row = a.logits + r * a.stride;
  DFLASH_SHARED(float, target);
  Online s;
  ForRow(z_row, v, a.stride, [&](int64_t i, float x) {
    const float z = transform(x);
    Add(s, i, z, inv_t, tempered);
    if (i == meta.target) target = z;
  });
  s = BlockReduce(
      s, [&](Online x, Online y) { return Merge(x, y, inv_t, tempered); });
  if (s.bad) {
    ReportFirstNonFinite(a.error, out, kLogitNotFinite, v,
                         [&](int64_t i) { return transform(ToF(z_row[i])); });
  }
  // The teacher's statistics where the loss reads them, as on the CPU:
  // distillation and DSpark skip rows without weight.
  const bool teacher =
      a.teacher != nullptr &&
      (p.loss.dpard || TeacherMetrics(p, a) || meta.weight != 0);
  const float teacher_inv_t = distill ? inv_t : 1.0f;
  const bool teacher_tempered = teacher_inv_t != 1.0f;
  Online t;
  if (teacher) {
    const T* t_row = a.teacher + r * a.stride;
    ForRow(t_row, v, a.stride, [&](int64_t i, float x) {
      Add(t, i, transform(x), teacher_inv_t, teacher_tempered);
    });
    t = BlockReduce(t, [&](Online x, Online y) {
      return Merge(x, y, teacher_inv_t, teacher_tempered);
    });
    if (t.bad) {
      ReportFirstNonFinite(a.error, out, kTeacherNotFinite, v,
                           [&](int64_t i) { return transform(ToF(t_row[i])); });
    }
  }
  if (threadIdx.x != 0) return;
  RowStats& stats = a.stats[r];
  // Every field written (0 where unused), so no pass reads undefined
  // memory.
  stats = RowStats{};
  stats.max = s.max;
  stats.log_sum = logf(s.sum);
  if (distill) {
    stats.lse_t =
        tempered ? s.max * inv_t + logf(s.sum_t) : s.max + stats.log_sum;
  }
  stats.target = target;
  stats.sum = s.total;
  stats.argmax = s.argmax;
  if (teacher) {
    stats.t_lse = teacher_tempered ? t.max * teacher_inv_t + logf(t.sum_t)
                                   : t.max + logf(t.sum);
    stats.t_argmax = t.argmax;
  }
}

// The block's first candidate in the row's order (Precedes); every thread
// gets it. Warp shuffles, then the warps' firsts: two barriers.
__device__ __forceinline__ Candidate BlockFirst(Candidate c) {
  constexpr int kWarps = kThreads / 32;
  static_assert(kWarps <= 32 && (kWarps & (kWarps - 1)) == 0,
                "the warps' firsts are reduced by one warp's shuffles");
  DFLASH_SHARED_ARRAY(Candidate, firsts, kWarps);
  auto warp_first = [](Candidate x, int width) {
    for (int offset = width / 2; offset > 0; offset /= 2) {
      const Candidate other{__shfl_xor_sync(0xffffffffu, x.value, offset),
                            __shfl_xor_sync(0xffffffffu, x.index, offset)};
      if (Precedes(other, x)) x = other;
    }
    return x;
  };
  c = warp_first(c, 32);
  if (threadIdx.x % 32 == 0) firsts[threadIdx.x / 32] = c;
  __syncthreads();
  c = warp_first(firsts[threadIdx.x % kWarps], kWarps);
  __syncthreads();
  return c;
}

// Each thread's list of its best elements: 8 fit in registers and rarely
// run out (a thread refills only when it holds more than 8 of the top k).
constexpr int kTopKList = 8;

// The k largest z' of each row with mask, largest first, ties to the lower
// index, in one pass: each thread keeps its own best (TopKCursor) and the
// block merges their heads pick by pick. One list serves the caller's top-k
// and the diagnostics' (the shorter is a prefix of the longer); the
// latter's target rank and softmax mass go to row_terms' slots, times the
// mask.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    TopKKernel(KernelParams p, ChunkArgs<T> a) {
  const int64_t r = blockIdx.x;
  const int64_t out = OutRow(a.out_rows, r);
  const Row meta = a.meta[r];
  const Transform transform(p.options);
  const int32_t caller_k = a.top_k != nullptr ? a.k : 0;
  const int32_t picks = caller_k > a.metric_k ? caller_k : a.metric_k;
  const float max = a.stats[r].max, log_sum = a.stats[r].log_sum;
  const bool teacher_metrics = TeacherMetrics(p, a);
  const float t_lse = a.stats[r].t_lse;
  int32_t rank = -1;
  double mass = 0, teacher_mass = 0;
  if (meta.mask == 0) {
    for (int32_t j = threadIdx.x; j < caller_k; j += kThreads) {
      a.top_k[out * a.k + j] = -1;
      if (a.top_k_values != nullptr) a.top_k_values[out * a.k + j] = 0;
    }
  } else {
    const T* row = a.logits + r * a.stride;
    auto scan = [&](auto offer) {
      ForRow(row, p.vocab, a.stride, [&](int64_t i, float x) {
        offer(Candidate{transform(x), static_cast<int32_t>(i)});
      });
    };
    TopKCursor<kTopKList> cursor;
    cursor.Fill(scan);
    for (int32_t j = 0; j < picks; ++j) {
      const Candidate best = BlockFirst(cursor.Head());
      if (cursor.HasHead() && cursor.Head().index == best.index) {
        cursor.Pop(scan);
      }
      // Fewer candidates than picks only in a row of NaNs (an error).
      const bool found = best.index < p.vocab;
      if (threadIdx.x != 0) continue;
      if (j < caller_k) {
        a.top_k[out * a.k + j] = found ? best.index : -1;
        if (a.top_k_values != nullptr) {
          a.top_k_values[out * a.k + j] = found ? best.value : 0;
        }
      }
      if (j < a.metric_k && found) {
        if (best.index == meta.target) rank = j;
        mass += exp((static_cast<double>(best.value) - max) - log_sum);
        if (teacher_metrics) {
          const float t = transform(ToF(a.teacher[r * a.stride + best.index]));
          teacher_mass += exp(static_cast<double>(t) - t_lse);
        }
      }
    }
  }
  if (threadIdx.x == 0) {
    a.row_terms[kTermSlots * r + kTopKRecall] =
        rank >= 0 ? double{meta.mask} : 0.0;
    a.row_terms[kTermSlots * r + kTopKMass] = meta.mask * mass;
    a.row_terms[kTermSlots * r + kTeacherTopKMass] = meta.mask * teacher_mass;
    if (a.target_rank != nullptr) a.target_rank[out] = rank;
  }
}

// D-PACE block weights and lk-lambda's CE share, one thread per block run.
__global__ void BlockWeightsKernel(LossParams p, const Row* meta,
                                   const RowStats* stats,
                                   const int32_t* block_begin, int32_t blocks,
                                   const double* accept, double* weight,
                                   double* ce_share) {
  const int32_t b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= blocks) return;
  const int32_t begin = block_begin[b], end = block_begin[b + 1];
  if (p.dpard) {
    // D-PARD: the credit, over each row's acceptance, into ce_share; the
    // confidence term keeps the row's decayed weight.
    DPaceBlockWeights(
        DPardCreditParams(p), end - begin,
        [&](int64_t i) { return accept[begin + i]; },
        [&](int64_t i) { return double{meta[begin + i].mask}; },
        ce_share + begin);
    for (int32_t r = begin; r < end; ++r) weight[r] = meta[r].weight;
    return;
  }
  auto q = [&](int64_t i) {
    const int64_t r = begin + i;
    return meta[r].mask > 0
               ? exp((static_cast<double>(stats[r].target) - stats[r].max) -
                     stats[r].log_sum)
               : 0.0;
  };
  auto mask = [&](int64_t i) { return double{meta[begin + i].mask}; };
  if (p.lk == LkMode::kLambdaBlock) {
    const double share = LkLambdaBlockShare(p, end - begin, q, mask);
    for (int32_t r = begin; r < end; ++r) {
      weight[r] = meta[r].weight;
      ce_share[r] = share;
    }
    return;
  }
  DPaceBlockWeights(p, end - begin, q, mask, weight + begin);
  for (int32_t r = begin; r < end; ++r) ce_share[r] = 1;
}

// |p - t|_1 of a row's draft and teacher softmax, before any gradient
// overwrites z'.
template <typename T>
__device__ float TeacherL1(const KernelParams& p, const RowStats& s,
                           const T* z_row, const T* t_row, int64_t stride) {
  const Transform transform(p.options);
  const float max_f = s.max, log_sum_f = s.log_sum, t_lse = s.t_lse;
  float l1 = 0;
  ForRows(z_row, t_row, p.vocab, stride, [&](int64_t, float x, float y) {
    l1 += fabsf(expf((transform(x) - max_f) - log_sum_f) -
                expf(transform(y) - t_lse));
  });
  return BlockReduce(l1, [](float x, float y) { return x + y; });
}

// D-PARD's pass before the block credit: each row's acceptance.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    AcceptanceKernel(KernelParams p, ChunkArgs<T> a) {
  const int64_t r = blockIdx.x;
  const Row meta = a.meta[r];
  if (meta.mask == 0) {
    if (threadIdx.x == 0) a.accept[r] = 0;
    return;
  }
  const float l1 = TeacherL1(p, a.stats[r], a.logits + r * a.stride,
                             a.teacher + r * a.stride, a.stride);
  if (threadIdx.x == 0) a.accept[r] = DSparkAcceptance(l1);
}

// DSpark's teacher terms of a row with weight w and acceptance `accept`:
// top-1 probabilities, agreement, the confidence term (into num and the
// confidence gradient). Thread 0 writes them.
template <typename T>
__device__ void DSparkTeacherTerms(const KernelParams& p,
                                   const ChunkArgs<T>& a, const RowStats& s,
                                   const Row& meta, int64_t r, int64_t out,
                                   double w, double accept, double* terms,
                                   double& num) {
  if (threadIdx.x != 0) return;
  const Transform transform(p.options);
  // A teacher row without a finite value has no argmax (its error is
  // reported already): read nothing past the row.
  const float t_max = s.t_argmax < p.vocab
                          ? transform(ToF(a.teacher[r * a.stride + s.t_argmax]))
                          : NAN;
  terms[kTeacherTop1] = meta.mask * exp(static_cast<double>(t_max) - s.t_lse);
  terms[kDraftTop1] = meta.mask * exp(-static_cast<double>(s.log_sum));
  terms[kTeacherAcceptance] = meta.mask * accept;
  terms[kTeacherAgreement] = s.t_argmax == s.argmax ? double{meta.mask} : 0.0;
  if (a.teacher_acceptance != nullptr) a.teacher_acceptance[out] = accept;
  if (p.loss.confidence_weight > 0) {
    const double c = a.confidence[out];
    if (!isfinite(c)) {
      ReportError(a.error, out, kConfidenceNotFinite, 0, static_cast<float>(c));
      return;
    }
    const double bce = ConfidenceBce(c, accept);
    terms[kConfidenceNum] = w * bce;
    terms[kConfidenceErrorNum] = w * fabs(1 / (1 + exp(-c)) - accept);
    num += w * p.loss.confidence_weight * bce;
    if (a.confidence_grad != nullptr) {
      a.confidence_grad[out] = static_cast<float>(
          w * p.loss.confidence_weight * ConfidenceBceGradient(c, accept));
    }
  }
}

// What LossKernel's parts read of row r (out: its output row; z, t: its
// logits and teacher logits; terms: its term slots), with its stats, loss
// weight w and CE. The parts are forceinline so that the kernel compiles as
// one function, as it did before the split.
template <typename T>
struct LossRow {
  int64_t r, out;
  T* z;
  const T* t;
  double* terms;
  Row meta;
  RowStats s;
  double w, neg_log_q;
};

// The row's d/dz in place: gradient(i, z', y) is d/dz' at the transformed
// logit z' (y: the teacher's logit from `teacher`, or z's own where it is
// null), chained through the transform; a result that is not finite is
// the row's error.
template <typename T, typename G>
__device__ __forceinline__ void WriteRowGradient(const KernelParams& p,
                                                 const ChunkArgs<T>& a,
                                                 const LossRow<T>& row,
                                                 const T* teacher,
                                                 G&& gradient) {
  const Transform transform(p.options);
  bool bad = false;
  MapRow(row.z, teacher, p.vocab, a.stride, [&](int64_t i, float x, float y) {
    const float zp = transform(x);
    const float chained = transform.Chain(gradient(i, zp, y), zp);
    bad |= !isfinite(chained);
    return chained;
  });
  if (bad) ReportError(a.error, row.out, kGradientNotFinite);
}

// A row without a mask: zero gradient, terms and outputs.
template <typename T>
__device__ __forceinline__ void MaskedRow(const KernelParams& p,
                                          const ChunkArgs<T>& a, int64_t out,
                                          T* z_row, double* terms) {
  ZeroRow(z_row, p.vocab);
  if (threadIdx.x != 0) return;
  for (int j = 0; j < kTermSlots; ++j) terms[j] = 0;
  if (a.neg_log_q != nullptr) a.neg_log_q[out] = 0;
  if (a.target_probability != nullptr) a.target_probability[out] = 0;
  if (a.target_rank != nullptr) a.target_rank[out] = -1;
  if (a.loss_weight != nullptr) a.loss_weight[out] = 0;
  if (a.teacher_acceptance != nullptr) a.teacher_acceptance[out] = 0;
  if (a.argmax != nullptr) a.argmax[out] = -1;
  if (a.confidence_grad != nullptr) a.confidence_grad[out] = 0;
}

// Every term slot of a row with a mask, set before the family adds its own
// (the metrics; 0 for the rest), and the per-row outputs. Thread 0 writes.
template <typename T>
__device__ __forceinline__ void RowMetrics(const ChunkArgs<T>& a,
                                           const LossRow<T>& row) {
  if (threadIdx.x != 0) return;
  const RowStats& s = row.s;
  const int64_t out = row.out;
  double* terms = row.terms;
  const double hit = row.meta.mask > 0.5f && s.argmax == row.meta.target;
  terms[kLossDen] = row.w;
  terms[kCorrect] = hit;
  terms[kAccuracyDen] = row.meta.mask;
  terms[kTargetProbability] = row.meta.mask * exp(-row.neg_log_q);
  terms[kCeNum] = 0;
  terms[kTvNum] = 0;
  if (a.metric_k == 0) {  // Else TopKKernel wrote them.
    terms[kTopKRecall] = 0;
    terms[kTopKMass] = 0;
    terms[kTeacherTopKMass] = 0;
  }
  terms[kTeacherAcceptance] = 0;
  terms[kTeacherAgreement] = 0;
  for (int j = kL1Num; j < kTermSlots; ++j) terms[j] = 0;
  if (a.target_probability != nullptr) {
    a.target_probability[out] = exp(-row.neg_log_q);
  }
  if (a.loss_weight != nullptr) a.loss_weight[out] = static_cast<float>(row.w);
  if (a.neg_log_q != nullptr) {
    a.neg_log_q[out] = static_cast<float>(row.neg_log_q);
  }
  if (a.argmax != nullptr) a.argmax[out] = s.argmax;
  if (a.confidence_grad != nullptr) a.confidence_grad[out] = 0;
}

// The teacher diagnostics (teacher logits for a loss that reads none),
// before any gradient overwrites z'.
template <typename T>
__device__ __forceinline__ void TeacherDiagnostics(const KernelParams& p,
                                                   const ChunkArgs<T>& a,
                                                   const LossRow<T>& row) {
  const float l1 = TeacherL1(p, row.s, row.z, row.t, a.stride);
  if (threadIdx.x != 0) return;
  const double accept = DSparkAcceptance(l1);
  row.terms[kTeacherAcceptance] = row.meta.mask * accept;
  row.terms[kTeacherAgreement] =
      row.s.t_argmax == row.s.argmax ? double{row.meta.mask} : 0.0;
  if (a.teacher_acceptance != nullptr) a.teacher_acceptance[row.out] = accept;
}

// Distillation: the divergence of the tempered softmaxes and its gradient.
template <typename T>
__device__ __forceinline__ void DistillationLoss(const KernelParams& p,
                                                 const ChunkArgs<T>& a,
                                                 const LossRow<T>& row) {
  const Transform transform(p.options);
  const int64_t v = p.vocab;
  const float inv_t = static_cast<float>(p.loss.inv_temperature);
  const float lse_s = row.s.lse_t, lse_t = row.s.t_lse;
  const Divergence divergence = p.loss.divergence;
  const float beta = static_cast<float>(p.loss.beta);
  const float log_beta = logf(beta), log_rest = log1pf(-beta);
  // ls and lt of the student's z' and the teacher's logit y.
  auto logs = [&](float zp, float y, float& ls, float& lt) {
    ls = zp * inv_t - lse_s;
    lt = transform(y) * inv_t - lse_t;
  };
  const float g = static_cast<float>(row.w * p.loss.inv_temperature);
  auto point_at = [&](float zp, float y) {
    float ls, lt;
    logs(zp, y, ls, lt);
    return DistillationAt(divergence, beta, log_beta, log_rest, ls, lt);
  };
  Pair acc{0, 0};  // The divergence, and JSD's sum of s (ls - lm).
  if (divergence == Divergence::kForwardKl) {
    // Its gradient reads no row sum: one pass.
    WriteRowGradient(p, a, row, row.t, [&](int64_t, float zp, float y) {
      const DistillationPoint<float> point = point_at(zp, y);
      acc.a += point.divergence;
      return g * point.forward_gradient;
    });
    acc = BlockReduce(acc, AddPairs);
  } else {
    ForRows(row.z, row.t, v, a.stride, [&](int64_t, float x, float y) {
      const DistillationPoint<float> point = point_at(transform(x), y);
      acc.a += point.divergence;
      acc.b += point.student_part;
    });
    acc = BlockReduce(acc, AddPairs);
    WriteRowGradient(p, a, row, row.t, [&](int64_t, float zp, float y) {
      float ls, lt;
      logs(zp, y, ls, lt);
      return DistillationGradientAt(divergence, beta, log_beta, log_rest, ls,
                                    lt, acc.a, acc.b, g);
    });
  }
  if (threadIdx.x == 0) row.terms[kLossNum] = row.w * acc.a;
}

// D-PARD: credit * R, R = -2 log sum sqrt(q t), with the gradient
// credit * (q - sqrt(q t) / sum sqrt(q t)); CE reported, not trained.
template <typename T>
__device__ __forceinline__ void DPardLoss(const KernelParams& p,
                                          const ChunkArgs<T>& a,
                                          const LossRow<T>& row) {
  const Transform transform(p.options);
  const int64_t r = row.r;
  const RowStats& s = row.s;
  const double credit = a.ce_share[r], accept = a.accept[r];
  const float max_f = s.max, log_sum_f = s.log_sum, t_lse = s.t_lse;
  // log sqrt(q t) at z' and the teacher's logit y.
  auto log_root = [&](float zp, float y) {
    return 0.5f * (((zp - max_f) - log_sum_f) + (transform(y) - t_lse));
  };
  Online roots;
  ForRows(row.z, row.t, p.vocab, a.stride, [&](int64_t i, float x, float y) {
    Add(roots, i, log_root(transform(x), y), 1.0f, false);
  });
  roots = BlockReduce(roots, [](Online x, Online y) {
    return Merge(x, y, 1.0f, false);
  });
  const float log_total = roots.max + logf(roots.sum);
  const double renyi = -2.0 * log_total;
  double num = credit * renyi;
  DSparkTeacherTerms(p, a, s, row.meta, r, row.out, row.w, accept, row.terms,
                     num);
  if (threadIdx.x == 0) {
    row.terms[kLossNum] = num;
    row.terms[kDPardNum] = credit * renyi;
    row.terms[kDPardCredit] = credit;
    row.terms[kCeNum] = row.w * row.neg_log_q;
    row.terms[kCePosition] = row.meta.mask * row.neg_log_q;
  }
  const float c = static_cast<float>(credit);
  WriteRowGradient(p, a, row, row.t, [&](int64_t, float zp, float y) {
    return c * RenyiGradient(expf((zp - max_f) - log_sum_f),
                             log_root(zp, y) - log_total);
  });
}

// DSpark with a teacher: the softmax-family gradient (softmax, on_target,
// uniform; loss_num so far `num`) plus the L1 between draft and teacher
// softmax, and the teacher terms.
template <typename T>
__device__ __forceinline__ void DSparkLoss(const KernelParams& p,
                                           const ChunkArgs<T>& a,
                                           const LossRow<T>& row,
                                           float softmax, float on_target,
                                           float uniform, double num) {
  const Transform transform(p.options);
  const int64_t v = p.vocab;
  const RowStats& s = row.s;
  const double w = row.w;
  // softmax(z') = exp((z' - max) - log_sum): z' - max is exact in float.
  const float max_f = s.max, log_sum_f = s.log_sum;
  auto prob = [max_f, log_sum_f](float zp) {
    return FastExp((zp - max_f) - log_sum_f);
  };
  const float t_lse = s.t_lse;
  Pair acc{0, 0};  // L1 and the signed softmax mass sum p * sign(p - t).
  ForRows(row.z, row.t, v, a.stride, [&](int64_t, float x, float y) {
    const float pz = prob(transform(x));
    const float d = pz - FastExp(transform(y) - t_lse);
    acc.a += fabsf(d);
    acc.b += pz * SignOf(d);
  });
  acc = BlockReduce(acc, AddPairs);
  const double l1 = acc.a;
  num += w * p.loss.l1_weight * l1;
  if (threadIdx.x == 0 && p.loss.l1_weight > 0) row.terms[kL1Num] = w * l1;
  DSparkTeacherTerms(p, a, s, row.meta, row.r, row.out, w,
                     DSparkAcceptance(l1), row.terms, num);
  if (threadIdx.x == 0) row.terms[kLossNum] = num;
  const float l1c = static_cast<float>(w * p.loss.l1_weight);
  const float signed_mass = acc.b;
  WriteRowGradient(p, a, row, row.t, [&](int64_t i, float zp, float y) {
    const float pz = prob(zp);
    const float d = pz - FastExp(transform(y) - t_lse);
    float g = DSparkGradient(softmax, l1c, signed_mass, uniform, pz, d);
    if (i == row.meta.target) g -= on_target;
    return g;
  });
}

// Softmax family: CE (label-smoothed), tv, z-loss; DSpark adds L1 and the
// confidence BCE (DSparkLoss), reading its teacher only for a term that
// needs it.
template <typename T>
__device__ __forceinline__ void SoftmaxFamilyLoss(const KernelParams& p,
                                                  const ChunkArgs<T>& a,
                                                  const LossRow<T>& row) {
  const int64_t v = p.vocab;
  const RowStats& s = row.s;
  const double lse = static_cast<double>(s.max) + s.log_sum;
  const double ce_share = CrossEntropyShare(
      p.loss, p.loss.lk == LkMode::kLambdaBlock ? a.ce_share[row.r] : 1.0);
  const SoftmaxRowTerms terms =
      SoftmaxFamilyRow(p.loss, row.w, ce_share, row.neg_log_q, lse,
                       p.loss.label_smoothing > 0 ? double{s.sum} / v : 0.0);
  if (threadIdx.x == 0) {
    row.terms[kCeNum] = terms.ce;
    row.terms[kTvNum] = terms.tv;
    if (p.loss.family == LossFamily::kDSpark) {
      row.terms[kCePosition] = row.meta.mask * terms.ce / row.w;
    }
  }
  const float softmax = static_cast<float>(terms.softmax);
  const float on_target = static_cast<float>(terms.target);
  const float uniform = static_cast<float>(terms.uniform / v);
  if (p.loss.family == LossFamily::kDSpark && a.teacher != nullptr) {
    DSparkLoss(p, a, row, softmax, on_target, uniform, terms.loss);
    return;
  }
  if (threadIdx.x == 0) row.terms[kLossNum] = terms.loss;
  const Transform transform(p.options);
  // softmax(z') = exp((z' - max) - log_sum): z' - max is exact in float.
  const float max_f = s.max, log_sum_f = s.log_sum;
  WriteRowGradient(p, a, row, static_cast<const T*>(nullptr),
                   [&](int64_t i, float zp, float) {
                     float g =
                         softmax * FastExp((zp - max_f) - log_sum_f) - uniform;
                     if (i == row.meta.target) g -= on_target;
                     return g;
                   });
}

// Pass 2: terms and d(loss_num)/d(logits) of each row, in place.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    LossKernel(KernelParams p, ChunkArgs<T> a) {
  const int64_t r = blockIdx.x;
  const int64_t out = OutRow(a.out_rows, r);
  T* z_row = a.logits + r * a.stride;
  double* terms = a.row_terms + kTermSlots * r;
  const Row meta = a.meta[r];
  if (meta.mask == 0) {
    MaskedRow(p, a, out, z_row, terms);
    return;
  }
  const RowStats s = a.stats[r];
  LossRow<T> row{r,
                 out,
                 z_row,
                 a.teacher != nullptr ? a.teacher + r * a.stride : nullptr,
                 terms,
                 meta,
                 s,
                 CouplesBlocks(p.loss) ? a.weight[r] : meta.weight,
                 // max - target is exact in double; log_sum carries its own
                 // rounding only.
                 (static_cast<double>(s.max) - s.target) + s.log_sum};
  RowMetrics(a, row);
  if (TeacherMetrics(p, a)) TeacherDiagnostics(p, a, row);
  if (row.w == 0) {
    ZeroRow(z_row, p.vocab);
    if (threadIdx.x == 0) terms[kLossNum] = 0;
    return;
  }
  if (p.loss.family == LossFamily::kDistillation) {
    DistillationLoss(p, a, row);
  } else if (p.loss.dpard) {
    DPardLoss(p, a, row);
  } else {
    SoftmaxFamilyLoss(p, a, row);
  }
}

// Domino: each row's base logits and, from suffix_start, final = base +
// correction (the sum rounded to T, as SpecForge adds them), both
// transformed; CE of both mixed by lambda_base; d/d(base) = g_final +
// g_base and d/d(correction) = g_final (0 before the suffix), in place.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    DominoKernel(KernelParams p, ChunkArgs<T> a) {
  const int64_t r = blockIdx.x;
  const int64_t v = p.vocab;
  const int64_t out = OutRow(a.out_rows, r);
  T* base_row = a.logits + r * a.stride;
  T* correction_row = a.correction + r * a.stride;
  double* terms = a.row_terms + kTermSlots * r;
  const Row meta = a.meta[r];
  if (threadIdx.x == 0) {
    for (int j = 0; j < kTermSlots; ++j) terms[j] = 0;
  }
  if (meta.mask == 0) {
    ZeroRow(base_row, v);
    ZeroRow(correction_row, v);
    if (threadIdx.x == 0) {
      if (a.neg_log_q != nullptr) a.neg_log_q[out] = 0;
      if (a.target_probability != nullptr) a.target_probability[out] = 0;
      if (a.loss_weight != nullptr) a.loss_weight[out] = 0;
      if (a.argmax != nullptr) a.argmax[out] = -1;
      if (a.base_argmax != nullptr) a.base_argmax[out] = -1;
    }
    return;
  }
  const Transform transform(p.options);
  const bool corrected = meta.position >= p.loss.suffix_start;
  auto final_of = [&](float b, float c) {
    return transform(corrected ? ToF(FromF<T>(b + c)) : b);
  };
  DFLASH_SHARED(float, final_target);
  DFLASH_SHARED(float, base_target);
  Online fs, bs;
  for (int64_t i = threadIdx.x; i < v; i += kThreads) {
    const float b = ToF(base_row[i]), c = ToF(correction_row[i]);
    const float zf = final_of(b, c), zb = transform(b);
    Add(fs, i, zf, 1.0f, false);
    Add(bs, i, zb, 1.0f, false);
    if (i == meta.target) {
      final_target = zf;
      base_target = zb;
    }
  }
  auto merge = [](Online x, Online y) { return Merge(x, y, 1.0f, false); };
  fs = BlockReduce(fs, merge);
  bs = BlockReduce(bs, merge);
  if (fs.bad || bs.bad) {
    // As the CPU: the final logits' first bad one, else the base logits'.
    ReportFirstNonFinite(a.error, out, kLogitNotFinite, v, [&](int64_t i) {
      const float b = ToF(base_row[i]);
      return fs.bad ? final_of(b, ToF(correction_row[i])) : transform(b);
    });
    return;
  }
  const float f_log_sum = logf(fs.sum), b_log_sum = logf(bs.sum);
  const double ce =
      (static_cast<double>(fs.max) - final_target) + f_log_sum;
  const double base_ce =
      (static_cast<double>(bs.max) - base_target) + b_log_sum;
  const double w = meta.weight, lambda = p.loss.lambda_base;
  if (threadIdx.x == 0) {
    const bool hit = meta.mask > 0.5f && fs.argmax == meta.target;
    const bool base_hit = meta.mask > 0.5f && bs.argmax == meta.target;
    terms[kLossNum] = (1 - lambda) * w * ce + lambda * w * base_ce;
    terms[kLossDen] = w;
    terms[kCorrect] = hit;
    terms[kAccuracyDen] = meta.mask;
    terms[kTargetProbability] = meta.mask * exp(-ce);
    terms[kCeNum] = w * ce;
    terms[kBaseCeNum] = w * base_ce;
    terms[kBaseCorrect] = base_hit;
    if (a.neg_log_q != nullptr) a.neg_log_q[out] = static_cast<float>(ce);
    if (a.target_probability != nullptr) a.target_probability[out] = exp(-ce);
    if (a.loss_weight != nullptr) a.loss_weight[out] = static_cast<float>(w);
    if (a.argmax != nullptr) a.argmax[out] = fs.argmax;
    if (a.base_argmax != nullptr) a.base_argmax[out] = bs.argmax;
  }
  const float g_final = static_cast<float>((1 - lambda) * w);
  const float g_base = static_cast<float>(lambda * w);
  bool bad = false;
  for (int64_t i = threadIdx.x; i < v; i += kThreads) {
    const float b = ToF(base_row[i]), c = ToF(correction_row[i]);
    const float zf = final_of(b, c), zb = transform(b);
    const float onehot = i == meta.target ? 1.0f : 0.0f;
    const float d_final = transform.Chain(
        g_final * (expf((zf - fs.max) - f_log_sum) - onehot), zf);
    const float d_base = transform.Chain(
        g_base * (expf((zb - bs.max) - b_log_sum) - onehot), zb);
    bad |= !isfinite(d_final + d_base);
    base_row[i] = FromF<T>(d_final + d_base);
    correction_row[i] = FromF<T>(corrected ? d_final : 0.0f);
  }
  if (bad) ReportError(a.error, out, kGradientNotFinite);
}

// The rows' terms into the totals: one block per total (a row slot, or a
// per-position slot t at position k), each summed in a fixed order, so the
// totals are deterministic and the ~150 sums run side by side.
__global__ void __launch_bounds__(kThreads)
    ReduceTermsKernel(const Row* meta, const double* row_terms, int64_t rows,
                      int32_t block_size, double* totals) {
  const int64_t j = blockIdx.x;
  const bool positional = j >= kTermSlots;
  const int64_t t = positional ? (j - kTermSlots) / block_size : 0;
  const int32_t k =
      positional ? static_cast<int32_t>((j - kTermSlots) % block_size) : 0;
  const int slot = positional ? PositionSlot(static_cast<int>(t))
                              : static_cast<int>(j);
  double sum = 0;
  for (int64_t r = threadIdx.x; r < rows; r += kThreads) {
    if (!positional || meta[r].position == k) {
      sum += row_terms[kTermSlots * r + slot];
    }
  }
  sum = BlockReduce(sum, [](double x, double y) { return x + y; });
  if (threadIdx.x == 0) totals[j] += sum;
}

template <typename T>
__global__ void ScaleKernel(T* data, int64_t count, float scale) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    data[i] = FromF<T>(ToF(data[i]) * scale);
  }
}

template <typename T>
__global__ void ScaleRowsByLkFactorKernel(T* data, int64_t width,
                                          const int64_t* rows, int64_t count,
                                          const double* q, double kl_weight,
                                          double scale) {
  for (int64_t i = blockIdx.x; i < count; i += gridDim.x) {
    const int64_t row = rows[i];
    const float factor =
        static_cast<float>(scale * LkDeferredFactor(kl_weight, q[row]));
    T* values = data + row * width;
    for (int64_t h = threadIdx.x; h < width; h += blockDim.x) {
      values[h] = FromF<T>(ToF(values[h]) * factor);
    }
  }
}

}  // namespace

template <typename T>
void LaunchChunkLoss(const KernelParams& params, const ChunkArgs<T>& args,
                     CUstream_st* stream) {
  if (args.rows == 0) return;
  const dim3 rows(static_cast<unsigned>(args.rows));
  auto reduce_terms = [&] {
    if (args.totals == nullptr) return;
    DFLASH_LAUNCH(ReduceTermsKernel,
                  static_cast<unsigned>(TotalsSize(params.options.block_size)),
                  kThreads, 0, stream)
    (args.meta, args.row_terms, args.rows,
     static_cast<int32_t>(params.options.block_size), args.totals);
  };
  if (params.loss.family == LossFamily::kDomino) {
    DFLASH_LAUNCH(DominoKernel<T>, rows, kThreads, 0, stream)(params, args);
    reduce_terms();
    return;
  }
  DFLASH_LAUNCH(StatsKernel<T>, rows, kThreads, 0, stream)(params, args);
  if ((args.top_k != nullptr && args.k > 0) || args.metric_k > 0) {
    DFLASH_LAUNCH(TopKKernel<T>, rows, kThreads, 0, stream)(params, args);
  }
  if (params.loss.dpard) {
    DFLASH_LAUNCH(AcceptanceKernel<T>, rows, kThreads, 0, stream)(params, args);
  }
  if (CouplesBlocks(params.loss) && args.blocks > 0) {
    constexpr int kPerBlock = 128;
    DFLASH_LAUNCH(BlockWeightsKernel, (args.blocks + kPerBlock - 1) / kPerBlock,
                  kPerBlock, 0, stream)
    (params.loss, args.meta, args.stats, args.block_begin, args.blocks,
     args.accept, args.weight, args.ce_share);
  }
  DFLASH_LAUNCH(LossKernel<T>, rows, kThreads, 0, stream)(params, args);
  reduce_terms();
}

template <typename T>
void LaunchScale(T* data, int64_t count, double scale, CUstream_st* stream) {
  if (count == 0) return;
  constexpr int kBlock = 256;
  const int64_t blocks = (count + kBlock - 1) / kBlock;
  DFLASH_LAUNCH(ScaleKernel<T>,
                static_cast<unsigned>(blocks < 4096 ? blocks : 4096), kBlock, 0,
                stream)
  (data, count, static_cast<float>(scale));
}

template <typename T>
void LaunchScaleRowsByLkFactor(T* data, int64_t width, const int64_t* rows,
                               int64_t count, const double* q, double kl_weight,
                               double scale, CUstream_st* stream) {
  if (count == 0) return;
  const int64_t blocks = count < 65535 ? count : 65535;
  DFLASH_LAUNCH(ScaleRowsByLkFactorKernel<T>, static_cast<unsigned>(blocks),
                256, 0, stream)
  (data, width, rows, count, q, kl_weight, scale);
}

template void LaunchChunkLoss<float>(const KernelParams&,
                                     const ChunkArgs<float>&, CUstream_st*);
template void LaunchChunkLoss<BFloat16>(const KernelParams&,
                                        const ChunkArgs<BFloat16>&,
                                        CUstream_st*);
template void LaunchScale<float>(float*, int64_t, double, CUstream_st*);
template void LaunchScale<BFloat16>(BFloat16*, int64_t, double, CUstream_st*);
template void LaunchScaleRowsByLkFactor<float>(float*, int64_t, const int64_t*,
                                               int64_t, const double*, double,
                                               double, CUstream_st*);
template void LaunchScaleRowsByLkFactor<BFloat16>(BFloat16*, int64_t,
                                                  const int64_t*, int64_t,
                                                  const double*, double, double,
                                                  CUstream_st*);

}  // namespace cuda
}  // namespace dflash
