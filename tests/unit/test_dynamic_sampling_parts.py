"""DAPO's dynamic sampling, pure parts: the group filter against a loop over groups, and the
concatenation of generation rounds into one batch."""
import pytest
import torch

from megappo import algo
from megappo.batch import RolloutBatch


def _loop(metric, group_index):
    keep = []
    for i in range(len(metric)):
        members = [float(metric[j]) for j in range(len(metric)) if int(group_index[j]) == int(group_index[i])]
        keep.append(len(members) == 1 or len(set(members)) > 1)
    return keep


@pytest.mark.parametrize("seed", range(5))
def test_informative_groups_equal_a_loop(seed):
    g = torch.Generator().manual_seed(seed)
    B = 40
    group_index = torch.randint(0, 12, (B,), generator=g)[torch.randperm(B, generator=g)]
    metric = torch.randint(0, 2, (B,), generator=g).float()        # acc-like: many uniform groups
    metric[group_index == 3] = 0.7                                 # a uniform non-binary group
    got = algo.informative_groups(metric, group_index)
    assert got.tolist() == _loop(metric, group_index)
    assert not got[group_index == 3].any() or (group_index == 3).sum() == 1


def test_informative_groups_by_hand():
    metric = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 5.0, 2.0, 2.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 2, 3, 3])
    # all-equal 0.1s are dropped (np.std would call them varied), a singleton is kept
    assert algo.informative_groups(metric, groups).tolist() == [False, False, False, True, True, True, False, False]
    with pytest.raises(ValueError, match=r"metric \(8,\) and group_index \(7,\) must be the same"):
        algo.informative_groups(metric, groups[:7])


def _batch(prompts, responses, lengths, pad=0):
    mask = (torch.arange(responses.shape[1])[None] < torch.tensor(lengths)[:, None]).float()
    b = RolloutBatch.from_prompts_and_responses(prompts, responses, mask, pad, prompt_index=torch.arange(len(prompts)))
    b.token_level_scores = mask * 2
    return b


def test_concat_pads_each_field_to_the_widest():
    a = _batch([[5, 6], [7]], torch.tensor([[9, 9, 9], [8, 8, 8]]), [3, 1])
    b = _batch([[4, 4, 4, 4]], torch.tensor([[3, 3, 3, 3, 3]]), [5])
    out = RolloutBatch.concat([a, b], pad_token_id=0)
    assert out.input_ids.tolist() == [[5, 6, 9, 9, 9, 0, 0, 0, 0], [7, 8, 0, 0, 0, 0, 0, 0, 0],
                                      [4, 4, 4, 4, 3, 3, 3, 3, 3]]
    assert out.responses.tolist() == [[9, 9, 9, 0, 0], [8, 8, 8, 0, 0], [3, 3, 3, 3, 3]]
    assert out.response_mask.sum(-1).tolist() == [3, 1, 5]
    assert out.token_level_scores.sum(-1).tolist() == [6, 2, 10]
    assert out.prompt_lengths.tolist() == [2, 1, 4] and out.prompt_index.tolist() == [0, 1, 0]
    # each row of the result is its source row (positions a model reads are unchanged)
    for src, i, j in ((a, 0, 0), (a, 1, 1), (b, 0, 2)):
        n = src.input_ids.shape[1]
        assert torch.equal(out.input_ids[j, :n], src.input_ids[i])
    b.token_level_scores = None
    with pytest.raises(ValueError, match="field token_level_scores is missing in some batches"):
        RolloutBatch.concat([a, b], pad_token_id=0)
