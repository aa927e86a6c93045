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
#include "losses/device_results.h"
#include "losses/family_passes.h"
#include "losses/loss_math.h"
#include "losses/top_k_cursor.h"

namespace dflash {
namespace cuda {
namespace {

constexpr int kThreads = 512;  // A power of two: the reduction tree halves.

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
        if (i * kVec + j < n) f(i * kVec + j, ToFloat(e.values[j]));
      }
    }
  } else {
    for (int64_t i = threadIdx.x; i < n; i += kThreads) f(i, ToFloat(row[i]));
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
          f(i * kVec + j, ToFloat(ze.values[j]), ToFloat(te.values[j]));
        }
      }
    }
  } else {
    for (int64_t i = threadIdx.x; i < n; i += kThreads) {
      f(i, ToFloat(z[i]), ToFloat(t[i]));
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
          ze.values[j] = FromFloat<T>(
              g(i * kVec + j, ToFloat(ze.values[j]), ToFloat(te.values[j])));
        }
      }
      zv[i] = ze.Bits();
    }
  } else {
    for (int64_t i = threadIdx.x; i < n; i += kThreads) {
      const float x = ToFloat(row[i]);
      row[i] = FromFloat<T>(g(i, x, t != nullptr ? ToFloat(t[i]) : x));
    }
  }
}

