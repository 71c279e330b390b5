"""A rollout replica over two ranks (rollout TP 2): only its first rank runs the tools (and the interactions), and both
ranks continue every conversation with that rank's answers, so the engine's ranks are fed the
same prompts even when a tool would answer each rank differently."""
import json
from pathlib import Path

CALL = '<tool_call>{"name": "who", "arguments": {}}</tool_call>'


def _replica(rank, world, out):
    import os

    from megappo.rollout import multi_turn_generate
    from megappo.tools import Tool, ToolRunner, function_schema
    from megappo.trainer.turns import ReplicaTools, replica_tools

    class Who(Tool):
        """Answers with the rank (and process) that ran it: what differs between ranks."""

        def __init__(self):
            super().__init__({}, function_schema("who", "Who runs this.", {}, []))

        def execute(self, instance_id, parameters, **kwargs):
            return f"rank {rank} pid {os.getpid()}", float(rank + 1), {}

        def calc_reward(self, instance_id, **kwargs):
            return 10.0 * (rank + 1)

    class Engine:   # the same model turns on both ranks, as a TP replica's ranks produce them
        def generate(self, prompts, max_tokens):
            return [([7, 8, 9][:m], [-0.5] * min(3, m)) for m in max_tokens]

    runner = replica_tools(ToolRunner({"who": Who()}), rank, world, 2)
    assert isinstance(runner, ReplicaTools) and runner.is_leader == (rank == 0)
    samples, metrics = multi_turn_generate(Engine(), [[1, 2], [3]], runner=runner, decode=lambda ids: CALL,
                                           tool_turn=lambda texts: [ord(c) for t in texts for c in t],
                                           max_response_length=200, max_assistant_turns=3)
    Path(out, f"{rank}.json").write_text(json.dumps({
        "ids": [s.response_ids for s in samples], "mask": [s.response_mask for s in samples],
        "step": [s.step_rewards for s in samples], "final": [s.tool_rewards for s in samples],
        "calls": metrics["tools/calls"], "pid": os.getpid()}))

    # an interaction (a simulated user) in the same replica: it too runs on the first rank only
    from megappo.tools import Interaction, InteractionRunner

    class Whoami(Interaction):
        finalized = 0

        def generate_response(self, instance_id, messages, **kwargs):
            return len(messages) >= 5, f"user at rank {rank} pid {os.getpid()}", float(rank + 1), {}

        def finalize_interaction(self, instance_id, **kwargs):
            Whoami.finalized += 1

    users = replica_tools(InteractionRunner({"who": Whoami({})}), rank, world, 2)
    samples, metrics = multi_turn_generate(
        Engine(), [[1, 2], [3]], runner=replica_tools(ToolRunner({}), rank, world, 2),
        decode=lambda ids, skip_special_tokens=False: "no call", tool_turn=lambda texts, role="tool": [ord(c) for t in texts for c in t],
        max_response_length=200, interactions=users, messages=[[{"role": "user", "content": "q"}]] * 2,
        interaction_kwargs=[{"name": "who"}] * 2)
    Path(out, f"{rank}.users.json").write_text(json.dumps({
        "ids": [s.response_ids for s in samples], "scores": [s.turn_scores for s in samples],
        "stop": [s.stop for s in samples], "turns": metrics["interaction/turns"], "finalized": Whoami.finalized}))


def test_a_replicas_ranks_share_its_first_ranks_tool_answers(tmp_path):
    from harness import spawn

    from megappo.tools import ToolRunner
    from megappo.trainer.turns import replica_tools

    runner = ToolRunner({})
    assert replica_tools(runner, 0, 1, 1) is runner   # a one-rank replica runs its own tools
    spawn(_replica, 2, str(tmp_path))
    r0, r1 = (json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1))
    assert r0["pid"] != r1["pid"]
    for key in ("ids", "mask", "step", "final", "calls"):
        assert r0[key] == r1[key], key
    answer = [ord(c) for c in f"rank 0 pid {r0['pid']}"]
    assert r0["ids"][0] == [7, 8, 9] + answer + [7, 8, 9] + answer + [7, 8, 9]
    assert r0["step"] == [[1.0, 1.0]] * 2 and r0["final"] == [{"who": 10.0}] * 2 and r0["calls"] == 4
    u0, u1 = (json.loads((tmp_path / f"{r}.users.json").read_text()) for r in (0, 1))
    for key in ("ids", "scores", "stop", "turns"):
        assert u0[key] == u1[key], key
    said = [ord(c) for c in f"user at rank 0 pid {r0['pid']}"]
    assert u0["ids"][0] == [7, 8, 9] + said + [7, 8, 9] + said + [7, 8, 9] and u0["scores"] == [[1.0, 1.0, 1.0]] * 2
    assert u0["stop"] == ["interaction_done"] * 2 and u0["turns"] == 6
    assert (u0["finalized"], u1["finalized"]) == (2, 0)     # the instances live on the first rank
