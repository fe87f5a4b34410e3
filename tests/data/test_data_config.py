"""The `data` config section: defaults, validation and YAML decoding."""

import draccus
import pytest

from loomax.data import DataConfig, SourceConfig


def test_defaults_use_embedded_stdlib_and_held_out_split() -> None:
    config = DataConfig()
    assert config.train == [SourceConfig(embedded="python_stdlib")]
    assert config.validation == []
    assert config.tokenizer is None


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"validation_fraction": 0.0}, "data.validation_fraction"),
        ({"validation_fraction": 1.0}, "data.validation_fraction"),
        ({"tokenizer_vocab_size": 100}, "data.tokenizer_vocab_size"),
        ({"train": []}, "data.train"),
        ({"cache_dir": ""}, "data.cache_dir"),
        ({"fast_encoder": "on"}, "data.fast_encoder"),
    ],
)
def test_invalid_values_name_the_key(kwargs: dict, key: str) -> None:
    with pytest.raises(ValueError, match=key):
        DataConfig(**kwargs)


def test_decodes_from_yaml_structure() -> None:
    config = draccus.decode(
        DataConfig,
        {
            "train": [{"urls": ["shard_{0..1}.jsonl"], "text_key": "body", "weight": 2.0}],
            "validation": [{"embedded": "python_stdlib", "max_documents": 3}],
            "validation_fraction": 0.1,
        },
    )
    assert config.train == [SourceConfig(urls=["shard_{0..1}.jsonl"], text_key="body", weight=2.0)]
    assert config.validation == [SourceConfig(embedded="python_stdlib", max_documents=3)]


def test_decoding_keeps_the_validation_error() -> None:
    with pytest.raises(draccus.ParsingError) as info:
        draccus.decode(DataConfig, {"validation_fraction": 2.0})
    assert "data.validation_fraction" in str(info.value.__cause__)