template <typename T>
__device__ void ZeroRow(T* row, int64_t n) {
  for (int64_t i = threadIdx.x; i < n; i += kThreads)
    row[i] = FromFloat<T>(0.0f);
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

__device__ __forceinline__ void AddLogit(Online& s, int64_t i, float x,
                                         float inv_t,
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
    AddLogit(s, i, z, inv_t, tempered);
    if (i + p.offset == meta.target) target = z;
  });
  s = BlockReduce(
      s, [&](Online x, Online y) { return Merge(x, y, inv_t, tempered); });
  if (s.bad) {
    ReportFirstNonFinite(a.error, out, kLogitNotFinite, v, [&](int64_t i) {
      return transform(ToFloat(z_row[i]));
    });
  }
  // The teacher's statistics where the loss reads them, as on the CPU:
  // distillation and DSpark skip rows without weight.
  const bool teacher =
      a.teacher != nullptr &&
      (p.loss.dpard || TeacherMetrics(p, a) || meta.weight != 0 ||
       a.teacher_argmax != nullptr);
  const float teacher_inv_t = distill ? inv_t : 1.0f;
  const bool teacher_tempered = teacher_inv_t != 1.0f;
  Online t;
  if (teacher) {
    const T* t_row = a.teacher + r * a.stride;
    ForRow(t_row, v, a.stride, [&](int64_t i, float x) {
      AddLogit(t, i, transform(x), teacher_inv_t, teacher_tempered);
    });
    t = BlockReduce(t, [&](Online x, Online y) {
      return Merge(x, y, teacher_inv_t, teacher_tempered);
    });
    if (t.bad) {
      ReportFirstNonFinite(a.error, out, kTeacherNotFinite, v, [&](int64_t i) {
        return transform(ToFloat(t_row[i]));
      });
    }
  }
  if (threadIdx.x != 0) return;
  RowStats& stats = a.stats[r];
  // Every field written (0 where unused), so no pass reads undefined
  // memory.
  stats = RowStats{};
  stats.max = s.max;
  stats.log_sum = logf(s.sum);
  stats.sum_exp = s.sum;
  if (distill) {
    stats.lse_t =
        tempered ? s.max * inv_t + logf(s.sum_t) : s.max + stats.log_sum;
    stats.sum_exp_t = tempered ? s.sum_t : s.sum;
  }
  // Only where a thread set it (NegLogQ reads it then); else RowStats' 0.
  // Vocab-parallel, -inf where another range holds the target (the
  // record's kRangeTargetLogit).
  if (HasTarget(meta.target)) {
    const int64_t local = meta.target - p.offset;
    stats.target = local >= 0 && local < v ? target : -INFINITY;
  }
  stats.sum = s.total;
  stats.argmax = s.argmax;
  if (teacher) {
    stats.t_lse = teacher_tempered ? t.max * teacher_inv_t + logf(t.sum_t)
                                   : t.max + logf(t.sum);
    stats.t_argmax = t.argmax;
    stats.t_max = t.max;
    stats.t_sum_exp = teacher_tempered ? t.sum_t : t.sum;
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
        if (a.top_k_teacher != nullptr) {
          a.top_k_teacher[out * a.k + j] =
              found ? transform(ToFloat(a.teacher[r * a.stride + best.index]))
                    : 0;
        }
      }
      if (j < a.metric_k && found) {
        if (best.index == meta.target) rank = j;
        mass += exp((static_cast<double>(best.value) - max) - log_sum);
        if (teacher_metrics) {
          const float t =
              transform(ToFloat(a.teacher[r * a.stride + best.index]));
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

// family_passes.h's Row over this thread block's row r: per-logit
// arithmetic in float, row sums by BlockReduce, terms and per-row outputs
// written by thread 0. Everything is forceinline, so that each kernel
// compiles as one function.
template <typename T>
class CudaRow {
 public:
  using Real = float;

  __device__ __forceinline__ CudaRow(const KernelParams& p,
                                     const ChunkArgs<T>& a, int64_t r,
                                     double weight)
      : p_(p),
        a_(a),
        r_(r),
        out_(OutRow(a.out_rows, r)),
        z_(a.logits + r * a.stride),
        t_(a.teacher != nullptr ? a.teacher + r * a.stride : nullptr),
        terms_(a.row_terms + kTermSlots * r),
        meta_(a.meta[r]),
        s_(a.stats[r]),
        transform_(p.options),
        weight_(weight) {}

  __device__ __forceinline__ const LossParams& loss() const { return p_.loss; }
  __device__ __forceinline__ int64_t vocab() const { return p_.classes; }
  __device__ __forceinline__ int32_t target() const { return meta_.target; }
  __device__ __forceinline__ double mask() const { return meta_.mask; }
  __device__ __forceinline__ double weight() const { return weight_; }
  __device__ __forceinline__ double neg_log_q() const {
    return NegLogQ(meta_.target, s_.max, s_.log_sum, s_.target);
  }
  __device__ __forceinline__ double lse() const {
    return static_cast<double>(s_.max) + s_.log_sum;
  }
  __device__ __forceinline__ double MeanLogit() const {
    return double{s_.sum} / p_.classes;
  }
  __device__ __forceinline__ double share() const {
    return CouplesBlocks(p_.loss) ? a_.ce_share[r_] : 1.0;
  }
  __device__ __forceinline__ double accept() const { return a_.accept[r_]; }
  __device__ __forceinline__ bool has_teacher() const {
    return t_ != nullptr;
  }
  __device__ __forceinline__ double confidence() const {
    return a_.confidence[out_];
  }

  // softmax(z') = exp((z' - max) - log_sum): z' - max is exact in float.
  __device__ __forceinline__ float LogSoftmax(float zp) const {
    return (zp - s_.max) - s_.log_sum;
  }
  __device__ __forceinline__ float Softmax(float zp) const {
    return FastExp(LogSoftmax(zp));
  }
  __device__ __forceinline__ float TemperedLogSoftmax(float zp) const {
    return zp * static_cast<float>(p_.loss.inv_temperature) - s_.lse_t;
  }
  __device__ __forceinline__ float TeacherLogSoftmax(float tp) const {
    return tp - s_.t_lse;
  }
  __device__ __forceinline__ float TeacherSoftmax(float tp) const {
    return FastExp(tp - s_.t_lse);
  }
  // The stats pass takes the teacher's logsumexp at the temperature for
  // distillation.
  __device__ __forceinline__ float TeacherTemperedLogSoftmax(float tp) const {
    return tp * static_cast<float>(p_.loss.inv_temperature) - s_.t_lse;
  }
  __device__ __forceinline__ double DraftTop1() const {
    return exp(-static_cast<double>(s_.log_sum));
  }
  __device__ __forceinline__ double TeacherTop1() const {
    // The stats pass's maximum of t' (vocab-parallel, the whole row's).
    return exp(static_cast<double>(s_.t_max) - s_.t_lse);
  }
  __device__ __forceinline__ bool TeacherAgrees() const {
    return s_.t_argmax == s_.argmax;
  }

  // f and g get global class ids, as on the CPU.
  template <typename F>
  __device__ __forceinline__ void ForEach(F&& f) const {
    ForRows(z_, t_, p_.vocab, a_.stride, [&](int64_t i, float x, float y) {
      const float zp = transform_(x);
      f(i + p_.offset, zp, t_ != nullptr ? transform_(y) : zp);
    });
  }
  template <typename S>
  __device__ __forceinline__ S Reduce(S partial) {
    const S total = BlockReduce(partial, [](S x, S y) { return x + y; });
    if (a_.row_sums == nullptr) return total;
    double parts[2];
    Parts(total, parts);
    const double* known = ShardSum(RowSumKindOf(total), parts);
    return known != nullptr ? FromParts(total, known) : total;
  }
  template <typename F>
  __device__ __forceinline__ double LogSumExp(F&& f) {
    Online online;
    ForEach([&](int64_t i, float zp, float tp) {
      AddLogit(online, i, f(zp, tp), 1.0f, false);
    });
    online = BlockReduce(online, [](Online x, Online y) {
      return Merge(x, y, 1.0f, false);
    });
    const double lse = online.max + logf(online.sum);
    if (a_.row_sums == nullptr) return lse;
    const double parts[2] = {online.max, online.sum};
    const double* known = ShardSum(kRowLogSumExp, parts);
    return known != nullptr ? known[0] : lse;
  }

  template <typename G>
  __device__ __forceinline__ void WriteGradient(G&& g, double) {
    if (a_.collect) {
      // Nothing stored, but g runs: a pass may sum inside it (forward KL's
      // divergence) for a row sum after it.
      ForEach([&](int64_t i, float zp, float tp) { g(i, zp, tp); });
      return;
    }
    Map(t_, g);
  }
  __device__ __forceinline__ void WriteSoftmaxGradient(double softmax,
                                                       double on_target,
                                                       double uniform,
                                                       double) {
    if (a_.collect) return;
    const float softmax_f = static_cast<float>(softmax);
    const float on_target_f = static_cast<float>(on_target);
    const float uniform_f = static_cast<float>(uniform / p_.classes);
    const int32_t target = meta_.target;
    // The teacher, where there is one, is not read.
    Map(static_cast<const T*>(nullptr), [&](int64_t i, float zp, float) {
      const float g = softmax_f * Softmax(zp) - uniform_f;
      return i == target ? g - on_target_f : g;
    });
  }

  __device__ __forceinline__ void Add(TermSlot slot, double value) const {
    if (threadIdx.x == 0 && !a_.collect) terms_[slot] += value;
  }
  __device__ __forceinline__ void SetTeacherAcceptance(double accept) const {
    if (threadIdx.x == 0 && !a_.collect && a_.teacher_acceptance != nullptr) {
      a_.teacher_acceptance[out_] = accept;
    }
  }
  __device__ __forceinline__ void SetConfidenceGradient(double g) const {
    if (threadIdx.x == 0 && !a_.collect && a_.confidence_grad != nullptr) {
      a_.confidence_grad[out_] = g;
    }
  }
  __device__ __forceinline__ void ConfidenceNotFinite(double c) const {
    if (threadIdx.x == 0 && !a_.collect) {
      ReportError(a_.error, out_, kConfidenceNotFinite, 0,
                  static_cast<float>(c));
    }
  }

  // For the kernel around the pass.
  __device__ __forceinline__ int64_t out() const { return out_; }
  __device__ __forceinline__ T* logits() const { return z_; }
  __device__ __forceinline__ double* terms() const { return terms_; }
  __device__ __forceinline__ const RowStats& stats() const { return s_; }

 private:
  // A row sum's parts (at most two) and its kind, and back.
  __device__ __forceinline__ static void Parts(float x, double* parts) {
    parts[0] = x;
    parts[1] = 0;
  }
  __device__ __forceinline__ static void Parts(RowSums<float> x,
                                               double* parts) {
    parts[0] = x.a;
    parts[1] = x.b;
  }
  __device__ __forceinline__ static RowSumKind RowSumKindOf(float) {
    return kRowSum;
  }
  __device__ __forceinline__ static RowSumKind RowSumKindOf(RowSums<float>) {
    return kRowSums;
  }
  __device__ __forceinline__ static float FromParts(float,
                                                    const double* known) {
    return static_cast<float>(known[0]);
  }
  __device__ __forceinline__ static RowSums<float> FromParts(
      RowSums<float>, const double* known) {
    return {static_cast<float>(known[0]), static_cast<float>(known[1])};
  }

  // Vocab-parallel, the pass's next row sum: the merged value where a
  // round has it, else null with this range's `parts` left for the host
  // (the first unknown sum of the pass only; the rest of this round's pass
  // is not written: ChunkArgs::collect).
  __device__ __forceinline__ const double* ShardSum(RowSumKind kind,
                                                    const double* parts) {
    RowSumState& state = a_.row_sums[r_];
    const int j = next_sum_++;
    if (threadIdx.x == 0) state.met = j + 1;
    if (j < state.known_count) return state.known[j];
    if (!waiting_ && threadIdx.x == 0) {
      state.pending = 1;
      state.kind = kind;
      state.partial[0] = parts[0];
      state.partial[1] = parts[1];
    }
    waiting_ = true;
    return nullptr;
  }

  // The row's d/dz in place: g(i, z', t') is d/dz' (t' from `teacher`, or
  // z' where it is null), chained through the transform; a result that is
  // not finite is the row's error.
  template <typename G>
  __device__ __forceinline__ void Map(const T* teacher, G&& g) {
    bool bad = false;
    MapRow(z_, teacher, p_.vocab, a_.stride, [&](int64_t i, float x, float y) {
      const float zp = transform_(x);
      const float chained = transform_.Chain(
          g(i + p_.offset, zp, teacher != nullptr ? transform_(y) : zp), zp);
      bad |= !isfinite(chained);
      return chained;
    });
    if (bad) ReportError(a_.error, out_, kGradientNotFinite);
  }

  const KernelParams& p_;
  const ChunkArgs<T>& a_;
  const int64_t r_, out_;
  T* const z_;
  const T* const t_;
  double* const terms_;
  const Row meta_;
  const RowStats s_;
  const Transform transform_;
  const double weight_;
  int next_sum_ = 0;      // Row sums this pass has met.
  bool waiting_ = false;  // An unknown one among them.
};

// Block weights and shares (CoupledBlockWeights), one thread per block run.
__global__ void BlockWeightsKernel(LossParams p, const Row* meta,
                                   const RowStats* stats,
                                   const int32_t* block_begin, int32_t blocks,
                                   int32_t block_size,
                                   const double* accept, double* weight,
                                   double* share) {
  const int32_t b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= blocks) return;
  const int32_t begin = block_begin != nullptr ? block_begin[b] : b * block_size;
  const int32_t end =
      block_begin != nullptr ? block_begin[b + 1] : begin + block_size;
  auto q = [&](int64_t i) {
    const int64_t r = begin + i;
    if (!(meta[r].mask > 0)) return 0.0;
    const RowStats& s = stats[r];
    return exp(-NegLogQ(meta[r].target, s.max, s.log_sum, s.target));
  };
  CoupledBlockWeights(
      p, end - begin, q, [&](int64_t i) { return accept[begin + i]; },
      [&](int64_t i) { return double{meta[begin + i].mask}; },
      [&](int64_t i) { return meta[begin + i].weight; },
      [&](int64_t i) { return meta[begin + i].scale; }, weight + begin,
      share + begin);
}

// D-PARD's pass before the block credit: each row's acceptance.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    AcceptanceKernel(KernelParams p, ChunkArgs<T> a) {
  const int64_t r = blockIdx.x;
  if (a.meta[r].mask == 0) {
    if (threadIdx.x == 0 && !a.collect) a.accept[r] = 0;
    return;
  }
  CudaRow<T> row(p, a, r, 0.0);
  const double l1 = TeacherL1(row);
  if (threadIdx.x == 0 && !a.collect) a.accept[r] = DSparkAcceptance(l1);
}

