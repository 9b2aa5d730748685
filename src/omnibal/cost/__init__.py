"""Cost model: model specs, hardware specs, analytic per-layer costs, measured profiles.

Public API (pure: nothing here measures or imports torch; measurements are :mod:`omnibal.measure`)::

    get_model_preset(name) -> ModelSpec            presets.py  (internvl-chat-1.5, ..., tiny)
    get_hardware(name) -> HardwareSpec             hardware.py (a100-40g, a100-80g, h100, h200)
    analytic_cost_table(spec, hw, tp_size=...)     analytic.py -> LayerCostTable (table.py, the contract)
    load_profile(path, spec), cost_table_from_profile(spec, profile, hardware=...)   profile.py
    calibrate_hardware(spec, hardware, profile) -> HardwareSpec                    calibrate.py
"""

from omnibal.cost.analytic import analytic_cost_table, total_flops_per_sample, zero_sharded_bytes
from omnibal.cost.calibrate import calibrate_hardware
from omnibal.cost.hardware import HardwareSpec, get_hardware
from omnibal.cost.params import layer_param_counts, param_counts
from omnibal.cost.presets import get_model_preset, preset_names
from omnibal.cost.profile import cost_table_from_profile, load_profile
from omnibal.cost.spec import LLMSpec, ModelSpec, VisionSpec
from omnibal.cost.table import FEATURES, LayerCostTable, microbatch_features, pack_features

__all__ = [
    "FEATURES", "HardwareSpec", "LLMSpec", "LayerCostTable", "ModelSpec", "VisionSpec", "analytic_cost_table",
    "calibrate_hardware", "cost_table_from_profile", "get_hardware", "load_profile", "get_model_preset",
    "layer_param_counts", "microbatch_features", "pack_features",
    "param_counts", "preset_names", "total_flops_per_sample", "zero_sharded_bytes",
]
