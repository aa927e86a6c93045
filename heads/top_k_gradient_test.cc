#include "heads/top_k_gradient.h"

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "proto/config.h"

namespace dflash {
namespace {

constexpr int64_t kRows = 6, kV = 13, kH = 5;
constexpr int32_t kK = 3;

constexpr int64_t kRank = 2;  // With a correction.

v1::ObjectiveConfig Config(bool trainable, int64_t rank = 0) {
  auto config = LoadObjectiveConfigFromString(absl::StrCat(
      "layout { block_size: 3 num_anchors: 2 } head { vocab_size: ", kV,
      " hidden_size: ", kH, " dtype: FLOAT64 logit_scale: 0.7 logit_softcap: 4",
      " bias: true trainable: ", trainable ? "true" : "false",
      " correction_rank: ", rank, " } loss { dflash {} }"));
  EXPECT_TRUE(config.ok()) << config.status();
  return *config;
}

struct Problem {
  std::vector<double> hidden, weight, bias;
  std::vector<double> u, m;  // A correction's inputs and weight, or none.
  std::vector<int32_t> ids;
  std::vector<double> grad_values;
};

Problem MakeProblem() {
  std::mt19937 rng(7);
  std::normal_distribution<double> normal(0, 1);
  std::uniform_int_distribution<int32_t> token(0, kV - 1);
  Problem p;
  for (int64_t i = 0; i < kRows * kH; ++i) p.hidden.push_back(normal(rng));
  for (int64_t i = 0; i < kV * kH; ++i) p.weight.push_back(normal(rng));
  for (int64_t i = 0; i < kV; ++i) p.bias.push_back(normal(rng));
  for (int64_t i = 0; i < kRows * kK; ++i) {
    p.ids.push_back(i / kK == 2 ? -1 : token(rng));  // Row 2: no mask.
    p.grad_values.push_back(normal(rng));
  }
  return p;
}

// v = 4 tanh(0.7 z / 4), z = x . W[id] + b[id] (+ u . M[id]), as the head
// transforms.
double Value(const Problem& p, int64_t r, int32_t id) {
  double z = p.bias[id];
  for (int64_t i = 0; i < kH; ++i)
    z += p.hidden[r * kH + i] * p.weight[id * kH + i];
  for (int64_t i = 0; i < kRank && !p.u.empty(); ++i) {
    z += p.u[r * kRank + i] * p.m[id * kRank + i];
  }
  return 4 * std::tanh(0.7 * z / 4);
}

// The objective whose gradient the update adds: sum g * v.
double Objective(const Problem& p) {
  double sum = 0;
  for (int64_t r = 0; r < kRows; ++r) {
    for (int32_t j = 0; j < kK; ++j) {
      const int32_t id = p.ids[r * kK + j];
      if (id >= 0) sum += p.grad_values[r * kK + j] * Value(p, r, id);
    }
  }
  return sum;
}

// The head's top-k values of p's ids (0 where the id is -1).
std::vector<double> ValuesOf(const Problem& p) {
  std::vector<double> values(kRows * kK, 0);
  for (int64_t i = 0; i < kRows * kK; ++i) {
    if (p.ids[i] >= 0) values[i] = Value(p, i / kK, p.ids[i]);
  }
  return values;
}

// p with a correction of rank kRank.
Problem WithCorrection(Problem p) {
  std::mt19937 rng(11);
  std::normal_distribution<double> normal(0, 1);
  for (int64_t i = 0; i < kRows * kRank; ++i) p.u.push_back(normal(rng));
  for (int64_t i = 0; i < kV * kRank; ++i) p.m.push_back(normal(rng));
  return p;
}

// d Objective / d (p.*field)[i] by central differences.
double Numeric(const Problem& p, std::vector<double> Problem::*field,
               int64_t i) {
  const double step = 1e-6;
  Problem plus = p, minus = p;
  (plus.*field)[i] += step;
  (minus.*field)[i] -= step;
  return (Objective(plus) - Objective(minus)) / (2 * step);
}

TEST(TopKGradientTest, MatchesFiniteDifferencesOfTheValues) {
  const Problem p = MakeProblem();
  const std::vector<double> values = ValuesOf(p);
  // Gradients start from what a head run left (here 1 everywhere).
  std::vector<double> dh(kRows * kH, 1), dw(kV * kH, 1), db(kV, 1);
  const HeadInputs<double> inputs{p.hidden, {}, {}, {}, p.weight, p.bias};
  ASSERT_TRUE(
      AddTopKValueGradients<double>(
          Config(true), inputs, p.ids, values, p.grad_values, kK,
          {absl::MakeSpan(dh), absl::MakeSpan(dw), absl::MakeSpan(db), {}})
          .ok());
  // Values and their gradients in double: central differences' own error
  // (step^2 times the third derivative, and rounding over step) bounds it.
  for (int64_t i = 0; i < kRows * kH; ++i) {
    EXPECT_NEAR(dh[i] - 1, Numeric(p, &Problem::hidden, i), 1e-8) << "h " << i;
  }
  for (int64_t i = 0; i < kV * kH; ++i) {
    EXPECT_NEAR(dw[i] - 1, Numeric(p, &Problem::weight, i), 1e-8) << "w " << i;
  }
  for (int64_t i = 0; i < kV; ++i) {
    EXPECT_NEAR(db[i] - 1, Numeric(p, &Problem::bias, i), 1e-8) << "b " << i;
  }
  // Row 2 (ids -1) is untouched.
  for (int64_t i = 2 * kH; i < 3 * kH; ++i) EXPECT_EQ(dh[i], 1);
}

TEST(TopKGradientTest, CorrectionGetsItsGradients) {
  const Problem p = WithCorrection(MakeProblem());
  const std::vector<double> values = ValuesOf(p);
  std::vector<double> dh(kRows * kH, 0), dw(kV * kH, 0), db(kV, 0),
      du(kRows * kRank, 1), dm(kV * kRank, 1);
  HeadInputs<double> inputs{p.hidden, {}, {}, {}, p.weight, p.bias, p.u, p.m};
  ASSERT_TRUE(AddTopKValueGradients<double>(
                  Config(true, kRank), inputs, p.ids, values, p.grad_values,
                  kK,
                  {absl::MakeSpan(dh), absl::MakeSpan(dw), absl::MakeSpan(db),
                   {}, absl::MakeSpan(du), absl::MakeSpan(dm)})
                  .ok());
  for (int64_t i = 0; i < kRows * kRank; ++i) {
    EXPECT_NEAR(du[i] - 1, Numeric(p, &Problem::u, i), 1e-8) << "u " << i;
  }
  for (int64_t i = 0; i < kV * kRank; ++i) {
    EXPECT_NEAR(dm[i] - 1, Numeric(p, &Problem::m, i), 1e-8) << "m " << i;
  }
  for (int64_t i = 0; i < kRows * kH; ++i) {
    EXPECT_NEAR(dh[i], Numeric(p, &Problem::hidden, i), 1e-8) << "h " << i;
  }
  // A correction's inputs of the wrong size are refused, naming them.
  inputs.correction_inputs = absl::MakeConstSpan(p.u).subspan(1);
  EXPECT_EQ(AddTopKValueGradients<double>(Config(false, kRank), inputs, p.ids,
                                          values, p.grad_values, kK,
                                          {absl::MakeSpan(dh), {}, {}, {}})
                .message(),
            "inputs.correction_inputs: must hold 12 values (rows x "
            "head.correction_rank), got 11");
}

// Each correction gradient alone, both and neither (the correction's
// products skipped): each one wanted is right, and so is the hidden
// states' gradient.
TEST(TopKGradientTest, CorrectionGradientsOnlyWhereWanted) {
  const Problem p = WithCorrection(MakeProblem());
  const std::vector<double> values = ValuesOf(p);
  const HeadInputs<double> inputs{p.hidden, {}, {},  {},
                                  p.weight, p.bias, p.u, p.m};
  for (const bool want_u : {false, true}) {
    for (const bool want_m : {false, true}) {
      SCOPED_TRACE(absl::StrCat("u ", want_u, " m ", want_m));
      std::vector<double> dh(kRows * kH, 0), du(want_u ? kRows * kRank : 0, 0),
          dm(want_m ? kV * kRank : 0, 0);
      ASSERT_TRUE(AddTopKValueGradients<double>(
                      Config(false, kRank), inputs, p.ids, values,
                      p.grad_values, kK,
                      {absl::MakeSpan(dh), {}, {}, {}, absl::MakeSpan(du),
                       absl::MakeSpan(dm)})
                      .ok());
      for (int64_t i = 0; i < kRows * kH; ++i) {
        EXPECT_NEAR(dh[i], Numeric(p, &Problem::hidden, i), 1e-8) << "h " << i;
      }
      for (size_t i = 0; i < du.size(); ++i) {
        EXPECT_NEAR(du[i], Numeric(p, &Problem::u, i), 1e-8) << "u " << i;
      }
      for (size_t i = 0; i < dm.size(); ++i) {
        EXPECT_NEAR(dm[i], Numeric(p, &Problem::m, i), 1e-8) << "m " << i;
      }
    }
  }
}

TEST(TopKGradientTest, BadInputsAreClearErrors) {
  const Problem p = MakeProblem();
  std::vector<double> values(kRows * kK, 0);
  std::vector<double> dh(kRows * kH);
  const HeadInputs<double> inputs{p.hidden, {}, {}, {}, p.weight, p.bias};
  const HeadGradients<double> gradients{absl::MakeSpan(dh), {}, {}, {}};
  auto run = [&](const std::vector<int32_t>& ids,
                 const std::vector<double>& grads, int32_t k) {
    return std::string(AddTopKValueGradients<double>(Config(false), inputs, ids,
                                                     values, grads, k,
                                                     gradients)
                           .message());
  };
  EXPECT_EQ(run(p.ids, p.grad_values, 0), "k: must lie in [1, 64], got 0");
  // The CUDA kernel's shared memory holds at most 64 factors a row.
  EXPECT_EQ(run(p.ids, p.grad_values, 65), "k: must lie in [1, 64], got 65");
  std::vector<int32_t> ids = p.ids;
  ids[4] = kV;
  EXPECT_EQ(run(ids, p.grad_values, kK),
            "ids[1, 1]: must lie in [0, 13) or be -1, got 13");
  EXPECT_EQ(run(p.ids, std::vector<double>(5), kK),
            "grad_values: must hold 18 values (rows x k), got 5");
  EXPECT_EQ(AddTopKValueGradients<double>(Config(true), inputs, p.ids, values,
                                          p.grad_values, kK, gradients)
                .message(),
            "gradients.weight: must hold 65 values (head.vocab_size x "
            "head.hidden_size, as head.trainable), got 0");
  // Nothing was written.
  for (double x : dh) EXPECT_EQ(x, 0);
}

}  // namespace
}  // namespace dflash
