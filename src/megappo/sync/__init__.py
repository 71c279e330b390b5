"""Weight sync: the updated actor's weights into the running rollout engine, in place, after every
update. One interface, :class:`WeightSync` (``push(version)``), over every method: shard-direct,
shared-memory gather, full gather, and the split placement's bridge (see :mod:`.weight_sync`)."""
from .weight_sync import WeightSync, agree, plan_for_engine

__all__ = ["WeightSync", "agree", "plan_for_engine"]
