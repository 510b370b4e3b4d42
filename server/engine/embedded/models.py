"""What a round runs on: the loaded pair, its caches, the optional learned head and the planner.

Below the round (`round.py`), the prefill, the draft-only rounds and the scheduler, which all take
it; the planner's start-up profile reads only its model half (`planner.cost_profile.ProfiledPair`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from server.engine.embedded.model.kv_cache import KVCache
from server.engine.embedded.model.llama import Transformer

if TYPE_CHECKING:
    from server.engine.embedded.planner.draft_planner import DraftPlanner

# head(h_draft [R, N, Hd], h_target [R, N, Ht], dial [R]) -> w [R, N] (`verifier.head`)
WeightHead = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Models:
    target: Transformer
    draft: Transformer
    target_cache: KVCache
    draft_cache: KVCache
    device: torch.device
    head: WeightHead | None = None
    num_threads: int | None = None  # intra-op threads for the thread running the model math
    planner: DraftPlanner | None = None  # cost model + acceptance estimates; None: N stays as set
    first_token_from_prefill: bool = True  # `prefill.py`; see `EmbeddedEngineConfig`
    forced_tv: float | None = None  # the bench's forced acceptance (`forced.force_acceptance`)
