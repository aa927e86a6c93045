// The chunked-reduction cases shared with the Python chunked_reduce
// (chunking/testdata/chunked_reduce_cases.json, written by
// tools/chunked_reduce_cases.py; //tests:chunked_reduce_cases_test runs
// the same file through dflash.torch.chunked_reduce): chunk widths,
// checkpointing, terms and input gradients against the file's float64
// reference, or the error message.

#include <cmath>
#include <cstdint>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "chunking/chunked_reduce.h"
#include "gmock/gmock.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"

namespace dflash {
namespace {

using google::protobuf::ListValue;
using google::protobuf::Struct;
using google::protobuf::Value;

constexpr char kCases[] = "chunking/testdata/chunked_reduce_cases.json";

// The view's element offsets, in row-major order of its shape.
std::vector<int64_t> Offsets(const TensorView& t) {
  std::vector<int64_t> offsets = {0};
  for (int64_t d = 0; d < t.rank(); ++d) {
    std::vector<int64_t> next;
    next.reserve(offsets.size() * t.dim(d));
    for (int64_t base : offsets) {
      for (int64_t i = 0; i < t.dim(d); ++i) {
        next.push_back(base + i * t.strides()[d]);
      }
    }
    offsets = std::move(next);
  }
  return offsets;
}

std::vector<TensorView> Present(Slices slices) {
  std::vector<TensorView> present;
  for (const auto& s : slices) {
    if (s) present.push_back(*s);
  }
  return present;
}

// The cases' chunk functions (tools/chunked_reduce_cases.py), on the first
// two present slices; each records the width of every Forward call along
// the reduced dimension of its first present slice.
class CaseFunction : public ChunkFunction {
 public:
  CaseFunction(std::string name, int64_t dim)
      : name_(std::move(name)), dim_(dim) {}

  absl::StatusOr<Terms> Forward(Slices slices) override {
    const std::vector<TensorView> t = Present(slices);
    widths.push_back(t[0].dim(dim_ >= 0 ? dim_ : t[0].rank() + dim_));
    const double* a = t[0].data_as<double>();
    const double* b = t[1].data_as<double>();
    if (name_ == "weighted_sums") {
      // [sum(v * w)], [sum(v^2 * w)].
      const std::vector<int64_t> ov = Offsets(t[0]), ow = Offsets(t[1]);
      double linear = 0, quadratic = 0;
      for (size_t i = 0; i < ov.size(); ++i) {
        linear += a[ov[i]] * b[ow[i]];
        quadratic += a[ov[i]] * a[ov[i]] * b[ow[i]];
      }
      return Terms{{linear}, {quadratic}};
    }
    // row_dot: [M @ b] and [sum(b^2), sum(b)] for M [R, L], b [L].
    const TensorView& m = t[0];
    const TensorView& v = t[1];
    Term rows(m.dim(0), 0.0);
    double squares = 0, sum = 0;
    for (int64_t j = 0; j < v.dim(0); ++j) {
      const double bj = b[j * v.strides()[0]];
      for (int64_t r = 0; r < m.dim(0); ++r) {
        rows[r] += a[r * m.strides()[0] + j * m.strides()[1]] * bj;
      }
      squares += bj * bj;
      sum += bj;
    }
    return Terms{rows, {squares, sum}};
  }

  absl::Status Backward(Slices slices, const Terms& g,
                        Slices grad_slices) override {
    const std::vector<TensorView> t = Present(slices);
    std::vector<std::optional<TensorView>> grads;
    for (size_t i = 0; i < slices.size(); ++i) {
      if (slices[i]) grads.push_back(grad_slices[i]);
    }
    const double* a = t[0].data_as<double>();
    const double* b = t[1].data_as<double>();
    if (name_ == "weighted_sums") {
      const std::vector<int64_t> ov = Offsets(t[0]), ow = Offsets(t[1]);
      for (int k = 0; k < 2; ++k) {
        if (!grads[k]) continue;
        const std::vector<int64_t> og = Offsets(*grads[k]);
        double* out = grads[k]->data_as<double>();
        for (size_t i = 0; i < ov.size(); ++i) {
          const double v = a[ov[i]], w = b[ow[i]];
          out[og[i]] += k == 0 ? g[0][0] * w + g[1][0] * 2 * v * w
                               : g[0][0] * v + g[1][0] * v * v;
        }
      }
      return absl::OkStatus();
    }
    const TensorView& m = t[0];
    const TensorView& v = t[1];
    for (int64_t j = 0; j < v.dim(0); ++j) {
      const double bj = b[j * v.strides()[0]];
      double db = g[1][0] * 2 * bj + g[1][1];
      for (int64_t r = 0; r < m.dim(0); ++r) {
        const int64_t mj = r * m.strides()[0] + j * m.strides()[1];
        db += g[0][r] * a[mj];
        if (grads[0]) {
          grads[0]->data_as<double>()[r * grads[0]->strides()[0] +
                                      j * grads[0]->strides()[1]] +=
              g[0][r] * bj;
        }
      }
      if (grads[1]) grads[1]->data_as<double>()[j * grads[1]->strides()[0]] += db;
    }
    return absl::OkStatus();
  }

  std::vector<int64_t> widths;

