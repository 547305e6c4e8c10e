"""Shared fixtures: tiny random Hugging Face models built in torch and saved locally."""
from __future__ import annotations

import gc
import importlib.util
import os
import re
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

# Byte-compiled modules are written (as a default Python does) even where $PYTHONDONTWRITEBYTECODE
# is set: each worker and each subprocess otherwise compiles our package and pytest rewrites
# and compiles every test module again (about 5 s of each worker's collection on a 2-core CPU).
sys.dont_write_bytecode = False

# The command line caches compiled programs on disk by default; tests that call it in-process
# must not write to the user's cache (tests/test_cli.py checks the cache in subprocesses).
os.environ.setdefault("IMPLICIT_ATTN_COMPILE_CACHE", "0")
# impl="auto" skips the fused CPU kernels for small operators; the tests' operators are tiny
# on purpose, so they take the kernels at every size (in subprocesses too).
# tests/test_dispatch.py checks the threshold itself.
os.environ.setdefault("IMPLICIT_ATTN_CPU_AUTO_MIN", "0")

import jax
import numpy as np
import pytest

from implicit_attn.compile_cache import compile_cache_dir, enable_compile_cache, with_quick_flags
from implicit_attn.kernels.cpu import CpuKernelUnavailable

# Compiling dominates the suite (thousands of tiny XLA programs): the tests compile with the
# command line's quick settings (compile_cache.QUICK_XLA_FLAGS: about 3x faster to compile a
# tiny model). Same HLO, slower machine code; two separately compiled programs may round
# differently (as at any setting), so tests compare them with tolerances. Benchmarks use
# XLA's defaults. XLA reads the flags when JAX's backend starts, after this.
os.environ.setdefault("XLA_FLAGS", with_quick_flags("--xla_force_host_platform_device_count=1"))

# Most of the suite's time is tracing, lowering and compiling its programs, and a run compiles
# the programs the last run compiled but for those the changes touch: each worker keeps what it
# compiles in JAX's persistent compilation cache, per CPU (its model and feature flags), and
# loads it from there in the next run (a program is still traced and lowered: JAX's key is the
# lowered module, with the XLA flags and the jax and jaxlib versions). Set in this process
# only: subprocesses (the command line's cache tests) keep their own settings.
# $IMPLICIT_ATTN_TEST_COMPILE_CACHE: 0 (off, false, no) turns it off, a path puts it there.
TEST_CACHE_ENV = "IMPLICIT_ATTN_TEST_COMPILE_CACHE"
# Past this size the cache is cut to half of it when a run starts, the programs written longest
# ago first (JAX's own size limit rescans the directory at every write: minutes per run).
TEST_CACHE_MAX_BYTES = 2 * 2**30


def suite_compile_cache_dir() -> Path | None:
    """Where the tests keep compiled programs, or ``None`` when ``$IMPLICIT_ATTN_TEST_COMPILE_CACHE``
    turns it off: ``<cache_dir("jax_tests")>/<CPU key>`` by default. Creates the directory."""
    return compile_cache_dir(TEST_CACHE_ENV, "jax_tests")


def prune_cache(path: Path, max_bytes: int) -> int:
    """If the files in ``path`` hold more than ``max_bytes``, remove the ones written longest ago
    until at most half of it is left. Returns the bytes removed."""
    files = sorted((st.st_mtime, st.st_size, f) for f in path.iterdir() if f.is_file() for st in [f.stat()])
    total = sum(size for _, size, _ in files)
    removed = 0
    if total > max_bytes:
        for _, size, f in files:
            if total - removed <= max_bytes // 2:
                break
            f.unlink(missing_ok=True)
            removed += size
    return removed


try:
    if (suite_cache := suite_compile_cache_dir()) is not None:
        enable_compile_cache(suite_cache)
        if "PYTEST_XDIST_WORKER" not in os.environ:  # once per run, before the workers start
            prune_cache(suite_cache, TEST_CACHE_MAX_BYTES)
except (OSError, CpuKernelUnavailable) as e:
    warnings.warn(f"the tests run without a compilation cache: {e}", stacklevel=1)


