"""transformers baselines on the same weights: `generate()` and its prompt-lookup decoding."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dflash.errors import DFlashError
from dflash.models.resolve import resolve_model_path


def load_transformers_model(model_arg: str, device: torch.device, dtype: torch.dtype) -> Any:
    try:
        import transformers
    except ImportError:
        raise DFlashError("the transformers baseline needs `pip install transformers`") from None
    path = resolve_model_path(model_arg)
    if path.suffix == ".gguf":
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(Path(path)), dtype=dtype)
    loaded: Any = model
    return loaded.to(device).eval()


@torch.inference_mode()
def transformers_generate(model: Any, prompt_ids: list[int], max_tokens: int, eos_ids: tuple[int, ...],
                          prompt_lookup: bool = False) -> int:
    """Greedy generation; returns the number of new tokens."""
    ids = torch.tensor([prompt_ids], device=model.device)
    kwargs: dict[str, Any] = {"prompt_lookup_num_tokens": 10} if prompt_lookup else {}
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
        eos_token_id=list(eos_ids), pad_token_id=eos_ids[0] if eos_ids else 0, **kwargs,
    )
    return int(out.shape[1] - ids.shape[1])
