"""The tiny preset, loading models from local directories, and whole runs from a saved model."""

import copy
import json
import shutil
import socket

import pytest
import torch
from transformers import Qwen2ForSequenceClassification
from transformers.utils import logging as transformers_logging

from tests.support import REPO
from trainer.checkpoint import latest_checkpoint
from trainer.config import ConfigError, load_config
from trainer.loop import Trainer
from trainer.models import ModelLoadError, load_critic, load_policy, load_reward_model, load_tokenizer
from trainer.models.tiny import UNK, VOCABULARY, seeded_init, tiny_qwen2_config
from trainer.rewards.manager import ModelReward

TINY = "builtin:tiny-qwen2"
ONE_LAYER = {"num_hidden_layers": 1}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TINY)


def policy(tokenizer, seed=1, **options):
    options.setdefault("override_config", ONE_LAYER)
    return load_policy(TINY, tokenizer, dtype=options.pop("dtype", torch.float32), seed=seed, **options)


def assert_same_weights(first: torch.nn.Module, second: torch.nn.Module) -> None:
    first_state, second_state = first.state_dict(), second.state_dict()
    assert first_state.keys() == second_state.keys()
    for name, tensor in first_state.items():
        assert torch.equal(tensor, second_state[name]), name


def logits(model, tokenizer, text="1 2 3 4"):
    ids = torch.tensor([tokenizer(text)["input_ids"]])
    with torch.no_grad():
        return model(input_ids=ids).logits


# --------------------------------------------------------------------------------------- preset


def test_tiny_policy_is_built_from_the_seed_alone(tokenizer):
    first = policy(tokenizer, seed=4)
    torch.manual_seed(123)  # the global RNG must not matter
    torch.rand(10)
    assert_same_weights(first, policy(tokenizer, seed=4))
    other = policy(tokenizer, seed=5)
    assert not torch.equal(first.model.embed_tokens.weight, other.model.embed_tokens.weight)


def test_override_config_shapes_the_preset(tokenizer):
    model = policy(tokenizer, override_config={"num_hidden_layers": 1, "hidden_size": 32})
    assert len(model.model.layers) == 1
    assert model.model.embed_tokens.weight.shape == (len(VOCABULARY), 32)
    assert model.config.pad_token_id == tokenizer.pad_token_id
    assert model.config.use_cache is False


def test_tiny_critic_shares_the_policy_backbone(tokenizer):
    actor = policy(tokenizer, seed=4)
    critic = load_critic(TINY, tokenizer, dtype=torch.float32, seed=4, override_config=ONE_LAYER)
    assert_same_weights(critic.model, actor.model)
    assert critic.score.out_features == 1
    assert logits(critic, tokenizer).shape == (1, 4, 1)


def test_tiny_reward_model_is_a_frozen_scorer(tokenizer):
    reward_model = load_reward_model(TINY, tokenizer, dtype=torch.float32, seed=4)
    assert not reward_model.training
    assert not any(parameter.requires_grad for parameter in reward_model.parameters())
    assert logits(reward_model, tokenizer).shape == (1, 1)


def test_tiny_tokenizer_round_trips_digits_and_maps_unknown_words(tokenizer):
    text = "1 2 + 3 4 = 4 6 : 0 9 - 5"
    ids = tokenizer(text)["input_ids"]
    assert len(ids) == len(text.split())
    assert tokenizer.decode(ids) == text
    assert tokenizer("1 hello 2")["input_ids"] == [VOCABULARY.index("1"), VOCABULARY.index(UNK), VOCABULARY.index("2")]
    assert tokenizer.padding_side == "left"
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id) == (0, 1)
    assert tokenizer.decode([VOCABULARY.index("7"), tokenizer.eos_token_id, 0], skip_special_tokens=True) == "7"


def checkpointing_on(model) -> bool:
    # transformers 5.2x renamed the attribute; older 5.x (the GPU machine's 5.17) has only the old name.
    if hasattr(model, "is_activation_checkpointing"):
        return model.is_activation_checkpointing
    return model.is_gradient_checkpointing