// A row without a mask: zero gradient, terms and outputs.
template <typename T>
__device__ __forceinline__ void MaskedRow(const KernelParams& p,
                                          const ChunkArgs<T>& a, int64_t r) {
  const int64_t out = OutRow(a.out_rows, r);
  ZeroRow(a.logits + r * a.stride, p.vocab);
  if (threadIdx.x != 0) return;
  double* terms = a.row_terms + kTermSlots * r;
  for (int j = 0; j < kTermSlots; ++j) terms[j] = 0;
  if (a.neg_log_q != nullptr) a.neg_log_q[out] = 0;
  if (a.target_probability != nullptr) a.target_probability[out] = 0;
  if (a.target_rank != nullptr) a.target_rank[out] = -1;
  if (a.loss_weight != nullptr) a.loss_weight[out] = 0;
  if (a.teacher_acceptance != nullptr) a.teacher_acceptance[out] = 0;
  if (a.argmax != nullptr) a.argmax[out] = -1;
  if (a.teacher_argmax != nullptr) a.teacher_argmax[out] = -1;
  if (a.confidence_grad != nullptr) a.confidence_grad[out] = 0;
}

// Every term slot of a row with a mask, set before the family adds its own
// (the metrics; 0 for the rest), and the per-row outputs. Thread 0 writes.
template <typename T>
__device__ __forceinline__ void RowMetrics(const ChunkArgs<T>& a,
                                           const CudaRow<T>& row) {
  if (threadIdx.x != 0) return;
  const RowStats& s = row.stats();
  const int64_t out = row.out();
  double* terms = row.terms();
  const double m = row.mask();
  const double q = exp(-row.neg_log_q());
  terms[kLossNum] = 0;
  terms[kLossDen] = row.weight();
  terms[kCorrect] = m > 0.5 && s.argmax == row.target();
  terms[kAccuracyDen] = m;
  terms[kTargetProbability] = m * q;
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
  if (a.target_probability != nullptr) a.target_probability[out] = q;
  if (a.loss_weight != nullptr) a.loss_weight[out] = row.weight();
  if (a.neg_log_q != nullptr) a.neg_log_q[out] = row.neg_log_q();
  if (a.argmax != nullptr) a.argmax[out] = s.argmax;
  // StatsKernel analysed every row's teacher where this is asked for.
  if (a.teacher_argmax != nullptr) {
    a.teacher_argmax[out] = a.teacher != nullptr ? s.t_argmax : -1;
  }
  if (a.confidence_grad != nullptr) a.confidence_grad[out] = 0;
}

