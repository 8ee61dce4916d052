"""The engine: plan on a Ray cluster, start one actor per rank, serve generations.

`Engine` is built in raydit.runtime.engine.construction from one module per concern (see
its docstring); its settings are an `EngineConfig` (raydit.runtime.options).
"""

from raydit.runtime.engine.result import GenerationResult
from raydit.runtime.engine.construction import Engine
from raydit.runtime.engine.replicas import Replica
from raydit.runtime.engine.validation import check_steps, round_frames
from raydit.runtime.options import DEVICES, ENGINE_DEFAULT, EngineConfig

__all__ = ["DEVICES", "ENGINE_DEFAULT", "Engine", "EngineConfig", "GenerationResult", "Replica", "check_steps",
           "round_frames"]
