"""What a run of several ranks needs of its config: the world size and the data-parallel degree, the launch keys
(trainer.nnodes, node_rank, rdzv_endpoint), Ulysses' degrees against the ranks and the models' heads
(sequence_parallel.py), and the features that work on one rank only. Rules of the one pass in rules.py.
"""

from __future__ import annotations

import math

from trainer.config.environment import RDZV_ENDPOINT_ENVIRONMENT
from trainer.config.errors import ConfigProblem, ConfigWarning
from trainer.config.schema import BUILTIN_PREFIX, FSDP_PREFIX, RunConfig
from trainer.config.sequence_parallel import model_heads, sequence_parallel_problems


def check_devices(config: RunConfig) -> list[ConfigProblem]:
    devices = world_size(config)
    problems = _check_sequence_parallel(config)
    if devices > 1 and not problems:  # the data-parallel degree is known once S fits the ranks
        problems += _batch_sizes_for_ranks(config)
    if devices > 1:
        problems += _single_rank_features(config)
    return problems



def parse_endpoint(endpoint: str) -> tuple[str, int] | None:
    """("host", port) of "host:port" (an IPv6 host in brackets: "[::1]:29500"), or None when it is not one."""
    host, separator, port = endpoint.strip().rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not separator or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host, int(port)


def check_launch(config: RunConfig) -> list[ConfigProblem]:
    trainer = config.trainer
    problems = []
    if trainer.node_rank >= trainer.nnodes:
        problems.append(ConfigProblem("trainer.node_rank", f"got {trainer.node_rank}, but trainer.nnodes is "
                                      f"{trainer.nnodes}; allowed: 0 to {trainer.nnodes - 1}"))
    if trainer.rdzv_endpoint is not None and parse_endpoint(trainer.rdzv_endpoint) is None:
        problems.append(ConfigProblem("trainer.rdzv_endpoint", f"got {trainer.rdzv_endpoint!r}; allowed: "
                                      "host:port of node 0, e.g. node0.cluster:29500"))
    elif (missing := missing_endpoint(config)) is not None:
        # verl's several-node scripts leave the nodes to a Ray cluster: they load and pass --check here, and the
        # run itself starts only with the endpoint (`verl train` refuses it then, daemon/cli.py).
        problems.append(ConfigWarning(missing.path, f"is not set, but trainer.nnodes is {trainer.nnodes}: each "
                                      "node's `verl train` meets the others at node 0's host:port (verl's scripts "
                                      "leave it to a Ray cluster), and the run starts only with it; set it, "
                                      f"${RDZV_ENDPOINT_ENVIRONMENT}, or MASTER_ADDR and MASTER_PORT on each node"))
    return problems


def missing_endpoint(config: RunConfig) -> ConfigProblem | None:
    """A run of several nodes without its rendezvous endpoint (None: one node, or the endpoint is set)."""
    trainer = config.trainer
    if trainer.rdzv_endpoint is not None or trainer.nnodes == 1:
        return None
    return ConfigProblem("trainer.rdzv_endpoint", f"is not set, but trainer.nnodes is {trainer.nnodes}; allowed: "
                         "host:port of node 0, the same on every node (or set "
                         f"${RDZV_ENDPOINT_ENVIRONMENT}, or MASTER_ADDR and MASTER_PORT)")


def world_size(config: RunConfig) -> int:
    """The run's ranks: trainer.nnodes x trainer.n_gpus_per_node (CPU ranks with trainer.device: cpu)."""
    return config.trainer.nnodes * config.trainer.n_gpus_per_node


