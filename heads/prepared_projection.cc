#include "heads/prepared_projection.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/checksum.h"
#include "base/threads.h"
#include "heads/gradient_filter.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace dflash {
namespace {

using Desc = dnnl::memory::desc;
using Tag = dnnl::memory::format_tag;
constexpr dnnl::memory::data_type kF32 = dnnl::memory::data_type::f32;

double Since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
      .count();
}

// oneDNN reports failures by throwing dnnl::error; they stop here. Memory
// running out is ResourceExhausted (a MemoryError in Python).
absl::Status DnnlError(const dnnl::error& e, const char* what) {
  if (e.status == dnnl_out_of_memory) {
    return absl::ResourceExhaustedError(
        absl::StrCat("out of memory in oneDNN's ", what, ": ", e.what()));
  }
  return absl::InternalError(
      absl::StrCat("oneDNN ", what, ": ", e.what(), " (status ",
                   static_cast<int>(e.status), ")"));
}

// The GEMMs' threads (a count from ResolveThreads): oneDNN runs on OpenMP,
// whose thread count is this calling thread's setting (not the process's).
void UseThreads(int threads) { omp_set_num_threads(std::max(1, threads)); }

}  // namespace

// One GEMM shape of the head: dst [m, n] = src [m, k] @ B [k, n], with B
// laid out once. A primitive fixes m and its work split over the threads
// set when it is made, so one is made per (m, threads) seen (a run has two
// or three chunk sizes).
struct PackedGemm {
  int64_t k = 0, n = 0;
  int64_t lda = 0;  // src's row stride; 0: k (dense).
  Desc packed;
  dnnl::memory weights;
  std::mutex mu;
  std::map<std::pair<int64_t, int>, dnnl::matmul> primitives;
};

// The gradient filter's input-gradient GEMM over kept vocabulary tiles:
// W's rows laid out a tile (kGradientFilterTile ids) at a time, each
// product added into the output. Made on the first filtered GEMM: only a
// run with head.gradient_filter pays for this third copy.
struct TileGemms {
  PackedGemm full, tail;  // Whole tiles, and the vocabulary's last if shorter.
  std::vector<dnnl::memory> weights;

  // The GEMM of the tile that starts at id `begin`.
  PackedGemm& Of(int64_t begin, int64_t vocab) {
    return vocab - begin < full.k ? tail : full;
  }
};

struct PreparedProjection::Impl {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::primitive_attr attr;
  dnnl::primitive_attr add_attr;  // attr, with dst += the product.
  absl::Span<const float> weight, bias;
  int64_t vocab = 0, hidden = 0;
  // logits = rows @ W^T (B = W^T, [H, V]); dx = dlogits @ W (B = W, [V, H]).
  PackedGemm forward, input_gradient;
  std::mutex tiles_mu;
  bool tiles_tried = false;
  std::unique_ptr<TileGemms> tiles;
  double seconds = 0;
  std::string kernel;
  // The weight's and bias's ContentChecksum when last laid out; a run
  // compares it with theirs now (Revalidate), under layout_mu.
  std::mutex layout_mu;
  uint64_t checksum = 0;

  uint64_t Checksum(int threads) const {
    return ContentChecksum(weight.data(), weight.size() * sizeof(float),
                           threads) ^
           ContentChecksum(bias.data(), bias.size() * sizeof(float), 1);
  }

  dnnl::matmul::primitive_desc Describe(int64_t m, const PackedGemm& g,
                                        const Desc& weights,
                                        const dnnl::primitive_attr& a) const {
    const Desc src = g.lda > 0 ? Desc({m, g.k}, kF32, {g.lda, 1})
                               : Desc({m, g.k}, kF32, Tag::ab);
    const Desc dst({m, g.n}, kF32, Tag::ab);
    return dnnl::matmul::primitive_desc(dnnl::matmul::desc(src, weights, dst),
                                        a, engine);
  }

