"""The LoRA table of an Engine: the adapters every rank of every replica holds (name ->
LoraSpec), the one fused into the weights (fuse_lora), and loading / unloading between
requests."""

from __future__ import annotations

import dataclasses
import os
import threading


class LoraPart:
    """The Engine's LoRA table (a part of raydit.runtime.engine.Engine)."""

    def _init_loras(self, loras: dict | None, fuse_lora) -> None:
        """LoRA adapters (name -> LoraSpec), checked against the model before Ray starts;
        every rank of every replica loads them once (WorkerPool.form). fuse_lora (True, a
        name or {name: scale}): the engine's one LoRA merged into the weights on every rank
        (no per-step cost); every request then runs with it."""
        from raydit.models.lora import adapter_bytes, fuse_choice

        self._loras: dict = {}
        self._lora_lock = threading.Lock()
        for name, entry in (loras or {}).items():
            spec = self._lora_spec(entry, name)
            self._loras[spec.name] = spec
        self._fused = fuse_choice(fuse_lora, self._loras)
        if self._fused is not None:
            name, scale = self._fused
            self._loras[name] = dataclasses.replace(self._loras[name], fuse_scale=scale)
        self._refuse_if_compiled([n for n in self._loras if self._fused is None or n != self._fused[0]])
        self._refuse_if_quantized([n for n in self._loras if self._fused is None or n != self._fused[0]])
        # The planner counts the adapters' bytes on every rank (0 for a fused one).
        self.spec = dataclasses.replace(self.spec, adapter_bytes=float(sum(adapter_bytes(s) for s in self._loras.values())))

    def _lora_spec(self, entry, name: str | None = None):
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
        if spec.name in self._loras:
            raise ValueError(f"a LoRA named {spec.name!r} is already loaded; unload it first or give another name")
        lora.check_for_model(self.model_dir, spec)
        return spec

    def _fused_default(self, lora):
        """On a fused engine a request that names no LoRA runs with the fused one."""
        from raydit.models.lora import normalize_choice

        if self._fused is not None and not normalize_choice(lora):
            return {self._fused[0]: self._fused[1]}
        return lora

    @property
    def fused_lora(self) -> dict[str, float] | None:
        """{name: scale} of the LoRA fused into the weights (fuse_lora), or None."""
        return None if self._fused is None else {self._fused[0]: self._fused[1]}

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

    def loras(self) -> dict[str, str]:
        """The loaded LoRA adapters: name -> path of the .safetensors file."""
        return {name: spec.path for name, spec in self._loras.items()}

    def load_lora(self, path, name: str | None = None, target: str = "transformer") -> str:
        """Load a LoRA on every rank of every replica (once; requests then choose it by name
        with `lora=`). `target`: "transformer", "transformer_2" (Wan 2.2 A14B's low-noise
        expert) or "both". Waits for running requests to finish. Returns the name."""
        self._refuse_if_fused("load a LoRA")
        self._refuse_if_compiled([name or str(path)])
        self._refuse_if_quantized([name or str(path)])
        with self._lora_lock:
            spec = self._lora_spec({"path": path, "target": target}, name)
            self._sync_loras({**self._loras, spec.name: spec})
            return spec.name

    def unload_lora(self, name: str) -> None:
        """Unload a LoRA from every rank; later requests cannot name it."""
        self._refuse_if_fused("unload a LoRA")
        with self._lora_lock:
            if name not in self._loras:
                raise ValueError(f"LoRA {name!r} is not loaded; loaded: {', '.join(sorted(self._loras)) or 'none'}")
            self._sync_loras({n: s for n, s in self._loras.items() if n != name})

    def _sync_loras(self, table: dict) -> None:
        """Make every member of every replica hold `table`, between requests: each replica is
        claimed as it becomes idle (the dispatcher starts nothing on it meanwhile). On a
        failure every rank goes back to the previous table and the error is raised."""
        import ray

        if not self.replicas:
            raise RuntimeError("engine is shut down; create a new Engine")
        cond = self._dispatcher.cond
        claimed: list = []
        with cond:
            while len(claimed) < len(self.replicas):
                for r in self.replicas:
                    if r not in claimed and not r.busy:
                        r.busy = True
                        claimed.append(r)
                if len(claimed) < len(self.replicas):
                    cond.wait(timeout=1.0)
        try:
            previous = dict(self._loras)
            actors = [m.actor for r in self.replicas for m in r.pool.members]
            try:
                ray.get([a.sync_loras.remote(table) for a in actors], timeout=300)
            except Exception as exc:
                from raydit.runtime.failures import classify

                try:
                    ray.get([a.sync_loras.remote(previous) for a in actors], timeout=300)
                except Exception:  # a rank that cannot even go back is replaced at the next form
                    for r in self.replicas:
                        r.pool.reset_group()
                raise ValueError(classify(exc).message) from None
            self._loras = dict(table)
            from raydit.models.lora import adapter_bytes

            self.spec = dataclasses.replace(self.spec, adapter_bytes=float(sum(adapter_bytes(s) for s in table.values())))
            for r in self.replicas:
                r.pool.loras = dict(table)
            self._event("loras", loaded=sorted(table))
        finally:
            with cond:
                for r in claimed:
                    r.busy = False
                cond.notify_all()