// Pass 2: terms and d(loss_num)/d(logits) of each row, in place: the
// metrics, the teacher diagnostics, then the family's pass (FamilyPass).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    LossKernel(KernelParams p, ChunkArgs<T> a) {
  const int64_t r = blockIdx.x;
  const Row meta = a.meta[r];
  if (meta.mask == 0) {
    if (!a.collect) MaskedRow(p, a, r);
    return;
  }
  CudaRow<T> row(p, a, r, CouplesBlocks(p.loss) ? a.weight[r] : meta.weight);
  if (!a.collect) RowMetrics(a, row);
  if (TeacherMetrics(p, a)) TeacherDiagnosticsPass(row);
  if (row.weight() == 0) {
    if (!a.collect) ZeroRow(row.logits(), p.vocab);
    return;
  }
  FamilyPass(row);
}

// Domino's Row (family_passes.h's DominoPass) over this thread block's row
// r: base logits and, from suffix_start, final = base + correction (the sum
// rounded to T, as SpecForge adds them), both transformed.
template <typename T>
class CudaDominoRow {
 public:
  __device__ __forceinline__ CudaDominoRow(const KernelParams& p,
                                           const ChunkArgs<T>& a, int64_t r)
      : p_(p),
        a_(a),
        r_(r),
        out_(OutRow(a.out_rows, r)),
        base_(a.logits + r * a.stride),
        correction_(a.correction + r * a.stride),
        terms_(a.row_terms + kTermSlots * r),
        meta_(a.meta[r]),
        transform_(p.options),
        corrected_(meta_.position >= p.loss.suffix_start) {}

  __device__ __forceinline__ const LossParams& loss() const { return p_.loss; }
  __device__ __forceinline__ int32_t target() const { return meta_.target; }
  __device__ __forceinline__ double mask() const { return meta_.mask; }
  __device__ __forceinline__ double weight() const { return meta_.weight; }

  // The final and base logits' stats over this row's range (the target's
  // logit -inf where another range holds it); false on the row's error
  // (reported).
  __device__ __forceinline__ bool RangeStats(RowStats& final_stats,
                                             RowStats& base_stats) {
    const int64_t v = p_.vocab;
    DFLASH_SHARED(float, final_target);
    DFLASH_SHARED(float, base_target);
    Online fs, bs;
    for (int64_t i = threadIdx.x; i < v; i += kThreads) {
      const float b = ToFloat(base_[i]), c = ToFloat(correction_[i]);
      const float zf = Final(b, c), zb = transform_(b);
      AddLogit(fs, i, zf, 1.0f, false);
      AddLogit(bs, i, zb, 1.0f, false);
      if (i + p_.offset == meta_.target) {
        final_target = zf;
        base_target = zb;
      }
    }
    auto merge = [](Online x, Online y) { return Merge(x, y, 1.0f, false); };
    fs = BlockReduce(fs, merge);
    bs = BlockReduce(bs, merge);
    if (fs.bad || bs.bad) {
      // As the CPU: the final logits' first bad one, else the base logits'.
      ReportFirstNonFinite(a_.error, out_, kLogitNotFinite, v, [&](int64_t i) {
        const float b = ToFloat(base_[i]);
        return fs.bad ? Final(b, ToFloat(correction_[i])) : transform_(b);
      });
      return false;
    }
    const int64_t local = meta_.target - p_.offset;
    const bool here = local >= 0 && local < v;
    final_stats = RowStats{};
    final_stats.max = fs.max;
    final_stats.log_sum = logf(fs.sum);
    final_stats.sum_exp = fs.sum;
    final_stats.target = here ? final_target : -INFINITY;
    final_stats.argmax = fs.argmax;
    base_stats = RowStats{};
    base_stats.max = bs.max;
    base_stats.log_sum = logf(bs.sum);
    base_stats.sum_exp = bs.sum;
    base_stats.target = here ? base_target : -INFINITY;
    base_stats.argmax = bs.argmax;
    return true;
  }

  __device__ __forceinline__ bool DominoStats(DominoRowStats& out) {
    RowStats fs, bs;
    if (a_.base_stats != nullptr) {
      // Vocab-parallel: the whole rows', merged across the ranges.
      fs = a_.stats[r_];
      bs = a_.base_stats[r_];
    } else if (!RangeStats(fs, bs)) {
      return false;
    }
    final_max_ = fs.max;
    base_max_ = bs.max;
    final_log_sum_ = fs.log_sum;
    base_log_sum_ = bs.log_sum;
    // Domino refuses ignored_target_weight COUNT: a row here has a target.
    out.neg_log_q = NegLogQ(meta_.target, fs.max, fs.log_sum, fs.target);
    out.base_neg_log_q =
        NegLogQ(meta_.target, bs.max, bs.log_sum, bs.target);
    out.argmax = fs.argmax;
    out.base_argmax = bs.argmax;
    return true;
  }

