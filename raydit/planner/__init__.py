"""The planner: pure Python, imports neither torch nor ray."""
