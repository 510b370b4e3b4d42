"""The engine's own time per round and per scheduler step, measured at start for the profile.

The start-up profile (`planner/cost_profile.py`) times rounds of the models' stages on dummy
inputs. The engine's Python around them only real rows run: assembling a batch, advancing rows,
detokenising (`Stage.OTHER`, per round), and planning, admitting, retiring (`Stage.STEP`, per
step). The live cost model learns both from its first rounds, but seeded and greedy rows plan on
the profile alone (`planner/draft_planner.py`, `_plan_alone`), which without them priced every
round 15-20 % cheaper than it runs on the embedded pair (0.14 ms of ~0.75 at batch 1): too little
for what drafting saves, so seeded standard requests decoded plainly where N = 3 gains ~1.07x.

So before it serves, the engine decodes a few plain dummy requests at batch 1 and at its largest
batch through a scheduler of its own, and what its cost model learned of both overheads joins the
profile as points (cached with it: a restart that loads the cache plans seeded rows as before).
"""

from __future__ import annotations

from collections.abc import Callable

from server.engine.embedded.models import Models
from server.engine.embedded.planner.cost_model import OVERHEADS, CostModel
from server.engine.embedded.planner.draft_planner import DraftPlanner
from server.engine.embedded.row import Row
from server.engine.embedded.scheduler import Scheduler

TOKENS = 8  # per dummy request: its prefill's token, then 7 rounds, a mean over each batch's


def measure_overheads(
    models: Models, cost: CostModel, max_batch: int, plain_row: Callable[[int], Row]
) -> None:
    """Decode `plain_row(i)` rows (N = 0, `TOKENS` tokens each) at batch 1, then `max_batch`,
    learning into `cost`; then set its learned `other` and `step` seconds as points at (R, 0)."""
    planner, models.planner = models.planner, DraftPlanner(cost, 1)
    try:
        scheduler = Scheduler(models, max_batch)
        for batch in sorted({1, max_batch}):
            rows = [plain_row(i) for i in range(batch)]
            for row in rows:
                scheduler.submit(row)
            while not all(row.done for row in rows):
                scheduler.step()
    finally:
        models.planner = planner
    for stage in OVERHEADS:
        for r, seconds in cost.overhead[stage].items():
            cost.set(stage, r, 0, seconds)
