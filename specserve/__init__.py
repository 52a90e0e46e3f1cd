"""specserve: LLM inference and serving built around EAGLE speculative decoding under CUDA graphs."""
from specserve.errors import ConfigError, InvalidRequestError, ModelLoadError, SpecserveError
from specserve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "SpecserveError", "InvalidRequestError", "ConfigError", "ModelLoadError"]


def __getattr__(name):
    # Importing the engine pulls in torch and transformers; only do it when LLM is used.
    if name == "LLM":
        from specserve.llm import LLM

        return LLM
    raise AttributeError(name)
