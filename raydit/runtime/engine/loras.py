"""The LoRA table of an Engine: the adapters every rank of every replica holds (name ->
LoraSpec), the one fused into the weights (fuse_lora), and loading / unloading between
requests (the replicas do the syncing: `sync(table)` given to load / unload)."""

from __future__ import annotations

import dataclasses
import os
import threading
from typing import Callable


class LoraTable:
    """The Engine's LoRA adapters, checked against the model on the driver (no Ray)."""

    def __init__(self, model_dir: str, run_config, loras: dict | None, fuse_lora):
        """loras: name -> path (or {"path": P, "target": T}); every rank of every replica loads
        them once (WorkerPool.form). fuse_lora (True, a name or {name: scale}): the engine's one
        LoRA merged into the weights on every rank (no per-step cost); every request then runs
        with it."""
        from raydit.models.lora import fuse_choice

        self.model_dir = model_dir
        self.run_config = run_config
        self._table: dict = {}
        self._lock = threading.Lock()
        for name, entry in (loras or {}).items():
            spec = self.spec_for(entry, name)
            self._table[spec.name] = spec
        self._fused = fuse_choice(fuse_lora, self._table)
        if self._fused is not None:
            name, scale = self._fused
            self._table[name] = dataclasses.replace(self._table[name], fuse_scale=scale)
        switched = [n for n in self._table if self._fused is None or n != self._fused[0]]
        self._refuse_if_compiled(switched)
        self._refuse_if_quantized(switched)

    @property
    def table(self) -> dict:
        """name -> LoraSpec (a copy)."""
        return dict(self._table)

    def adapter_bytes(self, table: dict | None = None) -> float:
        """The adapters' bytes on every rank (0 for a fused one), as the planner counts them."""
        from raydit.models.lora import adapter_bytes

        return float(sum(adapter_bytes(s) for s in (self._table if table is None else table).values()))

    def spec_for(self, entry, name: str | None = None):
        """A path (or {"path": P, "target": T}) -> a LoraSpec checked against this model on
        the driver (raydit.models.lora.check_for_model: no weights loaded, no Ray)."""
        from raydit.models import lora

        target = "transformer"
        if isinstance(entry, dict):
            unknown = set(entry) - {"path", "target"}
            if unknown or "path" not in entry:
                raise ValueError(f"LoRA entry {entry!r} must be a path or {{'path': P, 'target': T}}")
            entry, target = entry["path"], entry.get("target", target)
        if not isinstance(entry, (str, os.PathLike)):
            raise ValueError(f"LoRA path {entry!r} must be a path to a .safetensors file or a directory holding one")
        if target not in lora.TARGETS:
            raise ValueError(f"LoRA target {target!r} is not one of {', '.join(lora.TARGETS)}")
        spec = lora.LoraSpec(name=lora.check_name(name if name is not None else lora.default_name(entry)),
                             path=str(lora.lora_file(entry)), target=target)
        if spec.name in self._table:
            raise ValueError(f"a LoRA named {spec.name!r} is already loaded; unload it first or give another name")
        lora.check_for_model(self.model_dir, spec)
        return spec

    def fused_default(self, lora):
        """On a fused engine a request that names no LoRA runs with the fused one."""
        from raydit.models.lora import normalize_choice

        if self._fused is not None and not normalize_choice(lora):
            return {self._fused[0]: self._fused[1]}
        return lora

    @property
    def fused_lora(self) -> dict[str, float] | None:
        """{name: scale} of the LoRA fused into the weights (fuse_lora), or None."""
        return None if self._fused is None else {self._fused[0]: self._fused[1]}

    def check_request(self, request) -> None:
        """A request's LoRA: the fused one on a fused engine, else loaded ones only."""
        if self._fused is not None and request.lora != (self._fused,):
            name, scale = self._fused
            raise ValueError(
                f"this engine serves LoRA {name!r} fused into its weights at scale {scale:g} (fuse_lora / "
                f"--fuse-lora), so every request runs with it; this one asks for "
                f"{dict(request.lora) or 'the base model'}: leave lora out (or give {{{name!r}: {scale:g}}}), "
                "or use an engine without fuse_lora to switch adapters per request"
            )
        for name, _ in request.lora:
            if name not in self._table:
                raise ValueError(
                    f"LoRA {name!r} is not loaded; loaded: {', '.join(sorted(self._table)) or 'none'} "
                    "(load it with Engine.load_lora(path, name) or --lora PATH)"
                )

    def _refuse_if_fused(self, what: str) -> None:
        if self._fused is not None:
            raise ValueError(
                f"cannot {what}: LoRA {self._fused[0]!r} is fused into this engine's weights (fuse_lora); "
                "start an engine without fuse_lora to load and unload adapters"
            )

    def _refuse_if_compiled(self, names: list) -> None:
        # peft's layers in a compiled block: every switch of adapters or scales would
        # recompile the blocks (Dynamo guards on them). A fused LoRA is plain weights.
        if self.run_config.compile and names:
            raise ValueError(
                f"LoRA {', '.join(map(str, names))} cannot be switched per request on compiled blocks (compile=True); "
                "fuse one LoRA into the weights (fuse_lora / --fuse-lora) or drop compile"
            )

    def _refuse_if_quantized(self, names: list) -> None:
        # A fused LoRA is quantized with the weights; a switched one is refused (quantize_options).
        from raydit.models.quantize_options import quantize_lora_refusal

        switching = [f"LoRA {', '.join(map(str, names))}"] if names else []
        refusal = quantize_lora_refusal(self.run_config.quantize, switching)
        if refusal:
            raise ValueError(refusal)

    def paths(self) -> dict[str, str]:
        """The loaded LoRA adapters: name -> path of the .safetensors file."""
        return {name: spec.path for name, spec in self._table.items()}

    def load(self, path, name: str | None, target: str, sync: Callable[[dict, dict], None]) -> str:
        """Check and add an adapter; `sync(table, previous)` makes every rank hold the new
        table (raising leaves this one as it was). Returns its name."""
        self._refuse_if_fused("load a LoRA")
        self._refuse_if_compiled([name or str(path)])
        self._refuse_if_quantized([name or str(path)])
        with self._lock:
            spec = self.spec_for({"path": path, "target": target}, name)
            table = {**self._table, spec.name: spec}
            sync(table, dict(self._table))
            self._table = table
            return spec.name

    def unload(self, name: str, sync: Callable[[dict, dict], None]) -> None:
        self._refuse_if_fused("unload a LoRA")
        with self._lock:
            if name not in self._table:
                raise ValueError(f"LoRA {name!r} is not loaded; loaded: {', '.join(sorted(self._table)) or 'none'}")
            table = {n: s for n, s in self._table.items() if n != name}
            sync(table, dict(self._table))
            self._table = table