  __device__ __forceinline__ void SetDominoOutputs(const DominoRowStats& s,
                                                   double q) const {
    if (threadIdx.x != 0) return;
    if (a_.neg_log_q != nullptr) a_.neg_log_q[out_] = s.neg_log_q;
    if (a_.target_probability != nullptr) a_.target_probability[out_] = q;
    if (a_.loss_weight != nullptr) a_.loss_weight[out_] = meta_.weight;
    if (a_.argmax != nullptr) a_.argmax[out_] = s.argmax;
    if (a_.base_argmax != nullptr) a_.base_argmax[out_] = s.base_argmax;
    if (a_.teacher_argmax != nullptr) a_.teacher_argmax[out_] = -1;
  }

  __device__ __forceinline__ void WriteDominoGradient(double g_final,
                                                      double g_base) {
    const float gf = static_cast<float>(g_final);
    const float gb = static_cast<float>(g_base);
    bool bad = false;
    for (int64_t i = threadIdx.x; i < p_.vocab; i += kThreads) {
      const float b = ToFloat(base_[i]), c = ToFloat(correction_[i]);
      const float zf = Final(b, c), zb = transform_(b);
      const float onehot = i + p_.offset == meta_.target ? 1.0f : 0.0f;
      const float d_final = transform_.Chain(
          gf * (expf((zf - final_max_) - final_log_sum_) - onehot), zf);
      const float d_base = transform_.Chain(
          gb * (expf((zb - base_max_) - base_log_sum_) - onehot), zb);
      bad |= !isfinite(d_final + d_base);
      base_[i] = FromFloat<T>(d_final + d_base);
      correction_[i] = FromFloat<T>(corrected_ ? d_final : 0.0f);
    }
    if (bad) ReportError(a_.error, out_, kGradientNotFinite);
  }

  __device__ __forceinline__ void Add(TermSlot slot, double value) const {
    if (threadIdx.x == 0) terms_[slot] += value;
  }

 private:
  __device__ __forceinline__ float Final(float b, float c) const {
    return transform_(corrected_ ? ToFloat(FromFloat<T>(b + c)) : b);
  }

  const KernelParams& p_;
  const ChunkArgs<T>& a_;
  const int64_t r_, out_;
  T* const base_;
  T* const correction_;
  double* const terms_;
  const Row meta_;
  const Transform transform_;
  const bool corrected_;
  float final_max_ = 0, base_max_ = 0, final_log_sum_ = 0, base_log_sum_ = 0;
};

// Domino: DominoPass over each row with a mask; d/d(base) and
// d/d(correction) in place.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    DominoKernel(KernelParams p, ChunkArgs<T> a) {
  const int64_t r = blockIdx.x;
  const int64_t v = p.vocab;
  const int64_t out = OutRow(a.out_rows, r);
  double* terms = a.row_terms + kTermSlots * r;
  if (threadIdx.x == 0) {
    for (int j = 0; j < kTermSlots; ++j) terms[j] = 0;
  }
  if (a.meta[r].mask == 0) {
    ZeroRow(a.logits + r * a.stride, v);
    ZeroRow(a.correction + r * a.stride, v);
    if (threadIdx.x == 0) {
      if (a.neg_log_q != nullptr) a.neg_log_q[out] = 0;
      if (a.target_probability != nullptr) a.target_probability[out] = 0;
      if (a.loss_weight != nullptr) a.loss_weight[out] = 0;
      if (a.argmax != nullptr) a.argmax[out] = -1;
      if (a.base_argmax != nullptr) a.base_argmax[out] = -1;
      if (a.teacher_argmax != nullptr) a.teacher_argmax[out] = -1;
    }
    return;
  }
  CudaDominoRow<T> row(p, a, r);
  DominoPass(row);
}

// Vocab-parallel Domino's stats pass: each row's final and base logits'
// stats over this range (argmax local), RowStats{} where the row has no
// mask or an error.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    DominoStatsKernel(KernelParams p, ChunkArgs<T> a) {
  const int64_t r = blockIdx.x;
  RowStats final_stats, base_stats;
  if (a.meta[r].mask == 0) {
    if (threadIdx.x == 0) a.stats[r] = a.base_stats[r] = RowStats{};
    return;
  }
  CudaDominoRow<T> row(p, a, r);
  if (!row.RangeStats(final_stats, base_stats)) {
    final_stats = base_stats = RowStats{};
  }
  if (threadIdx.x != 0) return;
  a.stats[r] = final_stats;
  a.base_stats[r] = base_stats;
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
__global__ void ScaleKernel(T* data, int64_t count, float scale,
                            const double* device_scale) {
  const float s =
      device_scale == nullptr ? scale : static_cast<float>(*device_scale);
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    data[i] = FromFloat<T>(ToFloat(data[i]) * s);
  }
}

template <typename T>
__global__ void ScaleRowsByLkFactorKernel(T* data, int64_t width,
                                          const int64_t* rows, int64_t count,
                                          const double* q, double kl_weight,
                                          double scale,
                                          const double* device_finish) {
  if (device_finish != nullptr) {
    kl_weight = device_finish[kFinishLkKlWeight];
    scale = device_finish[kFinishScaledGradient];
  }
  for (int64_t i = blockIdx.x; i < count; i += gridDim.x) {
    const int64_t row = rows[i];
    const float factor =
        static_cast<float>(scale * LkDeferredFactor(kl_weight, q[row]));
    T* values = data + row * width;
    for (int64_t h = threadIdx.x; h < width; h += blockDim.x) {
      values[h] = FromFloat<T>(ToFloat(values[h]) * factor);
    }
  }
}

// The chunk's row terms into the run's totals, where it records them.
template <typename T>
void LaunchReduceTerms(const KernelParams& params, const ChunkArgs<T>& args,
                       CUstream_st* stream) {
  if (args.totals == nullptr) return;
  DFLASH_LAUNCH(ReduceTermsKernel,
                static_cast<unsigned>(TotalsSize(params.options.block_size)),
                kThreads, 0, stream)
  (args.meta, args.row_terms, args.rows,
   static_cast<int32_t>(params.options.block_size), args.totals);
}

}  // namespace