  // Chooses the format a chunk of `typical` rows prefers for B [k, n];
  // returns the name of the kernels oneDNN picked for it.
  std::string Shape(PackedGemm& g, int64_t k, int64_t n, int64_t typical,
                    const dnnl::primitive_attr& a) {
    g.k = k;
    g.n = n;
    const dnnl::matmul::primitive_desc pd =
        Describe(typical, g, Desc({k, n}, kF32, Tag::any), a);
    g.packed = pd.weights_desc();
    return pd.impl_info_str();
  }

  // B [k, n], given as `user` over `data`, laid out as g.packed into
  // `packed` (allocated as g.packed when empty).
  void LayInto(const PackedGemm& g, Tag user, const float* data,
               dnnl::memory& packed) const {
    if (!packed) packed = dnnl::memory(g.packed, engine);
    dnnl::memory source(Desc({g.k, g.n}, kF32, user), engine,
                        const_cast<float*>(data));
    dnnl::stream stream(engine);
    dnnl::reorder(source, packed).execute(stream, source, packed);
    stream.wait();
  }

  // The weight laid out again where it was (the tiles too, if made).
  void Relay() {
    LayInto(forward, Tag::ba, weight.data(), forward.weights);
    LayInto(input_gradient, Tag::ab, weight.data(), input_gradient.weights);
    std::lock_guard<std::mutex> lock(tiles_mu);
    if (tiles == nullptr) return;
    for (size_t t = 0; t < tiles->weights.size(); ++t) {
      const int64_t begin = static_cast<int64_t>(t) * kGradientFilterTile;
      LayInto(tiles->Of(begin, vocab), Tag::ab, weight.data() + begin * hidden,
              tiles->weights[t]);
    }
  }

  // Chooses the tiles' formats; returns how many tiles there are, 0 where
  // oneDNN has only its reference kernel for their GEMM.
  int64_t TileFormats(TileGemms& tiles) {
    constexpr int64_t kTypicalRows = 256, kTile = kGradientFilterTile;
    // Their src: a tile's columns of the logits gradient, rows V apart.
    tiles.full.lda = tiles.tail.lda = vocab;
    const std::string tile_kernel = Shape(
        tiles.full, std::min(kTile, vocab), hidden, kTypicalRows, add_attr);
    if (tile_kernel.rfind("ref", 0) == 0) return 0;
    if (vocab % kTile != 0 && vocab > kTile) {
      Shape(tiles.tail, vocab % kTile, hidden, kTypicalRows, add_attr);
    }
    return (vocab + kTile - 1) / kTile;
  }

  // W's tiles laid out (once; the caller catches dnnl::error), or null
  // where oneDNN has only its reference kernel for their GEMM.
  TileGemms* Tiles() {
    std::lock_guard<std::mutex> lock(tiles_mu);
    if (tiles_tried) return tiles.get();
    tiles_tried = true;
    auto made = std::make_unique<TileGemms>();
    if (TileFormats(*made) == 0) return nullptr;
    for (int64_t begin = 0; begin < vocab; begin += kGradientFilterTile) {
      made->weights.emplace_back();
      LayInto(made->Of(begin, vocab), Tag::ab, weight.data() + begin * hidden,
              made->weights.back());
    }
    tiles = std::move(made);
    return tiles.get();
  }

  // The primitive for m rows on the laid-out B, on the calling thread's
  // OpenMP thread count.
  dnnl::matmul Primitive(PackedGemm& g, int64_t m,
                         const dnnl::primitive_attr& a) const {
    const std::pair<int64_t, int> key(m, omp_get_max_threads());
    std::lock_guard<std::mutex> lock(g.mu);
    auto it = g.primitives.find(key);
    if (it != g.primitives.end()) return it->second;
    dnnl::matmul primitive(Describe(m, g, g.packed, a));
    g.primitives.emplace(key, primitive);
    return primitive;
  }
};