def data_parallel_size(config: RunConfig) -> int:
    """The groups the prompts split over: the world size over the Ulysses degree (its ranks share sequences)."""
    return max(1, world_size(config) // config.sequence_parallel_size)


def _check_sequence_parallel(config: RunConfig) -> list[ConfigProblem]:
    """Ulysses' degrees against the ranks and the models' heads (trainer/config/sequence_parallel.py), the one
    degree of the run, and the settings that go with it."""
    actor, critic = config.actor_rollout_ref.actor, config.critic
    actor_key = "actor_rollout_ref.actor.ulysses_sequence_parallel_size"
    critic_key = "critic.ulysses_sequence_parallel_size"
    model = config.actor_rollout_ref.model
    policy_override = "actor_rollout_ref.model.override_config"
    degrees = [(actor_key, actor.ulysses_sequence_parallel_size, model.path, model.override_config, policy_override)]
    if config.use_critic:
        degrees.append((critic_key, critic.ulysses_sequence_parallel_size, critic.model.path or model.path,
                        critic.model.override_config or model.override_config,
                        "critic.model.override_config" if critic.model.override_config else policy_override))
    problems = []
    for key, size, path, override_config, override_key in degrees:
        heads = model_heads(path, override_config, BUILTIN_PREFIX) if size > 1 else None
        if heads is not None:
            problems += [ConfigProblem(problem.path, problem.message) for problem in
                         sequence_parallel_problems(size, world_size=world_size(config), heads=heads, key=key)]
        implementation = override_config.get("attn_implementation")
        if size > 1 and implementation not in (None, "sdpa"):
            # Ulysses wraps SDPA only (trainer/distributed/ulysses.py: WRAPPABLE).
            problems.append(ConfigProblem(f"{override_key}.attn_implementation", f"got {implementation!r}, but {key} "
                                          f"is {size}: Ulysses' all-to-all wraps SDPA attention only; allowed: sdpa "
                                          "(or leave the key out), or the degree 1"))
    sizes = {size for _, size, *_ in degrees if size > 1}
    if len(sizes) > 1:
        problems.append(ConfigProblem(critic_key, f"got {critic.ulysses_sequence_parallel_size}, but {actor_key} is "
                                      f"{actor.ulysses_sequence_parallel_size}: a run has one sequence-parallel "
                                      "degree (its (dp, sp) mesh); allowed: 1 or the actor's"))
    if actor.sequence_parallel_offload:
        problems += _sequence_parallel_offload_problems(config)
    return problems


def _sequence_parallel_offload_problems(config: RunConfig) -> list[ConfigProblem]:
    """sequence_parallel_offload puts the policy's embedding and head on the CPU, sharded over every rank."""
    actor = config.actor_rollout_ref.actor
    key = "actor_rollout_ref.actor.sequence_parallel_offload"
    if actor.ulysses_sequence_parallel_size == 1:
        return [ConfigProblem(key, "got true, but actor_rollout_ref.actor.ulysses_sequence_parallel_size is 1: "
                              "it offloads each sequence-parallel rank's own shard of the embedding and head; "
                              "allowed: false, or a degree above 1 (to offload them on one rank, set "
                              "fsdp_config.offload_policy.embedding and lm_head to cpu)")]
    problems = []
    for role in ("actor", "ref"):
        policy = config.fsdp_configs().get(role)
        for group in ("embedding", "lm_head"):
            if policy is not None and getattr(policy.offload_policy, group) == "gpu":
                problems.append(ConfigProblem(f"{FSDP_PREFIX[role]}.offload_policy.{group}", f"got gpu, but {key} "
                                              f"is true, which keeps the policy's {group} on the CPU; allowed: cpu "
                                              "or unset, or sequence_parallel_offload false"))
    return problems


def _batch_sizes_for_ranks(config: RunConfig) -> list[ConfigProblem]:
    """verl's rules, no stricter: data.train_batch_size and ppo_mini_batch_size count prompts of the whole run. verl
    splits the step's sequences (prompts x rollout.n) among the ranks (utils/config.py: real_train_batch_size
    divisible by the GPUs, checked without use_dynamic_bsz), and each rank's mini-batch is ppo_mini_batch_size x
    rollout.n // the data-parallel groups sequences, which must be at least one (fsdp_workers.py). Prompts that do
    not divide among the ranks are split by their sequences (distributed/run_wide.py: StepShare)."""
    world, dp, sp = world_size(config), data_parallel_size(config), config.sequence_parallel_size
    n = config.actor_rollout_ref.rollout.n
    batch = config.data.train_batch_size
    problems = []
    critic_mini = config.critic.ppo_mini_batch_size if config.use_critic else None
    if (config.actor_rollout_ref.actor.use_dynamic_bsz and batch * n % dp and critic_mini is not None
            and critic_mini != config.actor_rollout_ref.actor.ppo_mini_batch_size):
        # verl skips its check then: the ranks take uneven shares of each actor mini-batch (run_wide.py), which the
        # critic's mini-batches of another size would cut otherwise on each rank.
        problems.append(ConfigProblem("critic.ppo_mini_batch_size", f"got {critic_mini}, but the step's {batch * n} "
                                      f"sequences (x rollout.n {n}) do not divide among the run's {dp} data-parallel "
                                      "groups, and uneven shares are dealt by the actor's mini-batches of "
                                      f"{config.actor_rollout_ref.actor.ppo_mini_batch_size}; allowed: the actor's "
                                      f"ppo_mini_batch_size, or data.train_batch_size a multiple of "
                                      f"{dp // math.gcd(dp, n)}"))
    if config.actor_rollout_ref.actor.use_dynamic_bsz and batch * n % dp and config.reward_model.enable:
        # The reward model scores each rank's share in micro-batches whose forwards gather its shards: a shorter
        # share runs fewer of them, and the ranks would wait on each other for good.
        problems.append(ConfigProblem("reward_model.enable", f"got true, but the step's {batch * n} sequences (x "
                                      f"rollout.n {n}) do not divide among the run's {dp} data-parallel groups, and "
                                      "a sharded reward model does not score uneven shares yet; allowed: "
                                      f"data.train_batch_size a multiple of {dp // math.gcd(dp, n)}, or a reward "
                                      "function instead of a reward model"))
    if batch * n % world and not config.actor_rollout_ref.actor.use_dynamic_bsz:
        problems.append(ConfigProblem("data.train_batch_size", f"got {batch}, whose {batch * n} sequences (x "
                                      f"rollout.n {n}) do not divide among the run's {world} ranks (trainer.nnodes x "
                                      "trainer.n_gpus_per_node); verl requires train_batch_size x rollout.n to be a "
                                      f"multiple of the GPUs; allowed: a multiple of {world // math.gcd(world, n)}"))
    groups = f"{dp} data-parallel groups" if sp > 1 else f"{dp} ranks"
    sizes = [("actor_rollout_ref.actor.ppo_mini_batch_size", config.actor_rollout_ref.actor.ppo_mini_batch_size)]
    if config.use_critic and config.critic.ppo_mini_batch_size is not None:
        sizes.append(("critic.ppo_mini_batch_size", config.critic.ppo_mini_batch_size))
    return problems + [
        ConfigProblem(key, f"got {size}, which leaves no sequence per rank: {size} x rollout.n {n} // {groups} is 0, "
                      f"and verl requires at least one; allowed: at least {-(-dp // n)}")
        for key, size in sizes if size * n // dp == 0]


def _single_rank_features(config: RunConfig) -> list[ConfigProblem]:
    """What works on one rank only: the embedding cache (one rank's rollout looks rows up on the host). Several
    ranks update an offloaded optimizer with HostAdamW (on the host: optimizer_update auto or cpu, delayed_update
    and bf16 host gradients too; on the GPU over moments streamed up, gpu, or split between the two, both: neither
    delayed), and move their shards' decoder layers with dynamic offload themselves
    (trainer/distributed/layer_moves.py). (Token-budget
    micro-batches work on several: every rank splits its share into as many, packing.plan_micro_batches; so does
    the static decoder: every rank decodes until every rank's rows have finished; and LoRA: FSDP2 shards the model
    with its adapter's layers.)"""
    world = world_size(config)
    why = f"works on one rank only, and this run has {world} (trainer.nnodes x trainer.n_gpus_per_node)"
    problems: list[ConfigProblem] = []
    if config.actor_rollout_ref.rollout.embedding_cache.enabled:
        # Several ranks' rollout reads an embedding gathered whole onto each GPU (FSDP2's all-gather of the unit,
        # or the whole weights held for the rollout): no row is looked up on the host, so there is nothing to cache.
        # A warning: the article's config (§4.2 with §4.3's sequence parallelism) runs on several GPUs as it is.
        problems.append(ConfigWarning("actor_rollout_ref.rollout.embedding_cache.enabled",
                                      f"got true, which {why}: several ranks' rollout gathers the whole embedding "
                                      "onto each GPU, so no row is looked up on the host and there is nothing to "
                                      "cache: it has no effect"))
    for role, fsdp in config.fsdp_configs().items():
        if fsdp.optimizer_update in ("gpu", "both") and fsdp.delayed_update and fsdp.optimizer_offload:
            problems.append(ConfigProblem(
                f"{FSDP_PREFIX[role]}.optimizer_update", f"got {fsdp.optimizer_update} with delayed_update true; on "
                "several ranks the update on the GPU changes the shards the rollout reads, so it cannot wait for the "
                "rollout to end; allowed: auto or cpu (the host's update, delayed), or delayed_update false"))
    return problems