template <typename T>
void LaunchChunkLoss(const KernelParams& params, const ChunkArgs<T>& args,
                     CUstream_st* stream) {
  if (args.rows == 0) return;
  const dim3 rows(static_cast<unsigned>(args.rows));
  if (params.loss.family == LossFamily::kDomino) {
    LaunchDominoPass(params, args, stream);
    return;
  }
  LaunchChunkStats(params, args, stream);
  if ((args.top_k != nullptr && args.k > 0) || args.metric_k > 0) {
    DFLASH_LAUNCH(TopKKernel<T>, rows, kThreads, 0, stream)(params, args);
  }
  if (params.loss.dpard) LaunchAcceptancePass(params, args, stream);
  LaunchBlockWeights(params, args, stream);
  LaunchLossPass(params, args, stream);
}

template <typename T>
void LaunchDominoStats(const KernelParams& params, const ChunkArgs<T>& args,
                       CUstream_st* stream) {
  if (args.rows == 0) return;
  DFLASH_LAUNCH(DominoStatsKernel<T>, dim3(static_cast<unsigned>(args.rows)),
                kThreads, 0, stream)
  (params, args);
}

template <typename T>
void LaunchDominoPass(const KernelParams& params, const ChunkArgs<T>& args,
                      CUstream_st* stream) {
  if (args.rows == 0) return;
  DFLASH_LAUNCH(DominoKernel<T>, dim3(static_cast<unsigned>(args.rows)),
                kThreads, 0, stream)
  (params, args);
  LaunchReduceTerms(params, args, stream);
}

template <typename T>
void LaunchTopK(const KernelParams& params, const ChunkArgs<T>& args,
                CUstream_st* stream) {
  if (args.rows == 0) return;
  DFLASH_LAUNCH(TopKKernel<T>, dim3(static_cast<unsigned>(args.rows)),
                kThreads, 0, stream)
  (params, args);
}

namespace {

template <typename V>
__global__ void ScatterRowsKernel(const V* src, int64_t src_width, V* dst,
                                  int64_t dst_width, int64_t width,
                                  const int64_t* out_rows, int64_t rows) {
  const int64_t total = rows * width;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = i / width, j = i % width;
    dst[OutRow(out_rows, r) * dst_width + j] = src[r * src_width + j];
  }
}

}  // namespace

template <typename V>
void LaunchScatterRows(const V* src, int64_t src_width, V* dst,
                       int64_t dst_width, int64_t width,
                       const int64_t* out_rows, int64_t rows,
                       CUstream_st* stream) {
  const int64_t total = rows * width;
  if (total == 0) return;
  constexpr int kBlock = 256;
  const int64_t blocks = (total + kBlock - 1) / kBlock;
  DFLASH_LAUNCH(ScatterRowsKernel<V>,
                static_cast<unsigned>(blocks < 4096 ? blocks : 4096), kBlock,
                0, stream)
  (src, src_width, dst, dst_width, width, out_rows, rows);
}

template <typename T>
void LaunchChunkStats(const KernelParams& params, const ChunkArgs<T>& args,
                      CUstream_st* stream) {
  if (args.rows == 0) return;
  DFLASH_LAUNCH(StatsKernel<T>, dim3(static_cast<unsigned>(args.rows)),
                kThreads, 0, stream)
  (params, args);
}

template <typename T>
void LaunchAcceptancePass(const KernelParams& params, const ChunkArgs<T>& args,
                          CUstream_st* stream) {
  if (args.rows == 0) return;
  DFLASH_LAUNCH(AcceptanceKernel<T>, dim3(static_cast<unsigned>(args.rows)),
                kThreads, 0, stream)
  (params, args);
}

template <typename T>
void LaunchBlockWeights(const KernelParams& params, const ChunkArgs<T>& args,
                        CUstream_st* stream) {
  if (!CouplesBlocks(params.loss) || args.blocks <= 0) return;
  constexpr int kPerBlock = 128;
  DFLASH_LAUNCH(BlockWeightsKernel, (args.blocks + kPerBlock - 1) / kPerBlock,
                kPerBlock, 0, stream)
  (params.loss, args.meta, args.stats, args.block_begin, args.blocks,
   args.block_size, args.accept, args.weight, args.ce_share);
}

template <typename T>
void LaunchLossPass(const KernelParams& params, const ChunkArgs<T>& args,
                    CUstream_st* stream) {
  if (args.rows == 0) return;
  DFLASH_LAUNCH(LossKernel<T>, dim3(static_cast<unsigned>(args.rows)),
                kThreads, 0, stream)
  (params, args);
  if (!args.collect) LaunchReduceTerms(params, args, stream);
}

