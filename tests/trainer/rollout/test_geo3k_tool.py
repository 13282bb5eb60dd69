"""verl's Geo3kTool (verl/tools/geo3k_tool.py), built from verl's own tool config file: the model submits its answer
and reads its score; a submission that does not improve on the last costs 0.05."""

from __future__ import annotations

import asyncio
from pathlib import Path

from trainer.rollout.tools import Geo3kTool, load_tools

GEO3K_TOOL_CONFIG = (Path(__file__).resolve().parents[1] / "config" / "assets" / "verl_examples"
                     / "sglang_multiturn_config" / "geo3k_tool_config.yaml")


def test_verls_geo3k_tool_config_builds_the_geo3k_tool() -> None:
    tools = load_tools(str(GEO3K_TOOL_CONFIG))
    assert list(tools) == ["calc_geo3k_reward"]
    assert isinstance(tools["calc_geo3k_reward"], Geo3kTool)


def test_the_geo3k_tool_scores_each_answer_against_the_rows_ground_truth() -> None:
    tool = load_tools(str(GEO3K_TOOL_CONFIG))["calc_geo3k_reward"]

    async def submissions() -> list[tuple[str, float]]:
        instance, _ = await tool.create(create_kwargs={"ground_truth": "24"})
        answers = []
        for answer in ("12", "24.0", "24"):
            response, tool_reward, _ = await tool.execute(instance, {"answer": answer})
            answers.append((response.text, tool_reward))
        await tool.release(instance)
        return answers

    assert asyncio.run(submissions()) == [
        ("Current parsed answer='12' reward=0.0", -0.05),  # wrong, and no better than the start's 0
        ("Current parsed answer='24.0' reward=1.0", 0.0),  # right (24.0 is 24): an improvement
        ("Current parsed answer='24' reward=1.0", -0.05),  # right again, but no better
    ]
