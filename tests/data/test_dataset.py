"""Prompt datasets: loading, validation errors, seeded resumable sampling, chat templates."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gspo_mcore.data import (
    DataConfig,
    MalformedRowError,
    PromptDataset,
    PromptLoader,
    PromptSampler,
    PromptTemplate,
    SamplerConfig,
    TemplateConfig,
)

ROWS = [
    {"prompt": "What is 1 + 1?", "answer": "2"},
    {
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Add 2 and 3."}],
        "answer": "5",
    },
    {"prompt": "Write add(a, b).", "tests": ["assert add(1, 2) == 3"], "reward_fn": "code"},
]


def write_jsonl(path, rows, raw_lines=()):
    lines = [json.dumps(r) for r in rows] + list(raw_lines)
    path.write_text("\n".join(lines) + "\n")
    return path


# ------------------------------------------------------------------------------------------- loading


def test_jsonl_prompts_messages_and_metadata(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", ROWS)
    ds = PromptDataset(DataConfig(paths=(str(path),)))
    assert len(ds) == 3 and ds.num_skipped == 0
    assert ds[0].prompt == "What is 1 + 1?" and ds[0].messages is None and dict(ds[0].metadata) == {"answer": "2"}
    assert ds[1].prompt is None and [m["role"] for m in ds[1].messages] == ["system", "user"]
    assert ds[2].metadata["tests"] == ["assert add(1, 2) == 3"] and ds[2].metadata["reward_fn"] == "code"
    assert ds[1].source == f"{path}:2"
    with pytest.raises(TypeError):
        ds[0].metadata["answer"] = "3"  # read-only


def test_parquet_and_several_files(tmp_path):
    pq_path = tmp_path / "train.parquet"
    table = pa.Table.from_pylist(
        [
            {"prompt": None, "messages": [{"role": "user", "content": "Hi"}], "answer": "1", "tests": None},
            {"prompt": "Plain", "messages": None, "answer": None, "tests": ["assert True"]},
        ]
    )
    pq.write_table(table, pq_path)
    jsonl = write_jsonl(tmp_path / "more.jsonl", ROWS[:1])
    ds = PromptDataset(DataConfig(paths=(str(pq_path), str(jsonl))))
    assert len(ds) == 3
    assert ds[0].messages[0]["content"] == "Hi" and ds[0].metadata["answer"] == "1"
    assert ds[1].prompt == "Plain" and ds[1].metadata["tests"] == ["assert True"]
    assert ds[1].source == f"{pq_path} row 2"
    assert ds[2].prompt == "What is 1 + 1?"


def test_chat_under_the_prompt_key_counts_as_messages(tmp_path):
    path = write_jsonl(tmp_path / "verl.jsonl", [{"prompt": [{"role": "user", "content": "Hi"}], "answer": "x"}])
    ds = PromptDataset(DataConfig(paths=(str(path),)))
    assert ds[0].prompt is None and ds[0].messages[0]["content"] == "Hi"


# -------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "bad_line, reason",
    [
        ('{"prompt": "unterminated', "invalid JSON"),
        ('["a", "list"]', "expected an object"),
        ('{"answer": "2"}', "missing 'prompt'"),
        ('{"prompt": ""}', "non-empty string"),
        ('{"prompt": 7}', "non-empty string"),
        ('{"messages": []}', "non-empty list"),
        ('{"messages": [{"role": "wizard", "content": "hi"}]}', "role must be one of"),
        ('{"messages": [{"role": "user", "content": 3}]}', "content must be a string"),
        ('{"prompt": "a", "messages": [{"role": "user", "content": "b"}]}', "has both"),
    ],
)
def test_malformed_row_error_names_file_and_line(tmp_path, bad_line, reason):
    path = write_jsonl(tmp_path / "bad.jsonl", ROWS[:2], raw_lines=["", bad_line, json.dumps(ROWS[0])])
    with pytest.raises(MalformedRowError, match=reason) as info:
        PromptDataset(DataConfig(paths=(str(path),)))
    assert info.value.path == str(path) and info.value.line == 4  # the blank line 3 is skipped, not malformed
    assert str(info.value).startswith(f"{path}:4: ")


def test_malformed_rows_skipped_and_counted(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", ROWS, raw_lines=["{oops", '{"answer": 1}'])
    ds = PromptDataset(DataConfig(paths=(str(path),), skip_malformed=True))
    assert len(ds) == 3 and ds.num_skipped == 2


def test_malformed_parquet_row_names_the_row(tmp_path):
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "ok", "answer": "1"}, {"prompt": None, "answer": "2"}]), path)
    with pytest.raises(MalformedRowError, match=r"bad\.parquet row 2: missing 'prompt'"):
        PromptDataset(DataConfig(paths=(str(path),)))
    assert PromptDataset(DataConfig(paths=(str(path),), skip_malformed=True)).num_skipped == 1


def test_file_level_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        PromptDataset(DataConfig(paths=(str(tmp_path / "nope.jsonl"),)))
    with pytest.raises(ValueError, match="neither JSONL"):
        DataConfig(paths=("data.csv",))
    with pytest.raises(ValueError, match="at least one"):
        DataConfig(paths=())
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"not parquet")
    with pytest.raises(ValueError, match="garbage.parquet: cannot read as Parquet"):
        PromptDataset(DataConfig(paths=(str(garbage),)))
    empty = write_jsonl(tmp_path / "empty.jsonl", [], raw_lines=["{bad"])
    with pytest.raises(ValueError, match="no valid samples"):
        PromptDataset(DataConfig(paths=(str(empty),), skip_malformed=True))


# ------------------------------------------------------------------------------------------- sampler


def test_shuffle_is_deterministic_by_seed_and_covers_each_epoch():
    a = PromptSampler(10, SamplerConfig(seed=3, epochs=2))
    b = PromptSampler(10, SamplerConfig(seed=3, epochs=2))
    c = PromptSampler(10, SamplerConfig(seed=4, epochs=2))
    seq_a, seq_b, seq_c = list(a), list(b), list(c)
    assert seq_a == seq_b and seq_a != seq_c
    assert len(seq_a) == 20
    assert sorted(seq_a[:10]) == list(range(10)) and sorted(seq_a[10:]) == list(range(10))
    assert seq_a[:10] != seq_a[10:]  # each epoch has its own order
    assert list(PromptSampler(5, SamplerConfig(shuffle=False))) == [0, 1, 2, 3, 4]


def test_take_crosses_epochs_and_stops_at_the_end():
    s = PromptSampler(4, SamplerConfig(seed=0, epochs=2))
    assert len(s.take(3)) == 3 and len(s.take(3)) == 3 and len(s.take(3)) == 2 and s.take(3) == []
    assert s.exhausted
    endless = PromptSampler(3, SamplerConfig(epochs=None))
    assert len(endless.take(100)) == 100


def test_resume_continues_exactly_where_it_stopped():
    cfg = SamplerConfig(seed=11, epochs=3)
    uninterrupted = PromptSampler(7, cfg).take(21)
    first = PromptSampler(7, cfg)
    head = first.take(9)  # stop in the middle of epoch 1
    state = json.loads(json.dumps(first.state_dict()))  # survives a checkpoint round trip
    resumed = PromptSampler(7, cfg)
    resumed.load_state_dict(state)
    assert head + resumed.take(100) == uninterrupted


def test_resume_rejects_a_different_seed_or_dataset():
    state = PromptSampler(7, SamplerConfig(seed=1)).state_dict()
    with pytest.raises(ValueError, match="seed"):
        PromptSampler(7, SamplerConfig(seed=2)).load_state_dict(state)
    with pytest.raises(ValueError, match="num_samples"):
        PromptSampler(8, SamplerConfig(seed=1)).load_state_dict(state)
    with pytest.raises(ValueError, match="epochs"):
        SamplerConfig(epochs=0)


# ------------------------------------------------------------------------------------------ template

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_tokenizer(directory, chat_template=CHAT_TEMPLATE):
    """A tiny word-level tokenizer built locally (no downloads), saved like a model's tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
    tok.train_from_iterator(
        ["What is 1 + 1 ?", "Add 2 and 3 .", "Be brief .", "Write add ( a , b ) ."],
        trainers.WordLevelTrainer(special_tokens=specials),
    )
    kwargs = {"chat_template": chat_template} if chat_template else {}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", **kwargs)
    fast.save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture
