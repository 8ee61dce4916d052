"""The Ray runtime: one actor per rank, process groups, the engine."""
