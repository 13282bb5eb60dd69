"""The embedding cache: frequent rows on the device, the rest gathered on the CPU; lookups always equal
the full table's, before and after the weights change."""

from __future__ import annotations

import torch

from tests.trainer.offload.test_offload import offloaded, policy, token_batch
from trainer.offload.embedding_cache import EmbeddingCache


def skewed_tokens(count: int, vocabulary: int, seed: int) -> torch.Tensor:
    """Token ids with a Zipf-like distribution (few tokens common, most rare), shaped [4, count // 4]."""
    weights = 1.0 / torch.arange(1, vocabulary + 1, dtype=torch.float)
    order = torch.randperm(vocabulary, generator=torch.Generator().manual_seed(0))  # the same common tokens
    generator = torch.Generator().manual_seed(seed)
    return order[torch.multinomial(weights, count, replacement=True, generator=generator)].view(4, -1)


def test_lookups_equal_the_full_table_before_and_after_an_update():
    table = torch.randn(500, 16)
    version = {"value": 0}
    cache = EmbeddingCache(lambda: table, lambda: version["value"], torch.device("cpu"), cache_size=50,
                           warmup_steps=2)
    for step in range(2):
        ids = skewed_tokens(400, 500, seed=step)
        assert torch.equal(cache.lookup(ids), table[ids])
        cache.end_step()
    assert cache.filled and cache.rows.shape == (50, 16)
    assert cache.take_hit_ratio() is None  # the warm-up's lookups are not counted as hits or misses
    for step in range(2, 5):
        ids = skewed_tokens(400, 500, seed=step)
        assert torch.equal(cache.lookup(ids), table[ids])
    ratio = cache.take_hit_ratio()
    # 50 of 500 rows cached, chosen by frequency: far more than a tenth of the lookups hit.
    assert 0.4 < ratio < 1.0

    table.mul_(-2.0).add_(1.0)  # an optimizer update, in place
    version["value"] += 1
    ids = skewed_tokens(400, 500, seed=9)
    assert torch.equal(cache.lookup(ids), table[ids])


def test_steps_that_look_nothing_up_do_not_count_towards_the_warm_up():
    table = torch.randn(100, 8)
    cache = EmbeddingCache(lambda: table, lambda: 0, torch.device("cpu"), cache_size=10, warmup_steps=2)
    for _ in range(3):
        cache.end_step()  # rollouts that kept the whole embedding on the device
    assert not cache.filled and cache.steps == 0
    common = torch.tensor([[7, 7, 7, 3]])
    for _ in range(2):
        cache.lookup(common)
        cache.end_step()
    assert cache.filled and {7, 3} <= set(cache.tokens.tolist())


def test_the_cached_embedding_of_an_offloaded_model_gives_its_logits_before_and_after_a_step():
    model = policy().train()
    engine = offloaded(model, {"offload_policy": {"embedding": "cpu"}})
    cache = engine.enable_embedding_cache(cache_size=8, warmup_steps=1)
    optimizer = engine.optimizer(lr=1e-2)
    ids = token_batch()

    def logits(cached: bool) -> torch.Tensor:
        engine.rows.embedding_cache = cache if cached else None
        with torch.no_grad():
            return model(input_ids=ids).logits

    torch.testing.assert_close(logits(True), logits(False), rtol=0, atol=0)
    cache.end_step()
    assert cache.filled
    torch.testing.assert_close(logits(True), logits(False), rtol=0, atol=0)
    assert 0 < cache.take_hit_ratio() < 1

    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.wait()
    # The embedding's weights changed: the cached rows follow.
    torch.testing.assert_close(logits(True), logits(False), rtol=0, atol=0)


def test_no_cache_for_an_embedding_on_the_gpu():
    assert offloaded(policy(), {}).enable_embedding_cache(cache_size=8, warmup_steps=1) is None


def test_a_run_with_the_cache_gives_the_same_results_and_reports_its_hit_ratio(tmp_path):
    from tests.trainer.test_training import computed_metrics, make_trainer

    layered = ("actor_rollout_ref.actor.fsdp_config.offload_policy.embedding=cpu", "trainer.total_training_steps=2")
    plain = make_trainer(tmp_path, *layered, name="plain")
    plain.fit()
    cached = make_trainer(tmp_path, *layered, "actor_rollout_ref.rollout.embedding_cache={enabled: true, "
                          "cache_size: 16, warmup_steps: 1}", name="cached")
    assert cached.memory.embedding_cache is not None
    cached.fit()
    ratios = [row["rollout/embedding_cache_hit_ratio"] for row in cached.metrics_log.read()]
    assert len(ratios) == 2 and all(0 < ratio <= 1 for ratio in ratios)
    rows = [{key: value for key, value in row.items() if key != "rollout/embedding_cache_hit_ratio"}
            for row in computed_metrics(cached)]
    assert rows == computed_metrics(plain)