namespace {

__global__ void RowsFromMetaKernel(LossParams loss, const RowMeta* rows,
                                   int64_t count, Row* out) {
  for (int64_t r = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; r < count;
       r += int64_t{gridDim.x} * blockDim.x) {
    const RowMeta meta = rows[r];
    const double mask = EffectiveMask(loss, meta.target, meta.mask);
    out[r] = {mask != 0 ? meta.target : 0, meta.position,
              static_cast<float>(mask),
              RowLossWeight(loss, meta.position, mask),
              DPaceRowScale(loss, meta.sequence_share)};
  }
}

__global__ void ResetErrorKernel(unsigned long long* error) {
  *error = kNoError;
}

// One thread: the finish of head.device_results (losses/device_results.h).
__global__ void DeviceFinishKernel(LossParams loss, int32_t block_size,
                                   const double* totals,
                                   const unsigned long long* loss_error,
                                   const unsigned long long* rows_error,
                                   const double* block_terms,
                                   int64_t sequences, double* results,
                                   double* finish) {
  unsigned long long* words = reinterpret_cast<unsigned long long*>(results);
  const unsigned long long rows_word =
      rows_error == nullptr ? kResultStatusClear : *rows_error;
  const unsigned long long loss_word = *loss_error;
  words[kResultRowsStatus] = rows_word;
  words[kResultLossStatus] = loss_word;
  const int64_t size = DeviceResultsSize(block_size);
  if (rows_word != kResultStatusClear || loss_word != kResultStatusClear) {
    // Poisoned: no term of a failed run reads as a number, and the
    // gradients its scales multiply are NaN too.
    const double poison = nan("");
    for (int64_t i = kResultLoss; i < size; ++i) results[i] = poison;
    for (int i = 0; i < kFinishSlots; ++i) finish[i] = poison;
    return;
  }
  FinishTotals t;
  t.loss_num = totals[kLossNum];
  t.loss_den = loss.sequence_balanced ? block_terms[kBlockWeightedSequences]
                                      : totals[kLossDen];
  t.correct = totals[kCorrect];
  t.accuracy_den = totals[kAccuracyDen];
  t.target_probability = totals[kTargetProbability];
  t.ce_num = totals[kCeNum];
  t.tv_num = totals[kTvNum];
  t.dpard_num = totals[kDPardNum];
  t.confidence_num = totals[kConfidenceNum];
  const FinishedScalars f = FinishScalars(loss, t, sequences);
  results[kResultLoss] = f.loss;
  results[kResultDenominator] = f.denominator;
  results[kResultAccuracy] = f.accuracy;
  results[kResultGradientScale] = f.gradient_scale;
  results[kResultConfidenceScale] = f.confidence_scale;
  results[kResultLkKlWeight] = f.has_lk_kl_weight ? f.lk_kl_weight : nan("");
  for (int i = 0; i < kSummedTerms; ++i) {
    results[DeviceSummedResult(i)] = totals[SummedSlot(i)];
  }
  // Finished as HeadResult's terms are.
  results[DeviceSummedResult(kSummedLossNum)] = t.loss_num;
  results[DeviceSummedResult(kSummedLossDen)] = t.loss_den;
  for (int p = 0; p < kPositionTerms; ++p) {
    for (int64_t k = 0; k < block_size; ++k) {
      results[DevicePositionResult(p, k, block_size)] =
          totals[kTermSlots + p * int64_t{block_size} + k];
    }
  }
  for (int b = 0; b < kBlockTerms; ++b) {
    results[DeviceBlockResult(b, block_size)] = block_terms[b];
  }
  finish[kFinishGradientScale] = f.gradient_scale;
  finish[kFinishConfidenceScale] = f.confidence_scale;
  finish[kFinishLkKlWeight] = f.lk_kl_weight;
  finish[kFinishDenominator] = f.denominator;
}

// One thread: the final scales of ScaleGradients from the finish and the
// upstream (a host factor times an optional device scalar). A non-finite
// upstream is latched as SplitHeadRun::Backward refuses a host one, unless
// the forward's error came first (its poison already NaNs the scales).
__global__ void DeviceScalesKernel(double* finish, double* results,
                                   int32_t block_size, double upstream,
                                   const void* device_upstream,
                                   bool upstream_float,
                                   bool times_denominator) {
  double u = upstream;
  if (device_upstream != nullptr) {
    u *= upstream_float
             ? static_cast<double>(*static_cast<const float*>(device_upstream))
             : *static_cast<const double*>(device_upstream);
    if (times_denominator) u *= finish[kFinishDenominator];
  }
  unsigned long long* words = reinterpret_cast<unsigned long long*>(results);
  if (!isfinite(u) && words[kResultRowsStatus] == kResultStatusClear &&
      words[kResultLossStatus] == kResultStatusClear) {
    words[kResultLossStatus] = UpstreamErrorCode(u);
    const double poison = nan("");
    for (int64_t i = kResultLoss; i < DeviceResultsSize(block_size); ++i) {
      results[i] = poison;
    }
    // Every finish slot, as DeviceFinish poisons them: NaN, not u x scale
    // (an infinite upstream times a zero scale would leave 0 or inf), and a
    // later Backward of the same run, finite upstream or not, scales by NaN
    // too while the word stays set.
    for (int i = 0; i < kFinishSlots; ++i) finish[i] = poison;
    return;
  }
  finish[kFinishScaledGradient] = u * finish[kFinishGradientScale];
  finish[kFinishScaledConfidence] = u * finish[kFinishConfidenceScale];
}

// Grid-stride over the longest output; every thread reads the words.
__global__ void PoisonRowOutputsKernel(const double* results, RowOutputs out,
                                       int64_t longest) {
  const unsigned long long* words =
      reinterpret_cast<const unsigned long long*>(results);
  if (words[kResultRowsStatus] == kResultStatusClear &&
      words[kResultLossStatus] == kResultStatusClear) {
    return;
  }
  const double nan_double = nan("");
  const float nan_float = nanf("");
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
       i < longest; i += int64_t{gridDim.x} * blockDim.x) {
    if (i < out.neg_log_q_count) out.neg_log_q[i] = nan_double;
    if (i < out.top_k_values_count) out.top_k_values[i] = nan_float;
    if (i < out.loss_weight_count) out.loss_weight[i] = nan_double;
    if (i < out.argmax_count) out.argmax[i] = -1;
    if (i < out.top_k_count) out.top_k[i] = -1;
    if (i < out.teacher_argmax_count) out.teacher_argmax[i] = -1;
  }
}

}  // namespace

void LaunchPoisonRowOutputs(const double* results, const RowOutputs& out,
                            CUstream_st* stream) {
  int64_t longest = 0;
  for (int64_t count :
       {out.neg_log_q_count, out.top_k_values_count, out.loss_weight_count,
        out.argmax_count, out.top_k_count, out.teacher_argmax_count}) {
    longest = count > longest ? count : longest;
  }
  if (longest == 0) return;
  constexpr int kBlock = 256;
  const int64_t blocks = (longest + kBlock - 1) / kBlock;
  DFLASH_LAUNCH(PoisonRowOutputsKernel,
                static_cast<unsigned>(blocks < 4096 ? blocks : 4096), kBlock,
                0, stream)
  (results, out, longest);
}