def mapped_regions() -> int:
    """This process's memory mappings (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def mapping_limit() -> int:
    """The kernel's limit on a process's memory mappings (``vm.max_map_count``; Linux's default
    where it cannot be read)."""
    try:
        return int(Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        return 65530


# Every compiled XLA CPU program keeps memory mappings (about 5); a worker that compiles a few
# thousand of them (the deep tier) nears the kernel's limit, and then a compile fails inside
# LLVM with a segfault or abort. Within this many mappings of the limit (or past half of it)
# the compiled programs are dropped (later tests recompile what they need). Dropping them costs
# seconds (5.3 s at 30,000 mappings, and the reloads after it): default-tier workers end with
# about 25,000-32,000 and deep-tier ones reach about 41,000, so at the default limit neither has to.
MAPPINGS_LEFT = 20000
MAPPING_LIMIT = mapping_limit()
MAX_MAPPED_REGIONS = max(MAPPING_LIMIT - MAPPINGS_LEFT, MAPPING_LIMIT // 2)
# Reading /proc/self/maps takes milliseconds once a worker holds thousands of mappings, and
# the mappings come with compiled programs (about 5 per compile in test_conformance): they
# are counted again only after this many compiles, a few hundred mappings at most.
COMPILES_PER_COUNT = 100
compiles_since_count = [0]


def count_compile(event: str, duration_secs: float, **kwargs) -> None:
    # also timed for a program loaded from the compilation cache, which keeps mappings too
    if event == "/jax/core/compile/backend_compile_duration":
        compiles_since_count[0] += 1


jax.monitoring.register_event_duration_secs_listener(count_compile)


@pytest.fixture(autouse=True)
def bounded_memory_mappings():
    yield
    if compiles_since_count[0] < COMPILES_PER_COUNT:
        return
    compiles_since_count[0] = 0
    if mapped_regions() > MAX_MAPPED_REGIONS:
        jax.clear_caches()
        gc.unfreeze()  # the programs may sit in reference cycles frozen below
        gc.collect()
        gc.freeze()


# Python's full garbage collections walk every tracked object: the libraries the tests import
# (torch, transformers, jax) and the caches of traced and compiled programs, which live for
# the whole run (a fifth of the time of a 53-test sample of test_conformance). What is alive once the tests are
# collected, and after each (file, family) run of tests (once their module fixtures are torn
# down), is moved out of the collector's way (gc.freeze) once a full collection has freed the
# garbage among it, so later collections walk only what was made since. Tracing makes objects
# by the million: the youngest generation is collected every 10,000 allocations instead of 700,
# and each older one after 20 collections of the one below instead of 10 (a default-tier run
# on 2026-12-05: 12.8 s of the two workers' time in the collector, against 23.7 s).
def pytest_collection_finish(session):
    gc.set_threshold(10_000, 20, 20)
    gc.collect()
    gc.freeze()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    if nextitem is None or (nextitem.module, family_param(nextitem)) != (item.module, family_param(item)):
        gc.collect()
        gc.freeze()


def torch_or_skip():
    """torch and transformers are test-time references (the ``test`` extra)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return torch, transformers


@pytest.fixture(scope="session")
def rng():
    return np.random.default_rng(0)


FLA_CORE = "fla-core==0.6.0"


