#ifndef DFLASH_HEADS_HEAD_METRICS_H_
#define DFLASH_HEADS_HEAD_METRICS_H_

// HeadMetricsOf: a head run's result as the v1::HeadMetrics record
// (proto/metrics.proto) that the dflash_head command writes as
// metrics.json and the benchmarks report.

#include "heads/head_types.h"
#include "proto/metrics.pb.h"
#include "proto/objective.pb.h"

namespace dflash {

v1::HeadMetrics HeadMetricsOf(const v1::ObjectiveConfig& config,
                              const HeadResult& result);

}  // namespace dflash

#endif  // DFLASH_HEADS_HEAD_METRICS_H_
