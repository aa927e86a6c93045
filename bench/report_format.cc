#include "bench/report_format.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "google/protobuf/util/json_util.h"

namespace dflash {
namespace {

constexpr double kMiB = 1048576.0;

// The smallest 1, 2 or 5 x 10^n step that splits [0, top] in at most 5.
double TickStep(double top) {
  if (!(top > 0)) return 1;
  const double raw = top / 5;
  const double magnitude = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0, 10.0}) {
    if (m * magnitude >= raw) return m * magnitude;
  }
  return 10 * magnitude;
}

std::string Escape(const std::string& text) {
  return absl::StrReplaceAll(
      text, {{"&", "&amp;"}, {"<", "&lt;"}, {">", "&gt;"}, {"\"", "&quot;"}});
}

// The dflash_head --mode spelling, short enough to sit under a bar.
std::string ShortName(const std::string& mode) {
  if (mode == "SAVE_CHUNKS") return "save";
  return absl::AsciiStrToLower(mode);
}

struct Panel {
  double x, y, width, height;  // Plot area, inside the axes.
  std::string title, unit;
  std::string css_class;  // Of the bars: "time" or "memory".
};

// Bars for `values` in `panel`, gridlines and tick labels; `floor` >= 0 adds
// a dashed line across the panel at that value.
void DrawPanel(const Panel& panel, const std::vector<std::string>& labels,
               const std::vector<double>& values, double floor,
               const std::string& floor_label, std::string& svg) {
  double top = *std::max_element(values.begin(), values.end());
  top = std::max(top, floor) * 1.08;
  const double step = TickStep(top);
  top = std::ceil(top / step) * step;
  const double base = panel.y + panel.height;
  auto y_of = [&](double v) { return base - v / top * panel.height; };
  absl::StrAppendFormat(
      &svg, "<text x=\"%.1f\" y=\"%.1f\" class=\"title\">%s</text>\n", panel.x,
      panel.y - 12, Escape(panel.title));
  for (double v = 0; v <= top * (1 + 1e-9); v += step) {
    absl::StrAppendFormat(
        &svg,
        "<line x1=\"%.1f\" x2=\"%.1f\" y1=\"%.2f\" y2=\"%.2f\" "
        "class=\"grid\"/>\n<text x=\"%.1f\" y=\"%.2f\" "
        "class=\"tick\">%g</text>\n",
        panel.x, panel.x + panel.width, y_of(v), y_of(v), panel.x - 6,
        y_of(v) + 4, v);
  }
  const double slot = panel.width / values.size();
  const double bar = slot * 0.62;
  for (size_t i = 0; i < values.size(); ++i) {
    const double x = panel.x + slot * i + (slot - bar) / 2;
    const double h = values[i] / top * panel.height;
    absl::StrAppendFormat(
        &svg,
        "<rect class=\"%s%s\" data-mode=\"%s\" data-value=\"%.6g\" "
        "x=\"%.2f\" y=\"%.4f\" width=\"%.2f\" height=\"%.4f\"/>\n"
        "<text x=\"%.2f\" y=\"%.2f\" class=\"value\">%.3g</text>\n"
        "<text x=\"%.2f\" y=\"%.2f\" class=\"label\">%s</text>\n",
        panel.css_class, labels[i] == "FUSED" ? " best" : "", labels[i],
        values[i], x, base - h, bar, h, x + bar / 2, base - h - 4, values[i],
        x + bar / 2, base + 16, Escape(ShortName(labels[i])));
  }
  if (floor >= 0) {
    // The line across the bars, and its legend above the panel's top right.
    const double right = panel.x + panel.width;
    absl::StrAppendFormat(
        &svg,
        "<line x1=\"%.1f\" x2=\"%.1f\" y1=\"%.4f\" y2=\"%.4f\" "
        "class=\"floor\" data-value=\"%.6g\"/>\n"
        "<line x1=\"%.1f\" x2=\"%.1f\" y1=\"%.1f\" y2=\"%.1f\" "
        "class=\"floor\"/>\n"
        "<text x=\"%.1f\" y=\"%.1f\" class=\"floorlabel\">%s</text>\n",
        panel.x, right, y_of(floor), y_of(floor), floor, right - 24, right,
        panel.y - 16, panel.y - 16, right - 28, panel.y - 12,
        Escape(floor_label));
  }
  absl::StrAppendFormat(
      &svg,
      "<line x1=\"%.1f\" x2=\"%.1f\" y1=\"%.1f\" y2=\"%.1f\" class=\"axis\"/>\n"
      "<text x=\"%.1f\" y=\"%.1f\" class=\"unit\">%s</text>\n",
      panel.x, panel.x + panel.width, base, base, panel.x - 6, panel.y - 12,
      Escape(panel.unit));
}

}  // namespace

