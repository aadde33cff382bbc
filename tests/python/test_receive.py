"""What each rank sends and receives in the dispatch all-to-all (`fsdpturbo.moe.dispatch.pipeline.Receive`,
from the all-gathered counts, and its `local_order`, the second stable sort): the seed's worked
example number for number, the edge cases (experts == ep, zero tokens, ranks that send or
receive nothing, zero-token experts) and random gathered counts against a naive reference, with
what each rank receives mirroring what the others send."""
import random

import pytest
import torch

from fsdpturbo.moe.dispatch.pipeline import Receive


def _naive(gathered, rank, local):
    """Receive's fields and the local-expert-major order, by their definitions: Gl =
    G[:, rank·L:(rank+1)·L], its sums, the local expert of each received row (source-major)
    and its stable argsort."""
    ep_size = len(gathered)
    own = [row[rank * local:(rank + 1) * local] for row in gathered]
    expert_of_row = [e for row in own for e, n in enumerate(row) for _ in range(n)]
    return {"sends": gathered[rank],
            "input_splits": [sum(gathered[rank][p * local:(p + 1) * local]) for p in range(ep_size)],
            "output_splits": [sum(row) for row in own],
            "blocks": [n for row in own for n in row],
            "tokens_per_local_expert": [sum(row[e] for row in own) for e in range(local)],
            "local_order": sorted(range(len(expert_of_row)), key=expert_of_row.__getitem__)}


def _check(gathered, rank, local, **expected):
    receive = Receive.of(gathered, rank, local)
    got = {field: getattr(receive, field) for field in expected if field != "local_order"}
    if "local_order" in expected:
        got["local_order"] = receive.local_order(local, "cpu").tolist()
    assert got == expected, f"rank {rank} of {gathered}"


def test_the_seeds_worked_example_number_for_number():
    """seed §5.1: P = 2, E = 4, L = 2, K = 2; rank 0 routes [[1, 2], [0, 3], [2, 1]], rank 1
    [[3, 0], [2, 3]]."""
    gathered = [[1, 2, 2, 1], [1, 0, 1, 2]]
    _check(gathered, 0, 2, sends=[1, 2, 2, 1], input_splits=[3, 3], output_splits=[3, 1], blocks=[1, 2, 1, 0],
           tokens_per_local_expert=[2, 2], local_order=[0, 3, 1, 2])
    # Rank 1: Gl = [[2, 1], [1, 2]]; received rows of local experts [0, 0, 1, 0, 1, 1].
    _check(gathered, 1, 2, sends=[1, 0, 1, 2], input_splits=[1, 3], output_splits=[3, 3], blocks=[2, 1, 1, 2],
           tokens_per_local_expert=[3, 3], local_order=[0, 1, 3, 2, 4, 5])


def test_experts_equal_to_ep_size_give_one_local_expert():
    """E = P = 4 (the seed never sets expert_ids_per_ep_rank and crashes)."""
    gathered = [[1, 1, 1, 3], [0, 0, 0, 0], [1, 1, 0, 2], [0, 0, 0, 0]]
    _check(gathered, 0, 1, input_splits=[1, 1, 1, 3], output_splits=[1, 0, 1, 0], tokens_per_local_expert=[2],
           local_order=[0, 1])
    _check(gathered, 3, 1, input_splits=[0, 0, 0, 0], output_splits=[3, 0, 2, 0], tokens_per_local_expert=[5],
           local_order=[0, 1, 2, 3, 4])


def test_zero_tokens_receive_nothing():
    _check([[0] * 16] * 4, 2, 4, input_splits=[0] * 4, output_splits=[0] * 4, tokens_per_local_expert=[0] * 4,
           local_order=[])


def test_ranks_that_send_or_receive_nothing_and_zero_token_experts():
    """P = 3, E = 6: rank 0 routes only to its own experts, rank 1 only to rank 2's, rank 2 has
    no tokens; nobody routes to rank 1, and experts 1, 2, 3 and 5 get nothing."""
    gathered = [[4, 0, 0, 0, 0, 0], [0, 0, 0, 0, 4, 0], [0] * 6]
    _check(gathered, 0, 2, input_splits=[4, 0, 0], output_splits=[4, 0, 0], tokens_per_local_expert=[4, 0],
           local_order=[0, 1, 2, 3])
    _check(gathered, 1, 2, input_splits=[0, 0, 4], output_splits=[0, 0, 0], tokens_per_local_expert=[0, 0],
           local_order=[])
    _check(gathered, 2, 2, input_splits=[0, 0, 0], output_splits=[0, 4, 0], tokens_per_local_expert=[4, 0],
           local_order=[0, 1, 2, 3])


@pytest.mark.parametrize("seed", range(4))
def test_random_counts_match_the_naive_reference_and_mirror_the_senders(seed):
    rng = random.Random(seed)
    for case in range(50):
        ep_size, local = rng.randint(1, 5), rng.randint(1, 4)
        experts = ep_size * local
        # Skewed (some experts hot, many empty), and some ranks without tokens.
        gathered = [[0] * experts if rng.random() < 0.25 else
                     [rng.choice([0, 0, rng.randint(1, 3), rng.randint(0, 12)]) for _ in range(experts)]
                     for _ in range(ep_size)]
        receives = [Receive.of(gathered, rank, local) for rank in range(ep_size)]
        for rank, receive in enumerate(receives):
            _check(gathered, rank, local, **_naive(gathered, rank, local))
            # What this rank receives from each source is what that source sends it.
            assert receive.output_splits == [receives[s].input_splits[rank] for s in range(ep_size)], \
                f"case {case}: rank {rank} of {gathered}"
            assert sum(receive.output_splits) == sum(receive.tokens_per_local_expert) == sum(receive.blocks)
        order = receives[0].local_order(local, "cpu")
        assert order.dtype == torch.int64 and sorted(order.tolist()) == list(range(order.numel()))
