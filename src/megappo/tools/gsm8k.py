"""verl's GSM8K tool (``verl.tools.gsm8k_tool.Gsm8kTool``, the tool of verl's multi-turn GSM8K
examples), the same behaviour: the model submits an answer with ``calc_gsm8k_reward``; the tool
grades it as GSM8K's rule reward does with the flexible extraction (the last number of
``"#### " + answer``) and answers ``Current parsed answer='...' reward=...``; the call's step
reward is 0 when the grade improved on the sample's last one, else -0.05 (a penalty for
resubmitting); ``calc_reward`` is the last grade. Each sample's instance keeps its row's
``ground_truth`` (``tools_kwargs.calc_gsm8k_reward.create_kwargs``)."""
from __future__ import annotations

from typing import Any, Optional

from .base import Tool, function_schema

__all__ = ["Gsm8kTool"]


class Gsm8kTool(Tool):
    PENALTY = -0.05

    def __init__(self, config: Optional[dict] = None, tool_schema: Optional[dict] = None):
        super().__init__(config, tool_schema or function_schema(
            "calc_gsm8k_reward", "A tool for calculating the reward of gsm8k",
            {"answer": {"type": "string", "description": "The answer to the question"}}, ["answer"]))
        self._state: dict[str, dict] = {}

    def create(self, instance_id: Optional[str] = None, ground_truth: Any = None, **kwargs) -> str:
        instance_id = super().create(instance_id)
        if ground_truth is None:
            ground_truth = (kwargs.get("create_kwargs") or {}).get("ground_truth")
        self._state[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id

    def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[str, float, dict]:
        answer = parameters.get("answer", "")
        answer = answer if isinstance(answer, str) else str(answer)
        state = self._state[instance_id]
        state["response"] = answer if answer.startswith("#### ") else "#### " + answer
        reward = self.calc_reward(instance_id)
        step = 0.0 if reward > state["reward"] else self.PENALTY
        state["reward"] = reward
        return f"Current parsed {answer=} {reward=}", step, {}

    def calc_reward(self, instance_id: str, **kwargs) -> float:
        from megappo.rewards import gsm8k

        state = self._state.get(instance_id)
        if state is None or state["ground_truth"] is None:
            return 0.0
        return gsm8k.compute_score(state["response"], str(state["ground_truth"]), method="flexible",
                                   format_score=0.0, score=1.0)

    def release(self, instance_id: str, **kwargs) -> None:
        self._state.pop(instance_id, None)
