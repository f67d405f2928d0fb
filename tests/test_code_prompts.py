"""Code training prompts from Python sources: which functions qualify, the request styles, exclusions."""

from __future__ import annotations

from pathlib import Path

from dflash.training.code_prompts import code_prompts, functions_in_source, prompt_for

SOURCE = '''
import os


def join_paths(first: str, *rest: str) -> str:
    """Join path pieces with the platform separator, skipping empty pieces entirely."""
    pieces = [first, *[r for r in rest if r]]
    return os.sep.join(pieces)


def _private(x):
    """A private helper with a long enough docstring to qualify otherwise."""
    y = x
    return y


def short_doc(x):
    """Too short."""
    return x


class Box:
    def volume(self, scale=1.0):
        """Volume of the box in cubic units, multiplied by the given scale factor."""
        total = self.w * self.h * self.d
        return total * scale
'''


def test_public_documented_functions_and_methods_qualify() -> None:
    found = {fn.name: fn for fn in functions_in_source(SOURCE)}
    assert sorted(found) == ["join_paths", "volume"]
    method = found["volume"]
    assert method.signature == "def volume(self, scale=1.0):"
    assert method.source.startswith("def volume(self, scale=1.0):\n    \"\"\"Volume")  # dedented out of the class
    assert found["join_paths"].signature == "def join_paths(first: str, *rest: str) -> str:"


def test_prompts_name_the_function_and_are_stable(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(SOURCE)
    (tmp_path / "pkg" / "broken.py").write_text("def (:\n")  # unparsable files are skipped
    prompts = code_prompts([tmp_path], exclude_names=set())
    assert len(prompts) == 2 and prompts == code_prompts([tmp_path], exclude_names=set())
    assert any("join_paths" in p for p in prompts) and any("volume" in p for p in prompts)
    assert code_prompts([tmp_path], exclude_names={"volume"}) == [p for p in prompts if "volume" not in p]
    for fn in functions_in_source(SOURCE):
        assert fn.name in prompt_for(fn)
