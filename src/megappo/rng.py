"""The process's random number generators, captured and restored as one state: a checkpoint
keeps each rank's (a resumed run continues its streams), and starting vLLM (whose worker reseeds
them) must leave the trainer's as they were."""
from __future__ import annotations

import random

import torch

__all__ = ["capture", "restore"]


def capture(cuda: bool = False) -> dict:
    """torch's, Python's and numpy's generator states; with ``cuda`` every CUDA device's too
    (when CUDA is available)."""
    import numpy as np

    # plain types and tensors only, so a checkpoint holding it loads with torch.load(weights_only=True)
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss))}
    if cuda and torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore(state: dict) -> None:
    import numpy as np

    if state.get("cuda") is not None:
        torch.cuda.set_rng_state_all(state["cuda"])
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.int64).astype(np.uint32), pos, has_gauss, gauss))
