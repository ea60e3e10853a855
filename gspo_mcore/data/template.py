"""Prompt -> token ids with the model's own Hugging Face tokenizer and chat template (local files only).

A chat sample is rendered with the tokenizer's chat template (an error if it has none). A prompt-string
sample is wrapped as one user turn (after ``system_prompt``, if set) when the tokenizer has a template
and ``use_chat_template`` is on; otherwise it is tokenised as plain text.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from gspo_mcore.data.dataset import PromptSample


@dataclass(frozen=True, kw_only=True)
class TemplateConfig:
    tokenizer_dir: str = ""
    """Local directory with the tokenizer files (``tokenizer.json``, ``tokenizer_config.json``, ...);
    empty: the trainer uses the model's directory."""
    use_chat_template: bool = True
    """Wrap prompt strings in the chat template when the tokenizer has one."""
    add_generation_prompt: bool = True
    """End with the assistant-turn header, so generation starts the reply."""
    system_prompt: str | None = None
    """Prepended as a system turn to prompt strings (and to chats that have none)."""
    add_special_tokens: bool = True
    """For plain-text prompts only (BOS etc.); a chat template writes its own special tokens."""

    def __post_init__(self):
        object.__setattr__(self, "tokenizer_dir", os.fspath(self.tokenizer_dir))


def load_tokenizer(tokenizer_dir: str) -> Any:
    """``AutoTokenizer`` from a local directory; never touches the network."""
    if not os.path.isdir(tokenizer_dir):
        raise FileNotFoundError(f"tokenizer directory not found: {tokenizer_dir}")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)


class PromptTemplate:
    """``encode(sample) -> list[int]`` and ``render(sample) -> str`` for one tokenizer."""

    def __init__(self, config: TemplateConfig, tokenizer: Any | None = None):
        self.config = config
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.tokenizer_dir)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def messages(self, sample: PromptSample) -> list[dict[str, str]] | None:
        """The chat to render, or None when the sample is tokenised as plain text."""
        system = [{"role": "system", "content": self.config.system_prompt}] if self.config.system_prompt else []
        if sample.messages is not None:
            chat = [dict(m) for m in sample.messages]
            if system and chat[0]["role"] != "system":
                chat = system + chat
            if not self.has_chat_template:
                raise ValueError(
                    f"{sample.source}: a chat sample needs a chat template, and the tokenizer in "
                    f"{self.config.tokenizer_dir} has none"
                )
            return chat
        if self.config.use_chat_template and self.has_chat_template:
            return system + [{"role": "user", "content": sample.prompt}]
        return None

    def render(self, sample: PromptSample) -> str:
        return self._render(sample, self.messages(sample))

    def encode(self, sample: PromptSample) -> list[int]:
        chat = self.messages(sample)
        special = self.config.add_special_tokens if chat is None else False
        return list(self.tokenizer(self._render(sample, chat), add_special_tokens=special)["input_ids"])

    def _render(self, sample: PromptSample, chat: list[dict[str, str]] | None) -> str:
        if chat is None:
            return sample.prompt
        return self.tokenizer.apply_chat_template(
            chat, tokenize=False, add_generation_prompt=self.config.add_generation_prompt
        )
