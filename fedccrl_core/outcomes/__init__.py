"""Outcomes (floor 3): saved runs re-evaluated on their held-out domain (the evaluate stage) and the results tables
and per-round series (the report and figures stages)."""
