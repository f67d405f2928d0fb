"""The `DFLASH_*` variables (`dflash.environment`): defaults, parsing by meaning, refusals, and the provenance list
that never carries the API key."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import pytest

from dflash import environment
from dflash.errors import DFlashError


def test_defaults_where_nothing_is_set() -> None:
    assert environment.cache_dir({}) is None
    assert environment.gguf_cache_enabled({})
    assert environment.cpu_layer_ops_enabled({})
    assert environment.cpu_native_layers_enabled({})
    assert environment.cpu_kernel_flags({}) == ()
    assert environment.batch_overlap_enabled({})
    assert environment.fla_enabled({})
    assert environment.attention({}) == "split"
    assert environment.padded_attention({}) == "paged"
    assert environment.products({}) == "skinny"
    assert environment.api_key({}) is None
    assert environment.llama_bench({}) is None


def test_values_are_read_by_meaning() -> None:
    assert environment.cache_dir({environment.CACHE_DIR: "~/x"}) == Path("~/x").expanduser()
    assert environment.cache_dir({environment.CACHE_DIR: ""}) is None
    assert not environment.gguf_cache_enabled({environment.NO_CACHE: " Yes "})
    assert environment.gguf_cache_enabled({environment.NO_CACHE: "0"})
    assert not environment.cpu_layer_ops_enabled({environment.CPU_LAYER_OPS: "OFF"})
    assert not environment.cpu_native_layers_enabled({environment.CPU_NATIVE_LAYERS: "0"})
    assert environment.cpu_kernel_flags({environment.CPU_KERNEL_FLAGS: " -mno-avx512f  -mno-amx-tile "}) == (
        "-mno-avx512f", "-mno-amx-tile")
    assert not environment.batch_overlap_enabled({environment.BATCH_OVERLAP: "0"})
    assert not environment.fla_enabled({environment.FLA: " no "})
    assert environment.attention({environment.ATTENTION: "sdpa"}) == "sdpa"
    assert environment.padded_attention({environment.PADDED_ATTENTION: "gather"}) == "gather"
    assert environment.products({environment.PRODUCTS: "cublas"}) == "cublas"
    assert environment.api_key({environment.API_KEY: "   "}) is None
    assert environment.api_key({environment.API_KEY: " k "}) == " k "  # checked and stripped by its caller
    bench = Path("~/bin/llama-bench")
    assert environment.llama_bench({environment.LLAMA_BENCH: f" {bench} "}) == bench.expanduser()
    assert environment.llama_bench({environment.LLAMA_BENCH: "  "}) is None


@pytest.mark.parametrize(("read", "name"), [(environment.attention, environment.ATTENTION),
                                            (environment.padded_attention, environment.PADDED_ATTENTION),
                                            (environment.products, environment.PRODUCTS)])
def test_an_unknown_kernel_choice_is_refused(read: Callable[[Mapping[str, str]], str], name: str) -> None:
    with pytest.raises(ValueError, match=f"{name} must be"):
        read({name: "fastest"})


def test_switches_and_counts() -> None:
    assert environment.env_flag({"F": "on"}, "F") and not environment.env_flag({}, "F")
    assert environment.env_count({"N": "12"}, "N") == 12 and environment.env_count({"N": "off"}, "N") == 0
    with pytest.raises(DFlashError, match="F='maybe'"):
        environment.env_flag({"F": "maybe"}, "F")
    with pytest.raises(DFlashError, match="must not be negative"):
        environment.env_count({"N": "-1"}, "N")


def test_reads_the_process_environment_when_called(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(environment.PRODUCTS, "cublas")
    assert environment.products() == "cublas"
    monkeypatch.delenv(environment.PRODUCTS)
    assert environment.products() == "skinny"


def test_provenance_lists_the_variables_set_without_the_key() -> None:
    env = {environment.API_KEY: "secret", environment.ATTENTION: "sdpa", "HOME": "/home/x"}
    assert environment.variables_set(env) == {environment.API_KEY: "<set>", environment.ATTENTION: "sdpa"}