def dataset(tmp_path):
    return PromptDataset(DataConfig(paths=(str(write_jsonl(tmp_path / "d.jsonl", ROWS)),)))


def test_chat_template_from_a_local_tokenizer(tokenizer_dir, dataset):
    template = PromptTemplate(TemplateConfig(tokenizer_dir=str(tokenizer_dir)))
    tok = template.tokenizer
    assert template.render(dataset[1]) == "<|system|> Be brief. <|user|> Add 2 and 3. <|assistant|>"
    assert template.render(dataset[0]) == "<|user|> What is 1 + 1? <|assistant|>"  # prompt -> one user turn
    ids = template.encode(dataset[1])
    assert ids == tok("<|system|> Be brief. <|user|> Add 2 and 3. <|assistant|>", add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("<|system|>") and ids[-1] == tok.convert_tokens_to_ids("<|assistant|>")
    with_system = PromptTemplate(TemplateConfig(tokenizer_dir=str(tokenizer_dir), system_prompt="Be brief."))
    assert with_system.render(dataset[0]).startswith("<|system|> Be brief. <|user|> What")


def test_plain_prompts_without_a_chat_template(tmp_path, dataset):
    plain_dir = make_tokenizer(tmp_path / "plain", chat_template=None)
    template = PromptTemplate(TemplateConfig(tokenizer_dir=str(plain_dir)))
    assert not template.has_chat_template
    assert template.render(dataset[0]) == "What is 1 + 1?"
    assert template.encode(dataset[0]) == template.tokenizer("What is 1 + 1?")["input_ids"]
    with pytest.raises(ValueError, match="needs a chat template"):
        template.encode(dataset[1])
    with pytest.raises(FileNotFoundError, match="tokenizer directory not found"):
        PromptTemplate(TemplateConfig(tokenizer_dir=str(tmp_path / "missing")))


def test_loader_batches_and_resumes(tokenizer_dir, dataset):
    template = PromptTemplate(TemplateConfig(tokenizer_dir=str(tokenizer_dir)))
    cfg = SamplerConfig(seed=5, epochs=2)
    loader = PromptLoader(dataset, PromptSampler(len(dataset), cfg), template)
    first = loader.next_batch(2)
    assert [item.input_ids for item in first] == [template.encode(dataset[item.index]) for item in first]
    state = loader.state_dict()
    rest = [i.index for i in loader.next_batch(10)]
    again = PromptLoader(dataset, PromptSampler(len(dataset), cfg), template)
    again.load_state_dict(state)
    assert [i.index for i in again.next_batch(10)] == rest and len(rest) == 4
