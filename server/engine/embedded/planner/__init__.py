"""The draft length N per row and round, and the measured cost model it is chosen on.

draft_length.py   the policy: goodput-optimal N (0 included) from acceptance and round costs.
draft_planner.py  the engine's side of it: rows to choices, exploration, learning from rounds.
cost_model.py     measured seconds per round stage; their online refinement.
cost_profile.py   the cost model's start-up profile, re-timing of a cached model, its cache.
"""
