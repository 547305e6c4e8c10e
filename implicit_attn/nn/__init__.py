"""Shared model parts (layer 3): input checks, NNX building blocks, the config and LM
bases. Families build on these."""
from .checkpoint import CheckpointError, check_tensors
from .checks import (SCAN_METHODS, as_device_array, check_block_input, check_input_ids, check_layers, check_tap, check_taps,
                     count_params, run_scan, scan_method)
from .config import HFConfig
from .hooks import MID_POINTS, OPERATOR_POINTS, RESIDUAL_POINTS, ForwardHooks
from .interventions import AttentionEdit
from .init import fan_in_normal, random_tensors, seed_of
from .lm import LanguageModel
from .mapping import hf_from_params, init_from_table, params_from_hf
from .modules import Mixer, Weights, check_variant, held
from .spec import FamilySpec, move_off_initial_values, perturb_parameters

__all__ = ["MID_POINTS", "OPERATOR_POINTS", "RESIDUAL_POINTS", "ForwardHooks", "AttentionEdit", "CheckpointError", "check_tensors", "SCAN_METHODS", "as_device_array", "check_block_input", "check_input_ids", "check_layers", "check_tap", "check_taps",
           "count_params", "scan_method", "run_scan", "fan_in_normal", "random_tensors", "seed_of", "FamilySpec", "perturb_parameters", "move_off_initial_values", "HFConfig", "LanguageModel", "params_from_hf", "hf_from_params", "init_from_table", "Mixer", "Weights", "check_variant", "held"]