def test_gradient_checkpointing_flag(tokenizer):
    assert not checkpointing_on(policy(tokenizer))
    assert checkpointing_on(policy(tokenizer, gradient_checkpointing=True))
    critic = load_critic(TINY, tokenizer, dtype=torch.float32, seed=1, override_config=ONE_LAYER,
                         gradient_checkpointing=True)
    assert checkpointing_on(critic)


def test_bf16_loads_bf16_parameters(tokenizer):
    model = policy(tokenizer, dtype=torch.bfloat16)
    assert {parameter.dtype for parameter in model.parameters()} == {torch.bfloat16}


# ---------------------------------------------------------------------------- model directories


@pytest.fixture(scope="module")
def saved_policy(tokenizer, tmp_path_factory):
    """A tiny policy and its tokenizer, written as a HuggingFace model directory."""
    directory = tmp_path_factory.mktemp("policy")
    model = policy(tokenizer, seed=7)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory, model


def test_tokenizer_from_a_directory(tokenizer, saved_policy):
    directory, _ = saved_policy
    loaded = load_tokenizer(str(directory))
    text = "3 4 hello 5"
    assert loaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    # The scorers read words separated by spaces: a byte-level rebuild would decode "345".
    assert loaded.decode(loaded("3 4 5")["input_ids"]) == "3 4 5"
    assert (loaded.pad_token_id, loaded.eos_token_id) == (tokenizer.pad_token_id, tokenizer.eos_token_id)
    assert loaded.padding_side == "left"
    messages = [{"role": "user", "content": "1 2"}]
    assert loaded.apply_chat_template(messages, tokenize=False) == "1 2 "


def test_policy_from_a_directory_has_the_saved_weights(tokenizer, saved_policy):
    directory, model = saved_policy
    loaded = load_policy(str(directory), tokenizer, dtype=torch.float32, seed=99)
    assert_same_weights(loaded, model)
    torch.testing.assert_close(logits(loaded, tokenizer), logits(model, tokenizer), atol=0, rtol=0)
    assert not checkpointing_on(loaded)


def test_critic_from_a_directory_takes_the_policy_backbone(tokenizer, saved_policy):
    directory, model = saved_policy
    critic = load_critic(str(directory), tokenizer, dtype=torch.float32, seed=99, gradient_checkpointing=True)
    assert_same_weights(critic.model, model.model)
    assert critic.score.out_features == 1
    assert checkpointing_on(critic)
    assert logits(critic, tokenizer).shape == (1, 4, 1)


def test_bf16_from_a_directory(tokenizer, saved_policy):
    directory, model = saved_policy
    loaded = load_policy(str(directory), tokenizer, dtype=torch.bfloat16, seed=1)
    assert {parameter.dtype for parameter in loaded.parameters()} == {torch.bfloat16}
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight.to(torch.bfloat16))


@pytest.mark.parametrize("what", ["tokenizer", "model", "critic", "reward model"])
@pytest.mark.parametrize("folder", ["empty", "missing"])
def test_a_directory_that_is_not_a_model(tokenizer, tmp_path, what, folder):
    path = tmp_path / folder
    if folder == "empty":
        path.mkdir()
    loaders = {
        "tokenizer": lambda: load_tokenizer(str(path)),
        "model": lambda: load_policy(str(path), tokenizer, dtype=torch.float32, seed=1),
        "critic": lambda: load_critic(str(path), tokenizer, dtype=torch.float32, seed=1),
        "reward model": lambda: load_reward_model(str(path), tokenizer, dtype=torch.float32, seed=1),
    }
    with pytest.raises(ModelLoadError) as error:
        loaders[what]()
    message = str(error.value)
    assert message.startswith(f"could not load the {what} from {str(path)!r}")
    assert "\n" not in message