namespace {

// One run's view: its own stream and threads, the shared layout.
class PackedProjection final : public VocabProjection<float> {
 public:
  PackedProjection(PreparedProjection::Impl& impl, int threads)
      : VocabProjection<float>(impl.vocab, impl.hidden),
        impl_(impl),
        threads_(threads) {}

  void Forward(const float* rows, int64_t m, float* logits) override {
    if (m == 0 || !status_.ok()) return;
    const auto start = std::chrono::steady_clock::now();
    Run(impl_.forward, rows, m, logits, "forward GEMM");
    Count(m, Since(start));
    if (impl_.bias.empty()) return;
    const int64_t v = vocab();
    for (int64_t r = 0; r < m; ++r) {
      float* row = logits + r * v;
      for (int64_t j = 0; j < v; ++j) row[j] += impl_.bias[j];
    }
  }

  void AddForward(const float*, int64_t, float*) override {
    Fail("AddForward: a prepared projection computes logits with Forward "
         "only");
  }

  void InputGradient(const float* grad_logits, int64_t m,
                     float* grad_rows) override {
    if (m == 0 || !status_.ok()) return;
    const auto start = std::chrono::steady_clock::now();
    Run(impl_.input_gradient, grad_logits, m, grad_rows,
        "input-gradient GEMM");
    Count(m, Since(start));
  }

  // Over part of the vocabulary: on W's tiles laid out for it where the
  // range is whole filter tiles (the gradient filter's), else on the weight
  // as it is (OpenBLAS, on the threads the head set for it).
  void InputGradientColumns(const float* grad_logits, int64_t m, int64_t begin,
                            int64_t end, bool accumulate,
                            float* grad_rows) override {
    if (m == 0 || end <= begin || !status_.ok()) return;
    const int64_t v = vocab(), h = hidden();
    constexpr int64_t kTile = kGradientFilterTile;
    const auto start = std::chrono::steady_clock::now();
    TileGemms* tiles = nullptr;
    if (begin % kTile == 0 && (end % kTile == 0 || end == v)) {
      try {
        tiles = impl_.Tiles();
      } catch (const dnnl::error& e) {
        status_ = DnnlError(e, "filter tiles' layout");
        return;
      }
    }
    if (tiles != nullptr) {
      if (!accumulate) std::fill_n(grad_rows, m * h, 0.0f);
      try {
        UseThreads(threads_);
        if (!stream_) stream_.emplace(impl_.engine);
        dnnl::memory c(Desc({m, h}, kF32, Tag::ab), impl_.engine, grad_rows);
        for (int64_t t = begin / kTile; t * kTile < end; ++t) {
          PackedGemm& g = tiles->Of(t * kTile, v);
          dnnl::memory a(Desc({m, g.k}, kF32, {v, 1}), impl_.engine,
                         const_cast<float*>(grad_logits + t * kTile));
          impl_.Primitive(g, m, impl_.add_attr)
              .execute(*stream_, {{DNNL_ARG_SRC, a},
                                  {DNNL_ARG_WEIGHTS, tiles->weights[t]},
                                  {DNNL_ARG_DST, c}});
        }
        stream_->wait();
      } catch (const dnnl::error& e) {
        status_ = DnnlError(e, "filtered input-gradient GEMM");
      }
    } else {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, h, end - begin,
                  1.0f, grad_logits + begin, v,
                  impl_.weight.data() + begin * h, h,
                  accumulate ? 1.0f : 0.0f, grad_rows, h);
    }
    Count(m, Since(start), end - begin);
  }

  void AccumulateWeightGradient(const float*, const float*, int64_t, float*,
                                float*) override {
    Fail("a prepared projection is frozen: it has no weight gradient");
  }

  absl::Status status() const override { return status_; }

 private:
  void Fail(const char* what) {
    if (status_.ok()) status_ = absl::FailedPreconditionError(what);
  }

