"""GenerationParams validation and presets in user_data/presets."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from modules.errors import InvalidRequest
from modules.generation import presets
from modules.generation.params import GenerationParams


def test_defaults_validate_and_every_field_is_documented() -> None:
    params = GenerationParams()
    params.validate()
    for name, f in GenerationParams.field_info().items():
        assert f.metadata["doc"], name
        assert f.metadata["group"], name
    assert params.non_default() == {}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -1),
        ("top_p", 1.5),
        ("max_new_tokens", 0),
        ("top_k", 2.5),
        ("seed", -7),
        ("stop", [1, 2]),
        ("temperature", "hot"),
    ],
)
def test_out_of_range_values_name_the_field(field: str, value: object) -> None:
    with pytest.raises(InvalidRequest) as info:
        GenerationParams.from_dict({field: value})
    assert info.value.param == field


def test_unknown_field_is_refused_in_strict_mode() -> None:
    with pytest.raises(InvalidRequest, match="frobnicate"):
        GenerationParams.from_dict({"frobnicate": 1})
    assert GenerationParams.from_dict({"frobnicate": 1}, strict=False).non_default() == {}


def test_coercion_of_strings_and_single_stop() -> None:
    params = GenerationParams.from_dict(
        {"temperature": "0.5", "stop": "END", "ban_eos": "true", "logit_bias": {"5": -100}}
    )
    assert params.temperature == 0.5 and params.stop == ["END"] and params.ban_eos is True
    assert params.logit_bias == {5: -100.0}


def test_shipped_presets_load(hub: object) -> None:
    names = presets.list_presets()
    for name in ("Deterministic", "Creative", "Top-P", "Min-P"):
        assert name in names
        presets.preset_params(name)
    assert presets.preset_params("Deterministic").temperature == 0
    assert presets.preset_params("Min-P").min_p == 0.05


def test_save_load_delete_preset_round_trip(hub: object, user_data: Path) -> None:
    params = GenerationParams(temperature=0.3, top_k=40, stop=["\n\n"])
    path = presets.save_preset("Mine", params)
    assert yaml.safe_load(path.read_text()) == {"temperature": 0.3, "top_k": 40, "stop": ["\n\n"]}
    assert presets.preset_params("Mine", max_new_tokens=9) == params.replace(max_new_tokens=9)
    presets.delete_preset("Mine")
    assert "Mine" not in presets.list_presets()


def test_bad_preset_names_and_contents(hub: object, user_data: Path) -> None:
    with pytest.raises(InvalidRequest):
        presets.load_preset("../../etc/passwd")
    with pytest.raises(InvalidRequest, match="does not exist"):
        presets.load_preset("Nope")
    (user_data / "presets" / "Broken.yaml").write_text("temperature: -3\n")
    with pytest.raises(InvalidRequest, match="temperature"):
        presets.load_preset("Broken")
