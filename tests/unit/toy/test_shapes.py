"""Real checkpoints' shapes with random weights (`shape:<name>`): the published sizes, and a build that loads."""

import json

import pytest
import torch
import transformers

from asyncgrpo.errors import ConfigError
from asyncgrpo.inference_node.vllm_server import served_lora_rank
from asyncgrpo.toy.shapes import SHAPES, build_shape_model, shape_config, shape_model_dir, shape_name
from asyncgrpo.toy.tokenizer import EOS_ID


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_each_shape_has_its_checkpoints_published_parameter_count(name):
    with torch.device("meta"):  # no memory: only the shapes
        model = getattr(transformers, SHAPES[name].model_class)(shape_config(name))
    assert sum(p.numel() for p in model.parameters()) == SHAPES[name].parameters


def test_the_issue_asks_for_these_four_shapes():
    assert {"qwen2.5-0.5b", "qwen2.5-1.5b", "llama-3.2-1b", "gemma-3-1b"} <= set(SHAPES)


def test_shape_names_are_case_blind_and_an_unknown_one_lists_the_known():
    assert shape_name("shape:Qwen2.5-1.5B") == "qwen2.5-1.5b"
    assert shape_name("Qwen/Qwen2.5-1.5B") is None  # a hub id is not a shape
    with pytest.raises(ConfigError, match="shape:qwen2.5-0.5b"):
        shape_name("shape:qwen9")


def test_a_gemma_shape_cut_short_still_ends_on_full_attention():
    config = shape_config("gemma-3-1b", num_hidden_layers=3)
    assert config.layer_types == ["sliding_attention", "sliding_attention", "full_attention"]


def test_a_built_shape_loads_with_its_dtype_vocabulary_and_the_toy_ids(tmp_path):
    # The real vocabulary and width, fewer layers: what `shape:` builds, small enough for a unit test.
    directory = build_shape_model("qwen2.5-0.5b", tmp_path / "m", "bfloat16", num_hidden_layers=1,
                                  intermediate_size=64)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype="auto")
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    assert model.dtype == torch.bfloat16
    assert len(tokenizer) == model.config.vocab_size == 151936
    assert model.config.hidden_size == 896 and model.config.num_hidden_layers == 1
    assert model.generation_config.eos_token_id == EOS_ID == tokenizer.eos_token_id
    ids = tokenizer("7+5=")["input_ids"]
    assert tokenizer.decode(ids) == "7+5=" and max(ids) < 259  # fillers are never produced by encoding
    assert json.loads((directory / "config.json").read_text())["tie_word_embeddings"] is True


def test_a_cached_shape_is_found_without_building(tmp_path):
    root = tmp_path / "shape-qwen2.5-0.5b-bfloat16"
    root.mkdir()
    (root / "config.json").write_text("{}")
    (root / "tokenizer.json").write_text("{}")
    built = []
    assert shape_model_dir("shape:qwen2.5-0.5b", "bfloat16", tmp_path, log=built.append) == str(root.resolve())
    assert built == []
    with pytest.raises(ConfigError, match="torch_dtype"):
        shape_model_dir("shape:qwen2.5-0.5b", "int8", tmp_path)


@pytest.mark.parametrize("lora_r, served", [(1, 1), (2, 8), (8, 8), (9, 16), (16, 16), (320, 320), (321, 512)])
def test_the_server_gets_the_smallest_lora_rank_vllm_accepts(lora_r, served):
    assert served_lora_rank(lora_r) == served


def test_a_rank_above_vllms_largest_is_a_config_error():
    with pytest.raises(ConfigError, match="lora_r"):
        served_lora_rank(513)