std::string ReportMarkdown(const v1::BenchReport& r) {
  std::string md = absl::StrFormat(
      "%s loss, %d rows (%d projected), H %d, V %d, chunks of up to %d rows; "
      "%s. GEMM floor (the two GEMMs of the projected rows, raw BLAS): "
      "%.3f s, %.1f GFLOP/s. The head's GEMMs: %s%s.\n\n",
      r.loss_family(), r.rows(), r.projected_rows(), r.hidden(), r.vocab(),
      r.rows_per_chunk(), r.machine(), r.floor_seconds(), r.floor_gflops(),
      r.gemm_library(),
      r.prepare_seconds() > 0
          ? absl::StrFormat(" (laying the weight out: %.3f s, once)",
                            r.prepare_seconds())
          : "");
  if (r.gradient_filter_error() > 0) {
    absl::StrAppendFormat(&md,
                          "Gradient filter: FUSED's d(loss)/d(hidden) within "
                          "%.2g (max error over max entry) of the exact.\n\n",
                          r.gradient_filter_error());
  }
  md +=
      "| mode | seconds | x floor | GEMM passes | effective GFLOP/s | peak MiB "
      "| loss | tiles filtered |\n|---|---:|---:|---:|---:|---:|---:|---:|\n";
  for (const v1::ModeReport& mode : r.modes()) {
    const v1::HeadMetrics& m = mode.metrics();
    absl::StrAppendFormat(
        &md, "| %s | %.3f | %.2f | %.3g | %.1f | %.1f | %.6f | %.1f%% |\n",
        m.mode(), m.seconds(), mode.floor_ratio(), m.gemms(),
        mode.effective_gflops(), m.peak_bytes() / kMiB, m.loss(),
        100 * m.gradient_filter_skipped_fraction());
  }
  return md;
}

absl::StatusOr<std::string> ReportJson(const v1::BenchReport& report) {
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = true;
  options.always_print_primitive_fields = true;
  options.preserve_proto_field_names = true;
  std::string json;
  if (auto status =
          google::protobuf::util::MessageToJsonString(report, &json, options);
      !status.ok()) {
    return absl::InternalError(
        absl::StrCat("report.json: ", std::string(status.message())));
  }
  return json;
}

std::string ReportSvg(const v1::BenchReport& r) {
  constexpr double kWidth = 860, kHeight = 360;
  std::vector<std::string> labels;
  std::vector<double> seconds, mib;
  for (const v1::ModeReport& mode : r.modes()) {
    labels.push_back(mode.metrics().mode());
    seconds.push_back(mode.metrics().seconds());
    mib.push_back(mode.metrics().peak_bytes() / kMiB);
  }
  std::string svg = absl::StrFormat(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%g\" height=\"%g\" "
      "viewBox=\"0 0 %g %g\" font-family=\"sans-serif\" font-size=\"12\">\n"
      "<style>\n"
      ".title{font-weight:bold}.tick{text-anchor:end;fill:#555}"
      ".unit{text-anchor:end;fill:#555}"
      ".label{text-anchor:middle;font-size:11px}"
      ".value{text-anchor:middle;font-size:10px;fill:#333}"
      ".grid{stroke:#ddd}.axis{stroke:#333}"
      ".time{fill:#8fb3d9}.memory{fill:#b9a6d6}.best{fill:#3c78b4}"
      ".memory.best{fill:#6b4fa0}"
      ".floor{stroke:#c0392b;stroke-width:2;stroke-dasharray:6 4}"
      ".floorlabel{text-anchor:end;fill:#c0392b;font-size:11px}"
      ".caption{fill:#444;font-size:11px}\n"
      "</style>\n<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n",
      kWidth, kHeight, kWidth, kHeight);
  absl::StrAppendFormat(
      &svg, "<text x=\"20\" y=\"22\" class=\"title\">%s</text>\n",
      Escape(absl::StrFormat(
          "dflash head, every mode: %s loss, %d rows (%d projected), H %d, "
          "V %d",
          r.loss_family(), r.rows(), r.projected_rows(), r.hidden(),
          r.vocab())));
  absl::StrAppendFormat(
      &svg, "<text x=\"20\" y=\"%g\" class=\"caption\">%s</text>\n",
      kHeight - 10,
      Escape(absl::StrFormat("%s; chunks of up to %d rows; //bench:report",
                             r.machine(), r.rows_per_chunk())));
  DrawPanel({70, 70, 330, 220, "Forward + backward", "s", "time"}, labels,
            seconds, r.floor_seconds(),
            absl::StrFormat("GEMM floor %.3g s", r.floor_seconds()), svg);
  DrawPanel(
      {510, 70, 330, 220, "Peak memory (tracking allocator)", "MiB", "memory"},
      labels, mib, -1, "", svg);
  svg += "</svg>\n";
  return svg;
}

}  // namespace dflash
