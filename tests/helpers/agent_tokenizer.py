"""A tiny character-level BPE tokenizer with a ChatML chat template (tools optional), built locally.

One merge, ``a b -> ab``: sampling ``a`` then ``b`` gives ids that re-tokenising the text changes (to the
single ``ab`` id), the token drift of re-tokenised conversations.
"""

from __future__ import annotations

CHATML_TOOLS = (
    "{%- if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n{% endif %}"
    "Tools:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{%- for m in messages %}{% if not (tools and loop.first and m.role == 'system') %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHATML = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<unk>", "<|im_end|>", "<|im_start|>"]


def make_tokenizer(chat_template: str | None = CHATML_TOOLS):
    """The tokenizer (a ``PreTrainedTokenizerFast``); ``<|im_end|>`` is its EOS (id 1)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {t: i for i, t in enumerate(SPECIALS + chars + ["ab"])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    kwargs = {"chat_template": chat_template} if chat_template else {}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", unk_token="<unk>", **kwargs)
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    return fast
