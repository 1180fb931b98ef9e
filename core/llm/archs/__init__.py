"""The registry of architectures: `general.architecture` -> its Arch (core/llm/archs/base.py).
Adding a family is one module beside this one and one line here."""
from __future__ import annotations

from ggrun.core.errors import BadInput
from ggrun.core.llm.archs.base import Arch
from ggrun.core.llm.archs.gemma2 import Gemma2
from ggrun.core.llm.archs.gemma3 import Gemma3
from ggrun.core.llm.archs.gpt_oss import GptOss
from ggrun.core.llm.archs.llama import Llama
from ggrun.core.llm.archs.phi3 import Phi3
from ggrun.core.llm.archs.qwen2 import Qwen2
from ggrun.core.llm.archs.qwen3 import Qwen3
from ggrun.core.llm.archs.qwen3moe import Qwen3Moe

ARCHS: dict[str, Arch] = {a.name: a for a in (
    Llama(),
    Gemma3(),
    Qwen2(),
    Qwen3(),
    Gemma2(),
    Phi3(),
    Qwen3Moe(),
    GptOss(),
)}


def arch_for(name: str, source: str) -> Arch:
    """The architecture named `name`, or BadInput naming it and the ones ggrun knows."""
    if name not in ARCHS:
        raise BadInput(f"{source}: architecture '{name}' is not supported (supported: {', '.join(ARCHS)})")
    return ARCHS[name]
