#ifndef DFLASH_HEADS_CONFIG_HEAD_CONFIG_H_
#define DFLASH_HEADS_CONFIG_HEAD_CONFIG_H_

// The head config's own checks (paths under "head."): sizes, dtype and
// backend that a head can run, execution mode, logit transform, threads.
// The config library adds the cross-field checks.

#include "base/problem_list.h"
#include "proto/head.pb.h"

namespace dflash {

void AddHeadConfigProblems(const v1::HeadConfig& head, ProblemList& problems);

}  // namespace dflash

#endif  // DFLASH_HEADS_CONFIG_HEAD_CONFIG_H_