void LaunchRowsFromMeta(const LossParams& loss, const RowMeta* rows,
                        int64_t count, Row* out, CUstream_st* stream) {
  if (count == 0) return;
  constexpr int kBlock = 256;
  const int64_t blocks = (count + kBlock - 1) / kBlock;
  DFLASH_LAUNCH(RowsFromMetaKernel,
                static_cast<unsigned>(blocks < 4096 ? blocks : 4096), kBlock,
                0, stream)
  (loss, rows, count, out);
}

void LaunchResetError(unsigned long long* error, CUstream_st* stream) {
  DFLASH_LAUNCH(ResetErrorKernel, 1, 1, 0, stream)(error);
}

void LaunchDeviceFinish(const LossParams& loss, int32_t block_size,
                        const double* totals,
                        const unsigned long long* loss_error,
                        const unsigned long long* rows_error,
                        const double* block_terms, int64_t sequences,
                        double* results, double* finish, CUstream_st* stream) {
  DFLASH_LAUNCH(DeviceFinishKernel, 1, 1, 0, stream)
  (loss, block_size, totals, loss_error, rows_error, block_terms, sequences,
   results, finish);
}

void LaunchDeviceScales(double* finish, double* results, int32_t block_size,
                        double upstream, const void* device_upstream,
                        bool upstream_float, bool times_denominator,
                        CUstream_st* stream) {
  DFLASH_LAUNCH(DeviceScalesKernel, 1, 1, 0, stream)
  (finish, results, block_size, upstream, device_upstream, upstream_float,
   times_denominator);
}

template <typename T>
void LaunchScale(T* data, int64_t count, double scale, CUstream_st* stream,
                 const double* device_scale) {
  if (count == 0) return;
  constexpr int kBlock = 256;
  const int64_t blocks = (count + kBlock - 1) / kBlock;
  DFLASH_LAUNCH(ScaleKernel<T>,
                static_cast<unsigned>(blocks < 4096 ? blocks : 4096), kBlock, 0,
                stream)
  (data, count, static_cast<float>(scale), device_scale);
}

template <typename T>
void LaunchScaleRowsByLkFactor(T* data, int64_t width, const int64_t* rows,
                               int64_t count, const double* q, double kl_weight,
                               double scale, CUstream_st* stream,
                               const double* device_finish) {
  if (count == 0) return;
  const int64_t blocks = count < 65535 ? count : 65535;
  DFLASH_LAUNCH(ScaleRowsByLkFactorKernel<T>, static_cast<unsigned>(blocks),
                256, 0, stream)
  (data, width, rows, count, q, kl_weight, scale, device_finish);
}

template void LaunchChunkLoss<float>(const KernelParams&,
                                     const ChunkArgs<float>&, CUstream_st*);
template void LaunchChunkLoss<BFloat16>(const KernelParams&,
                                        const ChunkArgs<BFloat16>&,
                                        CUstream_st*);
template void LaunchChunkStats<float>(const KernelParams&,
                                      const ChunkArgs<float>&, CUstream_st*);
template void LaunchChunkStats<BFloat16>(const KernelParams&,
                                         const ChunkArgs<BFloat16>&,
                                         CUstream_st*);
#define DFLASH_INSTANTIATE_CHUNK_PARTS(T)                                  \
  template void LaunchAcceptancePass<T>(const KernelParams&,               \
                                        const ChunkArgs<T>&, CUstream_st*); \
  template void LaunchBlockWeights<T>(const KernelParams&,                 \
                                      const ChunkArgs<T>&, CUstream_st*);   \
  template void LaunchLossPass<T>(const KernelParams&, const ChunkArgs<T>&, \
                                  CUstream_st*);
DFLASH_INSTANTIATE_CHUNK_PARTS(float)
DFLASH_INSTANTIATE_CHUNK_PARTS(BFloat16)
#undef DFLASH_INSTANTIATE_CHUNK_PARTS
template void LaunchTopK<float>(const KernelParams&, const ChunkArgs<float>&,
                                CUstream_st*);
template void LaunchDominoStats<float>(const KernelParams&,
                                       const ChunkArgs<float>&, CUstream_st*);
template void LaunchDominoStats<BFloat16>(const KernelParams&,
                                          const ChunkArgs<BFloat16>&,
                                          CUstream_st*);
template void LaunchDominoPass<float>(const KernelParams&,
                                      const ChunkArgs<float>&, CUstream_st*);
template void LaunchDominoPass<BFloat16>(const KernelParams&,
                                         const ChunkArgs<BFloat16>&,
                                         CUstream_st*);
template void LaunchTopK<BFloat16>(const KernelParams&,
                                   const ChunkArgs<BFloat16>&, CUstream_st*);
template void LaunchScatterRows<int32_t>(const int32_t*, int64_t, int32_t*,
                                         int64_t, int64_t, const int64_t*,
                                         int64_t, CUstream_st*);
template void LaunchScatterRows<float>(const float*, int64_t, float*, int64_t,
                                       int64_t, const int64_t*, int64_t,
                                       CUstream_st*);

template void LaunchScale<float>(float*, int64_t, double, CUstream_st*,
                                 const double*);
template void LaunchScale<BFloat16>(BFloat16*, int64_t, double, CUstream_st*,
                                    const double*);
template void LaunchScaleRowsByLkFactor<float>(float*, int64_t, const int64_t*,
                                               int64_t, const double*, double,
                                               double, CUstream_st*,
                                               const double*);
template void LaunchScaleRowsByLkFactor<BFloat16>(BFloat16*, int64_t,
                                                  const int64_t*, int64_t,
                                                  const double*, double, double,
                                                  CUstream_st*, const double*);

}  // namespace cuda
}  // namespace dflash