@pytest.fixture(scope="session")
def fla_naive(tmp_path_factory):
    """``relative path -> module``: a plain-torch file of the ``fla-core`` wheel, loaded by path
    (never installed or imported as a package: it would replace Hugging Face's CPU paths).
    The wheel comes from the package index (``pip download``, no install); skipped if none."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("einops")
    where = tmp_path_factory.mktemp("fla")
    done = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", FLA_CORE, "-d", str(where)],
                          capture_output=True, text=True, timeout=300)
    wheels = list(where.glob("fla_core-*.whl"))
    if done.returncode or not wheels:
        pytest.skip(f"{FLA_CORE} could not be downloaded: {done.stderr.strip()[-300:]}")

    def load(rel_path: str):
        out = where / Path(rel_path).name
        with zipfile.ZipFile(wheels[0]) as z:
            out.write_bytes(z.read(rel_path))
        spec = importlib.util.spec_from_file_location(f"fla_ref_{out.stem}", out)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    torch.manual_seed(0)
    return load


# Module-scoped fixtures that build (and compile) one tiny model per parameter. With
# ``--dist loadgroup`` all tests of one (file, model) pair run on the same worker, so
# each model is built and compiled once instead of once per worker. Tests of one registered
# family run on one worker whatever their file: the files build the family's tiny model with
# equal configs, and the jitted forwards and operators are cached by config and shapes, so
# the conformance, hooks and export files reuse each other's compiled programs.
MODEL_FIXTURES = ("fam", "pair")

# Two tiers. The default run (``python -m pytest``, the README's test command) holds every
# family's contract (torch parity, exactness against float64, causality, NaN causality, bad
# inputs, hooks, interventions, exports for cuda; tpu for Mamba) and every feature checked at
# least once. ``-m deep`` holds the repeats: the same check on more configurations,
# lengths, variants and families. CI runs both (``.ci/run``).
#
# A family-parametrized test named here runs in the default tier for the given family (or
# families) only, and for the other families in the deep tier.
ONE_FAMILY_BY_DEFAULT = {
    # every family's quick benchmark shape in HF's torch class: the checks are the same per family
    "test_bench_forward.py::test_quick_shape_runs_in_hf_torch_with_our_logits": "zamba",
    "test_conformance.py::test_jit_vmap_and_grad": "mamba",
    # a family without and one with a mixture of experts (which fold a mapped axis into their tokens)
    "test_conformance.py::test_vmap_over_examples_equals_the_batch": ("mamba", "qwen3_next"),
    # the converter's checks are nn.mapping's for every family (each family's wiring: round trip)
    "test_conformance.py::test_converter_errors_name_the_problem": "mamba",
    "test_conformance.py::test_zero_taps_keep_the_logits_and_give_gradients": "recurrent_gemma",
    "test_conformance.py::test_reduce_equals_materialize_for_every_reduction": "mamba2",
    "test_conformance.py::test_low_precision_models_warn_that_operators_are_not_exact": "mamba",
    # one family per half-precision rounding rule: the weight before the cast (Nemotron-H), the
    # LayerNorm's float32 affine (RWKV-4), the rounded embedding scale (RecurrentGemma)
    "test_conformance.py::test_bfloat16_mixer_input_is_torchs_bit_for_bit": ("nemotron_h", "rwkv", "recurrent_gemma"),
    "test_hooks.py::test_pattern_by_name_and_predicates": "mamba",
    "test_hooks.py::test_embedding_gradients_equal_torch": "recurrent_gemma",
    "test_hooks.py::test_knocking_out_every_entry_leaves_the_offset": "mamba2",
    "test_hooks.py::test_patching_a_whole_activation_gives_the_other_inputs_logits": "rwkv",
    "test_explain_families.py::test_references_are_exact": "griffin",
    "test_explain_families.py::test_method_matches_reference": "griffin",
    "test_conformance.py::test_kernels_agree_with_xla": "mamba",
    "test_hooks.py::test_knockout_changes_the_mixer_output_by_minus_h_v": "recurrent_gemma",
    "test_nan.py::test_nan_at_t_leaves_rows_before_t_of_h_and_outputs_unchanged": "mamba2",
    "test_kernels.py::test_materialize_and_reduce_match_xla": "mamba2",
    # the two kernels whose NaN pattern Triton's NaN-skipping max changed on an H200
    "test_nan.py::test_pallas_kernels_keep_nan_where_max_skips_nan": ("mamba", "recurrent_gemma"),
    # the head-matrix cores' and the softmax statistics' XLA steps, a parallel core's parts
    "test_kernels.py::test_kernel_paths_trace_full_float32_products": ("delta", "attention", "falcon_h1"),
    # the edit checks are the LanguageModel base's, the same code for every family
    "test_hooks.py::test_bad_edits_are_named": "mamba",
    "test_testing.py::test_property_every_family_matches_torch": "recurrent_gemma",
    "test_explain_families.py::test_contributions_total_is_first_order_change": "mamba2",
    "test_explain_families.py::test_variant_reaches_every_method": "griffin",
}
# Families whose layer and LM functions are another family's (Falcon-Mamba: Mamba's block with
# a flag; GraniteMoeHybrid and Jamba: Bamba's ``hybrid_functions`` with their own feed-forward
# part; Falcon-H1: Bamba's with its own parallel mixer; Zamba: Zamba2's ``zamba_functions`` with
# its own Mamba mixer; Qwen3.5 and Qwen3.5-MoE: Qwen3-Next's with a flag; Bailing-Hybrid:
# Kimi-Linear's with flags; RWKV-5: RWKV-4's block and LM with its own time mix; LaraMini: Bamba's
# with Qwen3-Next's DeltaNet, LFM3's attention and its own mixture of experts): the checks of that shared forward machinery (hooks, NaN causality, input and tap checks,
# out-of-range ids, causality, forward exports) are repeats for them and run in the deep tier;
# their parity, exactness, float64 reference, checkpoint and info checks stay in the default tier.
BUILT_FROM_OTHERS = ("falcon_mamba", "granitemoehybrid", "jamba", "falcon_h1", "zamba", "qwen3_5_text",
                     "qwen3_5_moe_text", "bailing_hybrid", "rwkv5", "lfm2_moe", "lfm3", "lara_mini")
MACHINERY_TESTS = re.compile(r"test_hooks\.py::\w+|test_nan\.py::\w+"
                             r"|test_conformance\.py::test_(bad_inputs_fail_with_named_errors|bad_taps"
                             r"|out_of_range_ids_under_jit_give_nan_logits"
                             r"|outputs_before_t_do_not_depend_on_inputs_after_t)"
                             r"|test_export_library\.py::test_forward_exports")
# Files whose ``pair`` fixture runs over a ``CONFIGS`` dict: the first configuration is in
# the default tier, the others are deep.
FIRST_CONFIG_BY_DEFAULT = ("test_mamba.py", "test_mamba2.py", "test_griffin.py", "test_rwkv.py")
# Single deep items (a node-id regex after the file name) and why they are only repeats.
DEEP = {
    # README: the full pass on Mamba and the Quickstart on Bamba (a hybrid) by default; the
    # Griffin full pass and the other families' Quickstart repeat them.
    "test_readme.py": r"test_readme_blocks_run\[(recurrent_gemma|mamba2|rwkv|falcon_mamba|granitemoehybrid|jamba|nemotron_h|falcon_h1|zamba|zamba2|qwen3_next|qwen3_5_text|qwen3_5_moe_text|olmo_hybrid|lara_mini|kimi_linear|bailing_hybrid|minimax|rwkv5|rwkv6|rwkv7|lfm2|lfm2_moe|lfm3|xlstm)\]",
    # The hybrids' released layouts scaled down: the conformance contract again, on a second
    # configuration of each (the per-file checks of what is specific stay in the default tier).
    "test_bamba.py": r"test_released_layout_matches_torch_and_is_exact",
    "test_granite.py": r"test_released_layout_matches_torch_and_is_exact|test_dense_model_with_rope_matches_torch",
    "test_jamba.py": r"test_released_layout_matches_torch_and_is_exact",
    # (the clamp's effect and the other Mamba norm settings are also drawn by the property tests)
    "test_nemotron_h.py": r"test_released_layout_matches_torch_and_is_exact\[\w+\]|test_parity_sees_the_dt_clamp",
    # (the untied form is also drawn by the property tests)
    "test_zamba2.py": (r"test_released_layout_matches_torch_and_is_exact|test_untied_model_has_a_block_per_hybrid_layer"
                       r"|test_tie_cycle_matches_torch_and_uses_the_right_block"),
    # the delta rule: the recurrence check at write strengths up to 2 and near 2, the long
    # input and the cuda export by default (HF's kernel: Qwen3-Next's parity test by default)
    # (KDA: the per-dimension recurrence at small and near-2 strengths and Kimi-Linear's parity by default)
    "test_delta_rule.py": (r"test_chunk_length_changes_only_rounding|test_matches_hf_qwen3_next_chunked_kernel"
                           r"|test_matches_hf_kimi_chunked_kernel|test_per_dimension_decays_equal_the_float64_recurrence"
                           r"\[no_erasure\]"
                           r"|test_outputs_and_matrix_equal_the_float64_recurrence\[(small|near_0)\]"
                           r"|test_long_input_is_finite_and_exact\[per_key_dim\]"
                           r"|test_materialize_exports_for_accelerators\[tpu-\w+\]"),
    "test_zamba.py": r"test_released_layout_matches_torch_and_is_exact",
    # the parallel core's gradient is each part's kernel's (their own gradient tests) composed by JAX
    "test_kernels.py": r"test_a_parallel_core_reduce_differentiates_like_xla",
    # the chunked forwards under a huge input, traced eagerly (5-15 s each): the two once found to
    # carry it into earlier rows (Mamba-2's SSD, DPLR) by default
    "test_nan.py": r"test_overflowing_input_keeps_the_chunked_forwards_causal\[(mamba|qwen3_next|xlstm|rwkv)\]",
    # xLSTM: the gate cap and biases are also drawn by the property tests; the long operator's float64
    # check repeats the conformance one at a longer length
    "test_xlstm.py": r"test_soft_caps\[caps1\]|test_biases_everywhere_but_the_output_norm|test_long_operator_equals",
    "test_qwen3_next.py": r"test_released_layout_matches_torch_and_is_exact",
    "test_qwen3_5.py": r"test_moe_layout_matches_torch_where_hf_ignores_the_layer_rules",
    "test_olmo_hybrid.py": r"test_released_layout_matches_torch_and_is_exact",
    "test_lara_mini.py": r"test_released_layout_matches_torch_and_is_exact",
    # the kernel and its derivatives are the same for every DeltaNet layout; LaraMini's fused
    # projections run through the kernel in its conformance parity test (the tests' size threshold is 0)
    "test_delta_net_kernel.py": r"test_delta_forward_takes_the_kernel_on_cpu_and_differentiates_through_xla\[lara_mini\]",
    "test_kimi_linear.py": r"test_released_layout_matches_torch_and_is_exact",
    # (both gates: the bounded one is the tiny model's in the conformance suite, the unbounded one
    # Kimi-Linear's, whose block Bailing-Hybrid reuses)
    "test_bailing_hybrid.py": r"test_released_layout_matches_torch_and_is_exact\[\w+\]",
    # MiniMax: HF's block-wise lightning attention at one block length by default, HF's slope
    # buffers for one and for 80 layers (the released depth) by default; the long input repeats
    # the block checks at HF's default block length
    "test_minimax.py": (r"test_lightning_matches_hf_blocks_at_every_length\[(1|5)\]"
                        r"|test_slopes_are_hf_buffers\[(4-3|6-5|3-2)\]|test_other_configs_match_torch\[hf_default_layers\]"
                        r"|test_long_input_past_hf_default_block_is_finite_and_exact"),
    # (the parallel core's channel layout is also checked by Zamba's heads test)
    "test_falcon_h1.py": r"test_released_layout_matches_torch_and_is_exact|test_layer_operator_holds_both_paths"
                         r"|test_mamba_output_norm_settings_match_torch\[\w+\]",
    # CPU kernel: every variant at L = 37 and the full variant at every length by default.
    "test_cpu_kernel.py": (r"test_materialize_matches_xla\[(?!full)\w+-(1|16)\]"
                           r"|test_griffin_matches_xla\[(?!full)\w+-1\]|test_griffin_matches_xla\[\w+-100\]"
                           r"|test_fused_reduce_matches_xla\[\w+-(abs_mean|pos_mean)\]"
                           r"|test_bare_cores_every_optional_factor\[parts[23]\]"
                           r"|test_fused_reduce_gradients_match_xla"),  # materialize's gradient is kept
    # float64 rows at long length: RWKV (large keys) and the delta rule by default.
    "test_mamba.py": r"test_long_input_rows_match_float64",
    "test_mamba2.py": r"test_long_input_rows_match_float64",
    "test_griffin.py": r"test_long_input_rows_match_float64|test_rglru_parallel_and_sequential_scans_agree",
    "test_ops.py": r"test_state_decay_kernel_matches_brute_force\[(7-16|48-16)\]",
    # exports: every family for cuda, Mamba for tpu (the lowering differs by platform, not
    # by family); a given target next to argmax once.
    # The explain pieces export the same way for every family's operators: Mamba and Bamba
    # (recurrent and attention layers) by default.
    "test_export_library.py": (r"test_(forward_exports|operators_export|explain_maps_export|explain_methods_export)"
                               r"\[(?!mamba-)[\w-]+-tpu\]"
                               # Falcon-Mamba's, Granite's, Jamba's, Nemotron-H's and the Zambas'
                               # operators are built of Mamba's, Mamba-2's and attention cores,
                               # exported by default (ParallelCore: Falcon-H1's export, by default;
                               # the delta rule: test_delta_rule's cuda export)
                               # (DplrCore: RWKV-7's export by default, RWKV-6's is the same core)
                               r"|test_operators_export\[(falcon_mamba|granitemoehybrid|jamba|nemotron_h|zamba|zamba2|qwen3_next|qwen3_5_\w+|olmo_hybrid|lara_mini|kimi_linear|bailing_hybrid|minimax|rwkv5|rwkv6|lfm2_moe|lfm3)-cuda\]"
                               r"|test_explain_methods_export\[(?!mamba-)[\w-]+-given-\w+\]"
                               r"|test_explain_(maps|methods)_export\[(?!mamba-|bamba-)[\w-]+\]"),
}


def family_param(item) -> str | None:
    spec = getattr(item, "callspec", None)
    if spec is None:
        return None
    for name in MODEL_FIXTURES + ("model_type", "family", "name"):
        if name in spec.params:
            value = spec.params[name]
            return str(getattr(value, "model_type", value))
    return None


def is_deep(item) -> bool:
    file = item.path.name
    name = item.name
    base = f"{file}::{item.originalname}"
    if MACHINERY_TESTS.fullmatch(base) and family_param(item) in BUILT_FROM_OTHERS:
        return True
    if base in ONE_FAMILY_BY_DEFAULT:
        fam = family_param(item)
        default = ONE_FAMILY_BY_DEFAULT[base]
        return fam is not None and fam not in ((default,) if isinstance(default, str) else default)
    if file in FIRST_CONFIG_BY_DEFAULT:
        spec = getattr(item, "callspec", None)
        if spec is not None and "pair" in spec.params:
            return spec.params["pair"] != next(iter(item.module.CONFIGS))
    pattern = DEEP.get(file)
    return pattern is not None and re.fullmatch(pattern, name) is not None


def pytest_configure(config):
    config.addinivalue_line("markers", "deep: a repeat of a default-tier check (run with -m deep)")


@pytest.hookimpl(tryfirst=True)  # before xdist's worker hook reads the groups into node ids
def pytest_collection_modifyitems(config, items):
    for item in items:
        if is_deep(item):
            item.add_marker(pytest.mark.deep)
    if not config.pluginmanager.hasplugin("xdist"):
        return
    # imported here, not at the top: the xdist controller loads this file but never collects,
    # and the library's import (1.4 s) would delay the start of every worker
    from implicit_attn.registry import FAMILIES

    for item in items:
        item.add_marker(pytest.mark.xdist_group(xdist_group(item, FAMILIES)))


def xdist_group(item, families) -> str:
    """The ``--dist loadgroup`` group of a test: ``family:<model_type>`` for a test
    parametrized by a registered family (whatever its file), unless its module sets
    ``ONE_WORKER = True`` (a module fixture that builds every kernel core, which a family group
    would build a second time on another worker); else its module's name, with
    ``:<param>`` for each model fixture parameter. xdist reads a group from the node id
    (``<id>@<group>``) only when no ``]`` follows the ``@``, so a name holds no brackets:
    with them every test became its own group and each worker built every model again."""
    fam = family_param(item)
    if fam in families and not getattr(item.module, "ONE_WORKER", False):
        group = f"family:{fam}"
    else:
        group = item.module.__name__
        spec = getattr(item, "callspec", None)
        for name in MODEL_FIXTURES:
            if spec is not None and name in spec.params:
                value = spec.params[name]
                group += f":{getattr(value, 'model_type', value)}"
    if set(group) & set("[]@"):
        raise pytest.UsageError(f"xdist group {group!r} of {item.nodeid} holds '[', ']' or '@'")
    return group
