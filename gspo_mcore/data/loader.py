"""Dataset + sampler + template: the next batch of tokenised prompts, resumable."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gspo_mcore.data.dataset import PromptDataset, PromptSample
from gspo_mcore.data.sampler import PromptSampler
from gspo_mcore.data.template import PromptTemplate


@dataclass(frozen=True)
class PromptItem:
    index: int
    """Position of the sample in the dataset."""
    input_ids: list[int]
    sample: PromptSample
    """Its prompt / messages and the metadata the reward needs."""


class PromptLoader:
    def __init__(self, dataset: PromptDataset, sampler: PromptSampler, template: PromptTemplate):
        if sampler.num_samples != len(dataset):
            raise ValueError(f"sampler covers {sampler.num_samples} samples, the dataset has {len(dataset)}")
        self.dataset, self.sampler, self.template = dataset, sampler, template

    def next_batch(self, n: int) -> list[PromptItem]:
        """The next ``n`` prompts (fewer, possibly none, only when the last epoch runs out)."""
        return [PromptItem(i, self.template.encode(self.dataset[i]), self.dataset[i]) for i in self.sampler.take(n)]

    def state_dict(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])
