"""RunWide.masked_mean: the mean over every rank's masked positions, which rollout correction's batch-normalised
importance weights divide by (a fake pair of ranks: this one and another whose sums it adds)."""

import torch

from trainer.config import RunConfig
from trainer.distributed.run_wide import RunWide


class TwoRanks:
    """This rank, and another whose (sum, count) are `other`: what the all-reduce over the data ranks adds."""

    distributed = True

    def __init__(self, other: list[float]):
        self.other = torch.tensor(other, dtype=torch.float64)

    def sum_tensor_over_data(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor + self.other


def test_the_mean_is_over_every_ranks_tokens_not_the_mean_of_the_ranks_means():
    run_wide = RunWide(TwoRanks(other=[10.0, 2.0]), RunConfig(), send=lambda message: None)  # another rank: 2 tokens
    values = torch.tensor([[1.0, 2.0, 3.0, 99.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # this rank: 3 tokens summing to 6
    # (6 + 10) / (3 + 2) = 3.2 (the means of the ranks, 2 and 5, would average 3.5)
    torch.testing.assert_close(run_wide.masked_mean(values, mask), torch.tensor(3.2))
