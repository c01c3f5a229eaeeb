"""worker.cuda_graphs: which captured graph a step replays (the capture itself runs on a GPU:
tests/test_gpu_engine.py)."""

import pytest

from worker.cuda_graphs import batch_ladder, mixed_ladder


@pytest.mark.parametrize("ladder, largest", [(batch_ladder, 512), (batch_ladder, 100),
                                             (mixed_ladder, 1024), (mixed_ladder, 300)])
def test_a_ladder_rises_to_exactly_its_largest_size(ladder, largest):
    sizes = ladder(largest)
    assert sizes == sorted(set(sizes)) and sizes[-1] == largest


def test_a_mixed_step_of_more_than_96_tokens_is_padded_by_under_a_third():
    sizes = mixed_ladder(1024)
    for tokens in range(97, 1025):
        padded = next(s for s in sizes if s >= tokens)
        assert (padded - tokens) * 3 < tokens, (tokens, padded)