def damaged_copy(saved_policy, tmp_path, damage: str):
    """The saved policy's directory with one file damaged as users' copies are."""
    directory = tmp_path / damage
    shutil.copytree(saved_policy[0], directory)
    if damage == "wrong type":
        config = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps({**config, "num_hidden_layers": "two"}))
    elif damage == "truncated weights":
        weights = (directory / "model.safetensors").read_bytes()
        (directory / "model.safetensors").write_bytes(weights[:len(weights) // 2])
    else:  # no tokenizer files: config and weights only
        for file in directory.iterdir():
            if file.name not in ("config.json", "model.safetensors"):
                file.unlink()
    return directory


LOADERS = {
    "model": lambda path, tokenizer: load_policy(str(path), tokenizer, dtype=torch.float32, seed=1),
    "critic": lambda path, tokenizer: load_critic(str(path), tokenizer, dtype=torch.float32, seed=1),
    "reward model": lambda path, tokenizer: load_reward_model(str(path), tokenizer, dtype=torch.float32, seed=1),
}


DAMAGES = {
    "wrong type": "'{directory}/config.json': Validation error for field 'num_hidden_layers': TypeError: Field "
                  "'num_hidden_layers' expected int, got str (value: 'two')",
    "truncated weights": "'{directory}/model.safetensors' is damaged or incomplete (Error while deserializing header: "
                         "incomplete metadata, file not fully covered); copy or download it again",
}


@pytest.mark.parametrize("damage", list(DAMAGES))
@pytest.mark.parametrize("what", list(LOADERS))
def test_a_damaged_model_directory_is_one_line_naming_the_file(tokenizer, saved_policy, tmp_path, what, damage):
    """A config.json field of the wrong type, or a truncated model.safetensors."""
    directory = damaged_copy(saved_policy, tmp_path, damage)
    with pytest.raises(ModelLoadError) as error:
        LOADERS[what](directory, tokenizer)
    assert str(error.value) == f"could not load the {what} from '{directory}': " + DAMAGES[damage].format(
        directory=directory)


def test_a_model_directory_without_tokenizer_files_names_tokenizer_path(saved_policy, tmp_path):
    directory = damaged_copy(saved_policy, tmp_path, "no tokenizer")
    # It used to load as a tokenizer of no words: "a prompt is empty after tokenization" at the first step.
    with pytest.raises(ModelLoadError) as error:
        load_tokenizer(str(directory))
    assert str(error.value) == (f"'{directory}' holds no tokenizer (no vocabulary: tokenizer.json, vocab.json, "
                                "tokenizer.model ...); set actor_rollout_ref.model.tokenizer_path to the model's "
                                "tokenizer directory")
    with pytest.raises(ModelLoadError, match="set reward_model.model.tokenizer_path to"):
        load_tokenizer(str(directory), setting="reward_model.model.tokenizer_path")


def test_the_readme_gives_the_built_in_tokenizers_size():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert f"{len(VOCABULARY)}-token tokenizer" in readme  # it said "19-word" of these 17 tokens


# -------------------------------------------------------------------------------- whole runs


def run_overrides(model_directory, runs_dir, steps: int) -> list[str]:
    return [
        f"actor_rollout_ref.model.path={model_directory}",
        "data.train_batch_size=8",
        "data.max_prompt_length=8",
        "data.max_response_length=6",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        f"trainer.total_training_steps={steps}",
        f"trainer.runs_dir={runs_dir}",
        "trainer.device=cpu",
    ]


def test_a_run_from_a_model_directory(saved_policy, tmp_path):
    directory, model = saved_policy
    config = load_config(None, run_overrides(directory, tmp_path, steps=2))
    trainer = Trainer(config, log=lambda *_: None)
    assert trainer.critic is not None, "gae trains a critic, loaded from the policy's directory"
    trainer.fit()

    run_dir = tmp_path / "run"
    lines = (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]
    assert all(json.loads(line)["response_length/max"] <= 6 for line in lines)
    checkpoint = latest_checkpoint(run_dir / "checkpoints")
    assert checkpoint is not None and checkpoint.name == "global_step_2"
    assert (checkpoint / "actor" / "model.safetensors").is_file()
    assert (checkpoint / "critic" / "model.safetensors").is_file()
    assert not torch.equal(trainer.actor.model.model.embed_tokens.weight, model.model.embed_tokens.weight), \
        "two steps must have changed the actor"


@pytest.fixture(scope="module")
def saved_reward_model(tokenizer, tmp_path_factory):
    directory = tmp_path_factory.mktemp("reward_model")
    model = seeded_init(Qwen2ForSequenceClassification, tiny_qwen2_config(tokenizer, ONE_LAYER, num_labels=1), 11)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def test_a_run_scored_by_a_reward_model(tokenizer, saved_policy, saved_reward_model, tmp_path):
    directory, _ = saved_policy
    overrides = [*run_overrides(directory, tmp_path, steps=1), "reward_model.enable=true",
                 f"reward_model.model.path={saved_reward_model}",
                 # Greedy, so the batch the test scores below is the batch the step scores.
                 "actor_rollout_ref.rollout.do_sample=false"]
    trainer = Trainer(load_config(None, overrides), log=lambda *_: None)
    sampler = copy.deepcopy(trainer.sampler)
    batch = trainer.generation.generate([trainer.records[index] for index in sampler.next_batch()])
    reward_tokenizer = load_tokenizer(str(saved_reward_model))
    reward_model = load_reward_model(str(saved_reward_model), reward_tokenizer, dtype=torch.float32, seed=0)
    # A smaller micro-batch than the run's: the score of a response must not depend on its neighbours.
    scores = ModelReward(reward_model, tokenizer, reward_tokenizer, micro_batch_size=3, max_length=14)(batch)
    assert scores.shape == (8,)
    assert not torch.equal(scores * 4, (scores * 4).round()), "these look like rule-based scores"

    trainer.fit()
    [metrics] = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert metrics["critic/score/mean"] == pytest.approx(scores.mean().item(), abs=1e-6)
    assert metrics["critic/score/max"] == pytest.approx(scores.max().item(), abs=1e-6)
    assert metrics["critic/score/min"] == pytest.approx(scores.min().item(), abs=1e-6)


def test_a_reward_model_micro_batch_out_of_memory_is_split_and_scores_the_same(tokenizer, saved_policy,
                                                                               saved_reward_model, tmp_path):
    from tests.trainer.workers.test_oom_recovery import Memory

    directory, _ = saved_policy
    trainer = Trainer(load_config(None, run_overrides(directory, tmp_path, steps=1)), log=lambda *_: None)
    batch = trainer.generation.generate([trainer.records[index] for index in trainer.sampler.next_batch()])
    reward_tokenizer = load_tokenizer(str(saved_reward_model))
    reward_model = load_reward_model(str(saved_reward_model), reward_tokenizer, dtype=torch.float32, seed=0)
    memory = Memory()
    reward = ModelReward(reward_model, tokenizer, reward_tokenizer, micro_batch_size=4, max_length=14, memory=memory)
    expected = reward(batch)
    sizes = []

    def fail_on_the_second_micro_batch(module, args, kwargs):
        sizes.append(kwargs["input_ids"].shape[0])
        if len(sizes) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    handle = reward_model.register_forward_pre_hook(fail_on_the_second_micro_batch, with_kwargs=True)
    try:
        scores = reward(batch)
    finally:
        handle.remove()
    assert sizes == [4, 4, 2, 2] and memory.recoveries == 1
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-6)


def test_the_built_in_model_takes_a_larger_vocabulary_and_refuses_a_smaller_one(tokenizer):
    model = load_policy("builtin:tiny-qwen2", tokenizer, dtype=torch.float32, seed=0,
                        override_config={"vocab_size": 1000})
    assert model.model.embed_tokens.weight.shape[0] == 1000 and model.lm_head.weight.shape[0] == 1000
    with pytest.raises(ModelLoadError, match=r"^could not build the built-in model from override_config: vocab_size: "
                                             rf"got 3; allowed: an integer of at least the built-in tokenizer's "
                                             rf"{len(tokenizer)} tokens$"):
        load_policy("builtin:tiny-qwen2", tokenizer, dtype=torch.float32, seed=0, override_config={"vocab_size": 3})


def test_loading_a_model_directory_prints_no_progress_bar(tmp_path, capfd):
    tokenizer = load_tokenizer("builtin:tiny-qwen2")
    load_policy("builtin:tiny-qwen2", tokenizer, dtype=torch.float32, seed=1,
                override_config={"num_hidden_layers": 1}).save_pretrained(tmp_path)
    capfd.readouterr()
    load_policy(str(tmp_path), tokenizer, dtype=torch.float32, seed=1)
    captured = capfd.readouterr()
    assert "Loading weights" not in captured.err + captured.out
    assert transformers_logging.is_progress_bar_enabled(), "the bars are silenced for our loads only"


# ------------------------------------------------------------------------------ hub model ids

HUB_ID = "Org/Tiny-Qwen2"


@pytest.fixture
def hub_cache(tokenizer, saved_policy, tmp_path, monkeypatch):
    """A Hugging Face hub cache in its on-disk layout holding HUB_ID (the saved policy and its tokenizer) as a
    download leaves it, pointed at by HF_HUB_CACHE; offline, and with every network connection refused."""
    cache = tmp_path / "hub"
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / "models--Org--Tiny-Qwen2"
    shutil.copytree(saved_policy[0], repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def no_network(*args, **kwargs):
        raise AssertionError(f"a test reached for the network: {args}")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    return cache, repo / "snapshots" / revision


def test_a_hub_id_loads_from_the_local_cache(tokenizer, saved_policy, hub_cache):
    loaded_tokenizer = load_tokenizer(HUB_ID)
    assert loaded_tokenizer("3 4 5")["input_ids"] == tokenizer("3 4 5")["input_ids"]
    assert_same_weights(load_policy(HUB_ID, tokenizer, dtype=torch.float32, seed=99), saved_policy[1])
    assert_same_weights(load_critic(HUB_ID, tokenizer, dtype=torch.float32, seed=99).model, saved_policy[1].model)


def test_a_run_from_a_cached_hub_id(hub_cache, tmp_path):
    config = load_config(None, [*run_overrides(HUB_ID, tmp_path, steps=1), f"critic.model.path={HUB_ID}"])
    assert config.actor_rollout_ref.model.path == HUB_ID, "the config keeps the id the user wrote"
    trainer = Trainer(config, log=lambda *_: None)
    trainer.fit()
    assert [row["step"] for row in trainer.metrics_log.read()] == [1]


@pytest.mark.parametrize("key", ["actor_rollout_ref.model.path", "actor_rollout_ref.model.tokenizer_path",
                                 "critic.model.path", "reward_model.model.path"])
def test_a_hub_id_not_in_the_cache_is_one_line_saying_how_to_fill_it(hub_cache, tmp_path, key):
    cache, _ = hub_cache
    overrides = [*run_overrides("builtin:tiny-qwen2", tmp_path, steps=1), f"{key}=Qwen/Qwen2.5-7B-Instruct"]
    if key.startswith("reward_model"):
        overrides.append("reward_model.enable=true")
    with pytest.raises(ConfigError) as error:
        load_config(None, overrides)
    [problem] = [problem for problem in error.value.problems if problem.path == key]
    message = str(problem)
    assert "\n" not in message
    assert message.startswith(f"{key}: got 'Qwen/Qwen2.5-7B-Instruct' is not a local directory, and the hub model "
                              f"Qwen/Qwen2.5-7B-Instruct is not in the local Hugging Face cache {str(cache)!r}")
    assert "`hf download Qwen/Qwen2.5-7B-Instruct`" in message and "HF_HUB_CACHE" in message


def test_the_loader_refuses_an_uncached_hub_id_in_one_line(tokenizer, hub_cache):
    cache, _ = hub_cache
    with pytest.raises(ModelLoadError) as error:
        load_policy("Qwen/Qwen2.5-7B-Instruct", tokenizer, dtype=torch.float32, seed=1)
    message = str(error.value)
    assert "\n" not in message and str(cache) in message and "hf download Qwen/Qwen2.5-7B-Instruct" in message


def test_the_hub_cache_follows_hf_home_when_hf_hub_cache_is_unset(tokenizer, hub_cache, tmp_path, monkeypatch):
    cache, _ = hub_cache
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(cache.parent))  # the cache is HF_HOME/hub
    assert load_tokenizer(HUB_ID)("3 4")["input_ids"] == tokenizer("3 4")["input_ids"]
    monkeypatch.setenv("HF_HOME", str(tmp_path / "elsewhere"))
    with pytest.raises(ModelLoadError, match="elsewhere"):
        load_tokenizer(HUB_ID)


def test_a_cached_snapshot_without_config_json_names_the_snapshot(hub_cache, tmp_path):
    _, snapshot = hub_cache
    (snapshot / "config.json").unlink()
    with pytest.raises(ConfigError) as error:
        load_config(None, run_overrides(HUB_ID, tmp_path, steps=1))
    assert f"(its cached snapshot {str(snapshot)!r}), a directory without config.json" in str(error.value)
