#include "bench/report_format.h"

#include <cmath>
#include <map>
#include <regex>
#include <string>

#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "proto/metrics.pb.h"

namespace dflash {
namespace {

v1::BenchReport Sample() {
  v1::BenchReport r;
  r.set_machine("Test CPU, 2 cores");
  r.set_loss_family("dflash");
  r.set_rows(2048);
  r.set_projected_rows(1656);
  r.set_hidden(1024);
  r.set_vocab(32768);
  r.set_rows_per_chunk(1024);
  r.set_floor_seconds(2.0);
  r.set_floor_gflops(111.0);
  const struct {
    const char* mode;
    double seconds, gemms;
    int64_t mib;
  } modes[] = {{"MATERIALIZE", 2.5, 2, 415},
               {"CHECKPOINT", 3.0, 3, 107},
               {"FUSED", 2.2, 2, 107}};
  for (const auto& m : modes) {
    v1::ModeReport& mode = *r.add_modes();
    mode.mutable_metrics()->set_mode(m.mode);
    mode.mutable_metrics()->set_seconds(m.seconds);
    mode.mutable_metrics()->set_gemms(m.gemms);
    mode.mutable_metrics()->set_peak_bytes(m.mib * 1048576);
    mode.mutable_metrics()->set_loss(4.25);
    mode.set_floor_ratio(m.seconds / 2.0);
    mode.set_effective_gflops(222.0 / m.seconds);
  }
  return r;
}

TEST(ReportFormatTest, MarkdownHasOneLinePerMode) {
  const std::string md = ReportMarkdown(Sample());
  EXPECT_NE(md.find("dflash loss, 2048 rows (1656 projected), H 1024, V 32768, "
                    "chunks of up to 1024 rows; Test CPU, 2 cores. GEMM floor "
                    "(the two GEMMs of the projected rows, raw BLAS): 2.000 s, "
                    "111.0 GFLOP/s."),
            std::string::npos)
      << md;
  EXPECT_NE(md.find("| MATERIALIZE | 2.500 | 1.25 | 2 | 88.8 | 415.0 | "
                    "4.250000 | 0.0% |\n"),
            std::string::npos)
      << md;
  EXPECT_NE(md.find("| CHECKPOINT | 3.000 | 1.50 | 3 | 74.0 | 107.0 |"),
            std::string::npos);
  EXPECT_NE(md.find("| FUSED | 2.200 | 1.10 | 2 | 100.9 | 107.0 |"),
            std::string::npos);
}

TEST(ReportFormatTest, JsonRoundTrips) {
  auto json = ReportJson(Sample());
  ASSERT_TRUE(json.ok()) << json.status();
  v1::BenchReport parsed;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(*json, &parsed).ok());
  EXPECT_EQ(parsed.SerializeAsString(), Sample().SerializeAsString());
  EXPECT_NE(json->find("\"floor_seconds\": 2"), std::string::npos) << *json;
}

// Bar heights are proportional to the values, and the floor line sits at
// the floor on the time panel's scale.
TEST(ReportFormatTest, SvgBarsAreProportionalToTheValues) {
  const std::string svg = ReportSvg(Sample());
  EXPECT_EQ(svg.rfind("<svg xmlns=\"http://www.w3.org/2000/svg\"", 0), 0u);
  EXPECT_EQ(svg.substr(svg.size() - 7), "</svg>\n");
  const std::regex bar(
      "<rect class=\"(time|memory)[^\"]*\" data-mode=\"([A-Z_]+)\" "
      "data-value=\"([0-9.e+-]+)\" x=\"[0-9.]+\" y=\"([0-9.]+)\" "
      "width=\"[0-9.]+\" height=\"([0-9.]+)\"/>");
  std::map<std::string, std::map<std::string, double>> height, value;
  double time_base = 0;
  for (auto it = std::sregex_iterator(svg.begin(), svg.end(), bar);
       it != std::sregex_iterator(); ++it) {
    const std::smatch& m = *it;
    height[m[1]][m[2]] = std::stod(m[5]);
    value[m[1]][m[2]] = std::stod(m[3]);
    if (m[1] == "time") time_base = std::stod(m[4]) + std::stod(m[5]);
  }
  ASSERT_EQ(height["time"].size(), 3u) << svg;
  ASSERT_EQ(height["memory"].size(), 3u) << svg;
  EXPECT_DOUBLE_EQ(value["time"]["CHECKPOINT"], 3.0);
  EXPECT_DOUBLE_EQ(value["memory"]["MATERIALIZE"], 415.0);
  for (const char* panel : {"time", "memory"}) {
    const double per_unit = height[panel]["FUSED"] / value[panel]["FUSED"];
    for (const auto& [mode, h] : height[panel]) {
      EXPECT_NEAR(h, value[panel][mode] * per_unit, 1e-3) << panel << mode;
    }
  }
  std::smatch floor;
  ASSERT_TRUE(std::regex_search(
      svg, floor,
      std::regex("y1=\"([0-9.]+)\" y2=\"[0-9.]+\" class=\"floor\"")));
  const double time_per_unit = height["time"]["FUSED"] / value["time"]["FUSED"];
  EXPECT_NEAR(time_base - std::stod(floor[1]), 2.0 * time_per_unit, 1e-3);
}

}  // namespace
}  // namespace dflash
