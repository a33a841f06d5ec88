"""The engine: KV-cache manager, scheduler, model runner, sampler and the offline/async APIs.

`LLM`, `SamplingParams` and `LoRARequest` import lazily, so the scheduler and cache stay usable
without torch.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagefleet.engine.llm import LLM
    from pagefleet.engine.lora.request import LoRARequest
    from pagefleet.engine.sampling_params import SamplingParams

__all__ = ["LLM", "LoRARequest", "SamplingParams"]


def __getattr__(name: str):
    if name == "LLM":
        from pagefleet.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from pagefleet.engine.sampling_params import SamplingParams

        return SamplingParams
    if name == "LoRARequest":
        from pagefleet.engine.lora.request import LoRARequest

        return LoRARequest
    raise AttributeError(name)
