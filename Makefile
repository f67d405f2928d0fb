# Set-up and everyday commands. Everything installs into a project-local virtual environment.
# On a machine without torch the CPU build torch==2.13.0 is pinned; where torch is already
# installed system-wide (GPU machines) the venv sees it and keeps it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install run serve chat test test-fast test-kernels lint bench clean

$(STAMP): pyproject.toml Makefile scripts/install.sh clients/package-lock.json
	PYTHON=$(PYTHON) VENV=$(VENV) sh scripts/install.sh
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/dflash serve

serve: run

chat: $(STAMP)
	$(VENV)/bin/dflash chat

# The Triton kernels' tests run in a pass of their own: without a GPU, under Triton's CPU interpreter
# (TRITON_INTERPRET=1), which must stay off for the rest of the suite, whose fast paths it would slow to a crawl.
# Only the fused end-to-end generations (test_fastpath.py::test_generation_with_fused_layers_equals_eager, marked
# gpu, about 5 minutes each when interpreted) are left to GPU runs.
TRITON_TESTS := tests/test_triton_argmax.py tests/test_triton_attention.py tests/test_triton_skinny.py \
	tests/test_triton_paged_attention.py tests/test_padded_paged_attention.py \
	tests/test_triton_rank_sums.py tests/test_triton_gguf_int8.py \
	tests/test_triton_gguf_matmul.py tests/test_gpu_quantized_model.py \
	tests/test_kv_move.py tests/test_batched_tree_kernels.py tests/test_device_tree.py tests/test_fused_padded_drafter.py tests/test_triton_delta_rule.py \
	tests/test_fused_hybrid.py tests/test_triton_experts.py \
	tests/test_gguf_hybrid_quantized.py::test_quantized_hybrid_on_the_gpu_programs \
	tests/test_gguf_hybrid_quantized.py::test_fused_runner_serves_a_quantized_hybrid \
	tests/test_fastpath.py::test_fused_layers_match_the_static_forward \
	tests/test_fastpath.py::test_fused_drafter_round_matches_the_static_round
# The other pass leaves them out: whole files ignored, single tests deselected.
NOT_TRITON := $(foreach t,$(TRITON_TESTS),$(if $(findstring ::,$(t)),--deselect $(t),--ignore $(t)))
INTERPRET = $$($(PY) -c 'import torch; print(int(not torch.cuda.is_available()))')
# Left out of test-fast: the quantized real model's generations, the multi-process ranks, the agent benchmark.
HEAVY := tests/test_quantized_smollm2.py tests/test_tensor_parallel.py tests/test_tensor_parallel_cli.py \
	tests/test_agent_loop_bench.py

test: $(STAMP)
	$(PY) -m pytest -q tests $(NOT_TRITON)
	TRITON_INTERPRET=$(INTERPRET) $(PY) -m pytest -q $(TRITON_TESTS)

# About 4 minutes on two cores: no slow-marked test, no HEAVY file, no kernel pass (`make test` runs them all).
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" tests $(NOT_TRITON) $(addprefix --ignore ,$(HEAVY))

test-kernels: $(STAMP)
	TRITON_INTERPRET=$(INTERPRET) $(PY) -m pytest -q $(TRITON_TESTS)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks scripts
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) build *.egg-info clients/node_modules
