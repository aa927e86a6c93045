#ifndef DFLASH_HEADS_CONFIG_HEAD_FACTS_H_
#define DFLASH_HEADS_CONFIG_HEAD_FACTS_H_

// What a config implies about the head that runs it: which logits it
// projects and keeps apart, and what it records per row. The head plans
// and runs by these; the config library's cross-field checks and the
// command's memory budget count buffers by them.

#include <cstdint>

#include "proto/objective.pb.h"

namespace dflash {

// Whether the head projects the teacher's hidden states: for a loss that
// reads them (LossTraitsOf(loss).needs_teacher), or for
// head.teacher_diagnostics.
bool ProjectsTeacher(const v1::ObjectiveConfig& config);

// Whether the head records each row's teacher acceptance: for
// head.teacher_diagnostics, or a loss that computes it (DSpark's tau).
bool RecordsTeacherAcceptance(const v1::ObjectiveConfig& config);

// Whether the head keeps its correction's logits apart from the base logits
// (a loss that reads both, Domino's): a second V-wide buffer per chunk, and
// two logits gradients.
bool SplitsCorrection(const v1::ObjectiveConfig& config);

// The V-wide buffers of a chunk: the logits, the teacher's, the
// correction's.
int64_t LogitsBuffers(const v1::ObjectiveConfig& config);

}  // namespace dflash

#endif  // DFLASH_HEADS_CONFIG_HEAD_FACTS_H_
