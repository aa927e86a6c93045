"""dflash for PyTorch.

- dflash_objective: the DFlash-family objective's chunk terms through the
  fused C++ head, autograd-correct, zero-copy: ObjectiveTerms (the core
  terms) and their ObjectiveDiagnostics (HeadStats, FamilyTerms).
  check_objective_results raises the error a head.device_results call
  latched on the device.
- FusedHead: an nn.Module over a frozen nn.Linear lm_head and a config.
- chunked_reduce: SpecForge's checkpointed_chunk_reduce for any chunk
  function, with segments of chunks as the recompute boundary.
- separate_numerators: several loss numerators, each
  differentiable, from one head call (SpecForge's DSpark and Domino terms,
  weighed after the reduction).
- selective_checkpoint_context_fn, checkpoint_options (CheckpointOptions): a
  dflash checkpoint policy for torch.utils.checkpoint.
- accepted_prefix_lengths, walk_accepted_length_terms,
  hard_label_prefix_counts (PrefixCounts): SpecForge main's accepted-length
  metrics from the head's per-row outputs (argmax, target_is_candidate).
- selector_terms (SelectorTerms), selector_position_terms
  (SelectorPositionTerms), selector_greedy_terms (SelectorGreedyTerms):
  SpecForge main's DFlash2 selector terms from the head's top-k outputs and
  the caller's selector scores.
"""

from dflash.torch.acceptance import (PrefixCounts, accepted_prefix_lengths,
                                      hard_label_prefix_counts,
                                      walk_accepted_length_terms)
from dflash.torch.checkpoint_policy import (CheckpointOptions,
                                            checkpoint_options,
                                            selective_checkpoint_context_fn)
from dflash.torch.chunking import chunked_reduce
from dflash.torch.head import FusedHead
from dflash.torch.objective import (FamilyTerms, HeadStats,
                                    ObjectiveDiagnostics, ObjectiveTerms,
                                    check_objective_results,
                                    dflash_objective)
from dflash.torch.selector import (SelectorGreedyTerms, SelectorPositionTerms,
                                   SelectorTerms, selector_greedy_terms,
                                   selector_position_terms, selector_terms)
from dflash.torch.term_numerators import separate_numerators

__all__ = [
    "CheckpointOptions",
    "FamilyTerms",
    "FusedHead",
    "HeadStats",
    "ObjectiveDiagnostics",
    "ObjectiveTerms",
    "PrefixCounts",
    "SelectorGreedyTerms",
    "SelectorPositionTerms",
    "SelectorTerms",
    "accepted_prefix_lengths",
    "check_objective_results",
    "checkpoint_options",
    "chunked_reduce",
    "dflash_objective",
    "hard_label_prefix_counts",
    "selective_checkpoint_context_fn",
    "selector_greedy_terms",
    "selector_position_terms",
    "selector_terms",
    "separate_numerators",
    "walk_accepted_length_terms",
]
