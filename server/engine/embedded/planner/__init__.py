"""The draft length N per row and round, and the measured cost model it is chosen on.

draft_planner.py  the policy and the engine's side of it: goodput-optimal N (0 included) per row.
acceptance.py     what it believes about acceptance: pooled per kind of row, a row's own evidence.
cost_model.py     seconds per round stage: the start-up shape times live speed factors.
cost_profile.py   the start-up shape: rounds timed on dummy inputs, cached per pair and host.
"""
