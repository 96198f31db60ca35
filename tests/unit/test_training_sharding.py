"""Launches that shard the weights (FSDP, DeepSpeed ZeRO-3) are refused before a run starts, as accelerate sets
them in the environment; data parallel and ZeRO-1/2 pass."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from modules.errors import InvalidRequest
from modules.training.run import check_sharding

DEEPSPEED = {"ACCELERATE_USE_DEEPSPEED": "true"}


PASSING = [
    {},
    {"ACCELERATE_USE_FSDP": "false"},
    {**DEEPSPEED, "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"},
    DEEPSPEED,
    {"ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"},  # a stage without DeepSpeed
]


@pytest.mark.parametrize("env", PASSING)
def test_one_process_data_parallel_and_zero_1_2_pass(env: dict[str, str]) -> None:
    check_sharding(env)


def test_fsdp_and_zero_3_flags_are_refused() -> None:
    with pytest.raises(InvalidRequest, match="FSDP is not supported"):
        check_sharding({"ACCELERATE_USE_FSDP": "true"})
    with pytest.raises(InvalidRequest, match="ZeRO-3 is not supported"):
        check_sharding({**DEEPSPEED, "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"})


def test_a_deepspeed_config_file_s_own_stage_decides(tmp_path: Path) -> None:
    config = tmp_path / "ds.json"
    env = {**DEEPSPEED, "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(config)}
    config.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    with pytest.raises(InvalidRequest, match="ZeRO-3 is not supported"):
        check_sharding(env)
    config.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    check_sharding(env)
    config.write_text("{not json")
    with pytest.raises(InvalidRequest, match="cannot read the DeepSpeed config"):
        check_sharding(env)
