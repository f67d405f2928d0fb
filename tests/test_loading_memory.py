"""What loading leaves resident: models built on the meta device materialise without torch's compiler stack, and
the heap loading freed goes back to the operating system."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from dflash.engine.heap import return_free_heap
from dflash.models.layers import embedding
from dflash.models.materialize import materialize
from dflash.models.rope import Rotary, rope_inverse_frequencies
from tests.loading_helpers import smollm2_path

SRC = str(Path(__file__).resolve().parents[1] / "src")


def run_python(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                            env={"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"}, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip().splitlines()[-1]


def test_materialize_gives_storage_to_meta_tensors_only() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3), nn.Linear(3, 4))
    model[2].weight = nn.Parameter(torch.ones(4, 3))  # already real: kept
    model.register_buffer("table", torch.empty(5, device="meta", dtype=torch.float16))
    tied = nn.Module()
    with torch.device("meta"):
        tied.a = nn.Linear(2, 2, bias=False)
        tied.b = nn.Linear(2, 2, bias=False)
    tied.b.weight = tied.a.weight
    assert materialize(model, "cpu") is model
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert model[0].weight.shape == (3, 4) and model[0].weight.requires_grad
    assert model.table.dtype == torch.float16 and model.table.shape == (5,)
    assert torch.equal(model[2].weight, torch.ones(4, 3))
    materialize(tied, "cpu")
    assert tied.a.weight is tied.b.weight and not tied.a.weight.is_meta
    with torch.device("meta"):
        outer = nn.Sequential(nn.Linear(2, 2))
    materialize(outer, "cpu", recurse=False)  # the container owns nothing itself
    assert outer[0].weight.is_meta


def test_embedding_draws_its_table_except_on_meta() -> None:
    torch.manual_seed(0)
    table = embedding(1000, 64)
    weights = table.weight.detach()
    assert abs(float(weights.std()) - 1.0) < 0.02 and abs(float(weights.mean())) < 0.02
    with torch.device("meta"):
        assert embedding(10, 4).weight.is_meta


def test_rotary_frequencies_are_computed_on_the_cpu() -> None:
    expected = 1.0 / (10000.0 ** (torch.arange(0, 64, 2).float() / 64))
    torch.testing.assert_close(rope_inverse_frequencies(64, 10000.0, None), expected, rtol=0, atol=0)
    with torch.device("meta"):
        rotary = Rotary(64, 10000.0)
    assert rotary.inv_freq.is_meta  # on the model's device until `recompute`
    materialize(rotary, "cpu")
    rotary.recompute()
    torch.testing.assert_close(rotary.inv_freq, expected, rtol=0, atol=0)


def test_loading_the_default_model_leaves_the_compiler_stack_unloaded() -> None:
    """torch evaluates meta tensors' random draws, RoPE tables and empty_like through its reference ops, which
    import torch._dynamo (about 140 MiB resident) and sympy; loading builds its models on the meta device."""
    try:
        smollm2_path()
    except Exception as exc:  # the data package is not installed
        pytest.skip(str(exc))
    loaded = run_python("""
        import sys
        from dflash.engine.loading import load_engine
        load_engine("default", "none")
        print(sorted(m for m in ("torch._dynamo", "sympy", "torch.fx.experimental.symbolic_shapes") if m in sys.modules))
    """)
    assert loaded == "[]"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_freed_heap_goes_back_to_the_system() -> None:
    """Small allocations freed leave their pages in glibc's heap until `return_free_heap`."""
    assert isinstance(return_free_heap(), bool)
    dropped = run_python("""
        from dflash.engine.heap import return_free_heap

        def anonymous_mib():
            for line in open("/proc/self/status"):
                if line.startswith("RssAnon"):
                    return int(line.split()[1]) // 1024
        keep = []
        chunks = [bytearray(512) for _ in range(300_000)]  # about 170 MiB of small heap allocations
        keep.append(chunks[-1])  # the heap's top stays in use: only a trim releases the pages below it
        del chunks
        before = anonymous_mib()
        assert return_free_heap()
        print(before - anonymous_mib())
    """)
    assert int(dropped) > 100


def test_released_tensor_pages_read_back_the_same_bytes() -> None:
    """`GGUFFile.release` drops a tensor's pages from the process; its bytes are read back intact (from the page
    cache), and a neighbour sharing a page with it is untouched."""
    from dflash.models.gguf_file import GGUFFile

    try:
        path = smollm2_path()
    except Exception as exc:  # the data package is not installed
        pytest.skip(str(exc))
    gguf = GGUFFile(path)
    infos = sorted(gguf.tensors.values(), key=lambda info: info.offset)[:6]
    copies = [bytes(gguf.raw(info).tobytes()) for info in infos]
    for info in infos[::2]:
        gguf.release(info)
    assert [bytes(gguf.raw(info).tobytes()) for info in infos] == copies