 private:
  std::string name_;
  int64_t dim_;
};

std::vector<double> Numbers(const Value& list) {
  std::vector<double> numbers;
  for (const Value& v : list.list_value().values()) {
    numbers.push_back(v.number_value());
  }
  return numbers;
}

int64_t Int(const Struct& s, const std::string& key) {
  return static_cast<int64_t>(s.fields().at(key).number_value());
}

std::vector<Struct> LoadCases() {
  std::ifstream in(kCases);
  std::stringstream text;
  text << in.rdbuf();
  Struct file;
  const auto status =
      google::protobuf::util::JsonStringToMessage(text.str(), &file);
  EXPECT_TRUE(in && status.ok()) << kCases << ": " << status.ToString();
  std::vector<Struct> cases;
  if (!file.fields().count("cases")) return cases;
  for (const Value& c : file.fields().at("cases").list_value().values()) {
    cases.push_back(c.struct_value());
  }
  return cases;
}

void ExpectNear(const std::vector<double>& actual,
                const std::vector<double>& expected, const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  for (size_t i = 0; i < actual.size(); ++i) {
    EXPECT_NEAR(actual[i], expected[i], 1e-12 * std::max(1.0, std::abs(expected[i])))
        << what << "[" << i << "]";
  }
}

void RunCase(const Struct& c) {
  const auto& f = c.fields();
  const int64_t dim = Int(c, "dim");
  const bool backward = f.at("grad_terms").has_list_value();

  // Inputs, and a zeroed gradient for each input that needs one.
  const auto& specs = f.at("inputs").list_value().values();
  std::vector<std::vector<double>> data(specs.size()), grad_data(specs.size());
  std::vector<std::optional<TensorView>> inputs, grads;
  bool any_grad = false;
  for (int i = 0; i < specs.size(); ++i) {
    if (!specs[i].has_struct_value()) {
      inputs.push_back(std::nullopt);
      grads.push_back(std::nullopt);
      continue;
    }
    const auto& spec = specs[i].struct_value().fields();
    Shape shape;
    for (double d : Numbers(spec.at("shape"))) shape.push_back(d);
    data[i] = Numbers(spec.at("data"));
    data[i].resize(std::max<size_t>(data[i].size(), 1));
    inputs.push_back(TensorView::Of(data[i].data(), shape));
    if (spec.at("requires_grad").bool_value()) {
      grad_data[i].assign(data[i].size(), 0.0);
      grads.push_back(TensorView::Of(grad_data[i].data(), shape));
      any_grad = true;
    } else {
      grads.push_back(std::nullopt);
    }
  }
  if (!any_grad) grads.clear();

  CaseFunction function(f.at("function").string_value(), dim);
  auto reduction = ChunkedReduction::Run(
      function, inputs,
      {.chunk_size = Int(c, "chunk_size"),
       .dim = dim,
       .checkpoint = f.at("checkpoint").bool_value(),
       .grad_enabled = f.at("grad_enabled").bool_value()},
      grads);

  if (f.count("error")) {
    ASSERT_FALSE(reduction.ok());
    EXPECT_EQ(reduction.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(std::string(reduction.status().message()),
              f.at("error").string_value());
    EXPECT_TRUE(function.widths.empty());
    return;
  }
  ASSERT_TRUE(reduction.ok()) << reduction.status();
  const auto& expected = f.at("expected").struct_value().fields();
  std::vector<int64_t> widths;
  for (double w : Numbers(expected.at("widths"))) widths.push_back(w);
  EXPECT_EQ(function.widths, widths);
  EXPECT_EQ(reduction->num_chunks(), static_cast<int64_t>(widths.size()));
  const bool checkpointed = expected.at("checkpointed").bool_value();
  EXPECT_EQ(reduction->checkpointed(), checkpointed);
  const auto& terms = expected.at("terms").list_value().values();
  ASSERT_EQ(reduction->terms().size(), static_cast<size_t>(terms.size()));
  for (int k = 0; k < terms.size(); ++k) {
    ExpectNear(reduction->terms()[k], Numbers(terms[k]),
               "terms[" + std::to_string(k) + "]");
  }
  if (!backward) return;

  Terms grad_terms;
  for (const Value& g : f.at("grad_terms").list_value().values()) {
    grad_terms.push_back(Numbers(g));
  }
  ASSERT_TRUE(reduction->Backward(grad_terms).ok());
  EXPECT_EQ(reduction->recomputations(),
            checkpointed ? static_cast<int64_t>(widths.size()) : 0);
  const auto& expected_grads = expected.at("grads").list_value().values();
  for (int i = 0; i < specs.size(); ++i) {
    if (!expected_grads[i].has_list_value()) {
      EXPECT_TRUE(grad_data[i].empty()) << "input " << i << " needs no gradient";
      continue;
    }
    std::vector<double> want = Numbers(expected_grads[i]);
    grad_data[i].resize(want.size());
    ExpectNear(grad_data[i], want, "grads[" + std::to_string(i) + "]");
  }
}

TEST(ChunkedReduceCasesTest, EveryCaseAsTheReference) {
  const std::vector<Struct> cases = LoadCases();
  ASSERT_GE(cases.size(), 10u);
  for (const Struct& c : cases) {
    SCOPED_TRACE(c.fields().at("name").string_value());
    RunCase(c);
  }
}

}  // namespace
}  // namespace dflash
