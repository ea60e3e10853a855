"""Prompt datasets (JSONL / Parquet), seeded resumable sampling, and chat-template tokenisation."""

from gspo_mcore.data.dataset import DataConfig, MalformedRowError, PromptDataset, PromptSample
from gspo_mcore.data.loader import PromptItem, PromptLoader
from gspo_mcore.data.sampler import PromptSampler, SamplerConfig
from gspo_mcore.data.template import PromptTemplate, TemplateConfig, load_tokenizer

__all__ = [
    "DataConfig",
    "MalformedRowError",
    "PromptDataset",
    "PromptItem",
    "PromptLoader",
    "PromptSample",
    "PromptSampler",
    "PromptTemplate",
    "SamplerConfig",
    "TemplateConfig",
    "load_tokenizer",
]