  void Run(PackedGemm& g, const float* src, int64_t m, float* dst,
           const char* what) {
    try {
      UseThreads(threads_);
      if (!stream_) stream_.emplace(impl_.engine);
      const dnnl::matmul primitive = impl_.Primitive(g, m, impl_.attr);
      dnnl::memory a(Desc({m, g.k}, kF32, Tag::ab), impl_.engine,
                     const_cast<float*>(src));
      dnnl::memory c(Desc({m, g.n}, kF32, Tag::ab), impl_.engine, dst);
      primitive.execute(*stream_, {{DNNL_ARG_SRC, a},
                                   {DNNL_ARG_WEIGHTS, g.weights},
                                   {DNNL_ARG_DST, c}});
      stream_->wait();
    } catch (const dnnl::error& e) {
      status_ = DnnlError(e, what);
    }
  }

  PreparedProjection::Impl& impl_;
  const int threads_;
  std::optional<dnnl::stream> stream_;  // Made on first use.
  absl::Status status_;
};

}  // namespace

PreparedProjection::PreparedProjection(std::unique_ptr<Impl> impl)
    : impl_(std::move(impl)) {}

PreparedProjection::~PreparedProjection() = default;

namespace {

constexpr int64_t kTypicalRows = 256;

// An Impl with its GEMMs' formats chosen for `vocab` x `hidden`, nothing
// laid out yet (the caller catches dnnl::error).
std::unique_ptr<PreparedProjection::Impl> Formats(int64_t vocab,
                                                  int64_t hidden) {
  auto impl = std::make_unique<PreparedProjection::Impl>();
  impl->vocab = vocab;
  impl->hidden = hidden;
  // Exact float32: no implicit down-conversion to bf16 or tf32.
  impl->attr.set_fpmath_mode(dnnl::fpmath_mode::strict);
  // Its own attr: primitive_attr copies share one object.
  impl->add_attr.set_fpmath_mode(dnnl::fpmath_mode::strict);
  dnnl::post_ops add;
  add.append_sum(1.0f);
  impl->add_attr.set_post_ops(add);
  // W [V, H] row-major is W^T [H, V] in column order (ba).
  impl->kernel =
      impl->Shape(impl->forward, hidden, vocab, kTypicalRows, impl->attr);
  impl->Shape(impl->input_gradient, vocab, hidden, kTypicalRows, impl->attr);
  return impl;
}

std::string Bytes(int64_t bytes) {
  return absl::StrCat(bytes, " bytes (", bytes >> 20, " MiB)");
}

}  // namespace

absl::StatusOr<std::unique_ptr<PreparedProjection>> PreparedProjection::Create(
    absl::Span<const float> weight, absl::Span<const float> bias,
    int64_t vocab, int64_t hidden, int threads) {
  if (absl::Status valid =
          ValidateProjectionShape(weight.size(), bias.size(), vocab, hidden);
      !valid.ok()) {
    return valid;
  }
  ScopedLibraryCall call;
  absl::StatusOr<int> resolved = ResolveThreads(threads, "threads");
  if (!resolved.ok()) return resolved.status();
  const auto start = std::chrono::steady_clock::now();
  std::unique_ptr<Impl> impl;
  try {
    impl = Formats(vocab, hidden);
  } catch (const dnnl::error& e) {
    return DnnlError(e, "weight layout");
  }
  // oneDNN's reference kernels (a CPU without AVX2) run far below BLAS.
  if (impl->kernel.rfind("ref", 0) == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "oneDNN has only its reference matmul (", impl->kernel,
        ") on this CPU; run OpenBLAS (head.pack_weight: false)"));
  }
  impl->weight = weight;
  impl->bias = bias;
  UseThreads(*resolved);
  try {
    impl->LayInto(impl->forward, Tag::ba, weight.data(), impl->forward.weights);
    impl->LayInto(impl->input_gradient, Tag::ab, weight.data(),
                  impl->input_gradient.weights);
  } catch (const dnnl::error& e) {
    if (e.status != dnnl_out_of_memory) return DnnlError(e, "weight layout");
    return absl::ResourceExhaustedError(absl::StrCat(
        "out of memory laying out the lm_head weight [", vocab, ", ", hidden,
        "] for oneDNN: two copies of ",
        Bytes(static_cast<int64_t>(impl->forward.packed.get_size())),
        " each"));
  }
  impl->checksum = impl->Checksum(*resolved);
  impl->seconds = Since(start);
  return std::unique_ptr<PreparedProjection>(
      new PreparedProjection(std::move(impl)));
}

