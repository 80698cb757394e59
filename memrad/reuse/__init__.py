"""The reuse pool: parked sessions (pool.py, mechanism) and the planner (policy, pure)."""
