"""A diffusers scheduler's own state, kept between steps and saved in checkpoints.

The runner keeps a scheduler's plain-data attributes live between steps
(`live_scheduler_state`), restores them before a step (`load_scheduler_state`) and packs them
into CPU data for a checkpoint (`pack_scheduler_state`); a family whose frames step on
schedulers of their own (SkyReels-V2's diffusion forcing) does the same per frame.

Imports stay light (no torch at the top): the families import this.
"""

from __future__ import annotations

from typing import Any, Mapping

_TENSOR = "__raydit_tensor__"


def _pack(value):
    import numpy as np
    import torch

    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, torch.Tensor):
        # One copy: .to("cpu") alone would share a CPU tensor's memory, .clone() after it
        # would copy a device tensor twice.
        return (_TENSOR, value.detach().to("cpu", copy=True), str(value.device))
    if isinstance(value, list):
        return [_pack(v) for v in value]
    if _is_packed(value):
        return value  # packed already (a state that was loaded from a checkpoint)
    if isinstance(value, tuple):
        return tuple(_pack(v) for v in value)
    if isinstance(value, dict):
        return {k: _pack(v) for k, v in value.items()}
    return value


def _unpack(value, device=None):
    if _is_packed(value):
        _, tensor, saved_device = value
        # A tensor the scheduler kept on the CPU (sigmas) stays there; device tensors go to
        # this rank's device, which may differ from the saver's.
        target = "cpu" if saved_device == "cpu" or device is None else device
        return tensor.to(target).clone()
    if isinstance(value, list):
        return [_unpack(v, device) for v in value]
    if isinstance(value, tuple):
        return tuple(_unpack(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _unpack(v, device) for k, v in value.items()}
    return value


def _is_packed(value) -> bool:
    return isinstance(value, tuple) and len(value) == 3 and value[0] == _TENSOR


def _is_data(value) -> bool:
    import numpy as np
    import torch

    if value is None or isinstance(value, (bool, int, float, str, torch.Tensor, np.ndarray)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_is_data(v) for v in value)
    return False


def live_scheduler_state(scheduler) -> dict:
    """Every attribute of a diffusers scheduler that is plain data (tensors, numbers, lists of
    them): what a step reads and writes (UniPC's model_outputs, timestep_list,
    lower_order_nums, last_sample, this_order, _step_index; DPM-Solver's the same kind); the
    frozen config is left out, it belongs to the pipeline, not to the request. Kept on the
    device: tensors by reference, containers copied (a scheduler rebinds its tensors and edits its own lists,
    e.g. UniPC's model_outputs, in place: a copied list keeps this snapshot intact; no
    diffusers scheduler writes into a tensor of its state after set_timesteps). What the
    runner keeps between steps: copying the state to the host every step costs a device
    synchronization and tens of MB of copies (UniPC's history is a few latents). Pack it with
    `pack_scheduler_state` to checkpoint it."""
    return {k: _shallow(v) for k, v in vars(scheduler).items() if k != "_internal_dict" and _is_data(v)}


def pack_scheduler_state(state: Mapping[str, Any]) -> dict:
    """A live (or packed) scheduler state -> plain CPU data (a checkpoint's)."""
    return {k: _pack(v) for k, v in state.items()}


def _shallow(value):
    if isinstance(value, list):
        return [_shallow(v) for v in value]
    if isinstance(value, dict):
        return {k: _shallow(v) for k, v in value.items()}
    return value


def load_scheduler_state(scheduler, state: Mapping[str, Any], device=None) -> None:
    for k, v in state.items():
        setattr(scheduler, k, _unpack(v, device))
