"""The ``lookup`` tool of the synthetic tool-use task (``megappo.rewards.synthetic``, task
``lookup``): each sample's instance holds its row's hidden answer (``create_kwargs``) and a call
answers ``= <answer>``. ``calc_reward``: ``config["call_reward"]`` (0.1) for a sample that called it
(an instance exists only once a sample calls), which the task's reward function pays for a wrong
answer; the step reward of ``execute`` is 0."""
from __future__ import annotations

from typing import Any, Optional

from .base import Tool, function_schema


class Lookup(Tool):
    def __init__(self, config: Optional[dict] = None, tool_schema: Optional[dict] = None):
        super().__init__(config, tool_schema or function_schema(
            "lookup", "Look up the answer to the user's question in a table only this tool can read.", {}, []))
        self._answers: dict[str, str] = {}

    def create(self, instance_id: Optional[str] = None, answer: str = "", **kwargs) -> str:
        instance_id = super().create(instance_id)
        self._answers[instance_id] = str(answer)
        return instance_id

    def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[str, float, dict]:
        return f"= {self._answers.get(instance_id, '')}", 0.0, {}

    def calc_reward(self, instance_id: str, **kwargs) -> float:
        return float(self.config.get("call_reward", 0.1)) if instance_id in self._answers else 0.0

    def release(self, instance_id: str, **kwargs) -> None:
        self._answers.pop(instance_id, None)
