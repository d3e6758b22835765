"""d3s-openrlhf: Dynamic Dual-Level Down-Sampling (D3S, arXiv 2509.22115) and PODS (arXiv 2504.13818) for
OpenRLHF 0.11.x.

The names exported here are the pure-torch core (no OpenRLHF, Ray, DeepSpeed or vLLM import). The OpenRLHF
glue lives in :mod:`d3s_openrlhf.integration` (its seam to the host's arguments in
:mod:`d3s_openrlhf.integration.host`) and the entrypoint in :mod:`d3s_openrlhf.cli.train_ppo_ray`.
"""

from d3s_openrlhf.core.advantages import ADVANTAGE_ESTIMATORS, ESTIMATORS, group_advantages
from d3s_openrlhf.core.batching import intra_counts, kept_unit, legal_kept_count
from d3s_openrlhf.core.config import PRESETS, D3SConfig
from d3s_openrlhf.core.entropy import entropy_from_logits
from d3s_openrlhf.core.logprobs import chunked_logprobs_entropy
from d3s_openrlhf.core.metrics import step_metrics
from d3s_openrlhf.core.schedule import DownSamplingSchedule
from d3s_openrlhf.core.selection import SELECTION_RULES, select_rollouts, step_generator
from d3s_openrlhf.core.token_mask import token_keep_mask, token_mask_metrics

__version__ = "0.1.0"

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "ESTIMATORS",
    "PRESETS",
    "SELECTION_RULES",
    "D3SConfig",
    "DownSamplingSchedule",
    "chunked_logprobs_entropy",
    "entropy_from_logits",
    "group_advantages",
    "intra_counts",
    "kept_unit",
    "legal_kept_count",
    "select_rollouts",
    "step_generator",
    "step_metrics",
    "token_keep_mask",
    "token_mask_metrics",
]