absl::StatusOr<int64_t> PreparedProjection::LaidOutBytes(int64_t vocab,
                                                         int64_t hidden,
                                                         bool filter_tiles) {
  constexpr int64_t kMaxDim = std::numeric_limits<int32_t>::max();
  if (vocab <= 0 || hidden <= 0 || vocab > kMaxDim || hidden > kMaxDim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "projection: vocab and hidden must lie in [1, 2^31), got ", vocab,
        " and ", hidden));
  }
  // Beyond a TiB oneDNN is not asked (its blocking arithmetic overflows);
  // the plain copies' size says enough to refuse such a run.
  constexpr int64_t kAskedUpTo = int64_t{1} << 38;  // Values.
  if (vocab * hidden > kAskedUpTo) {
    return (filter_tiles ? 3 : 2) * vocab * hidden *
           static_cast<int64_t>(sizeof(float));
  }
  try {
    const std::unique_ptr<Impl> impl = Formats(vocab, hidden);
    int64_t bytes = static_cast<int64_t>(impl->forward.packed.get_size() +
                                         impl->input_gradient.packed.get_size());
    if (filter_tiles) {
      TileGemms tiles;
      bytes += impl->TileFormats(tiles) *
               static_cast<int64_t>(tiles.full.packed.get_size());
    }
    return bytes;
  } catch (const dnnl::error& e) {
    return DnnlError(e, "weight layout");
  }
}

absl::StatusOr<bool> PreparedProjection::Revalidate(int threads) const {
  ScopedLibraryCall call;
  Impl& impl = *impl_;
  const uint64_t now = impl.Checksum(std::max(1, threads));
  std::lock_guard<std::mutex> lock(impl.layout_mu);
  if (now == impl.checksum) return false;
  const auto start = std::chrono::steady_clock::now();
  try {
    UseThreads(threads);
    impl.Relay();
  } catch (const dnnl::error& e) {
    return DnnlError(e, "weight layout");
  }
  impl.checksum = now;
  impl.seconds = Since(start);
  return true;
}

int64_t PreparedProjection::vocab() const { return impl_->vocab; }
int64_t PreparedProjection::hidden() const { return impl_->hidden; }

int64_t PreparedProjection::packed_bytes() const {
  return static_cast<int64_t>(impl_->forward.packed.get_size() +
                              impl_->input_gradient.packed.get_size());
}

int64_t PreparedProjection::held_bytes() const {
  int64_t bytes = packed_bytes();
  std::lock_guard<std::mutex> lock(impl_->tiles_mu);
  if (impl_->tiles != nullptr) {
    for (const dnnl::memory& tile : impl_->tiles->weights) {
      bytes += static_cast<int64_t>(tile.get_desc().get_size());
    }
  }
  return bytes;
}

double PreparedProjection::prepare_seconds() const { return impl_->seconds; }

bool PreparedProjection::PreparedFrom(absl::Span<const float> weight,
                                      absl::Span<const float> bias) const {
  return weight.data() == impl_->weight.data() &&
         weight.size() == impl_->weight.size() &&
         bias.data() == impl_->bias.data() && bias.size() == impl_->bias.size();
}

std::unique_ptr<VocabProjection<float>> PreparedProjection::NewProjection(
    int threads) const {
  return std::make_unique<PackedProjection>(*impl_, threads);
}

std::string PreparedProjection::KernelName() const { return impl_->kernel; }

}  // namespace dflash
