"""A GGUF model file as actor_rollout_ref.model.path: the config's check, and the one-line errors of a file the
trainer cannot read. Tiny GGUF files are written here with the gguf package (the real model's whole conversion is
tests/trainer/models/test_real_model.py's, slow-marked)."""

import builtins
import importlib.util

import numpy as np
import pytest

from trainer.config import ConfigError, load_config
from trainer.models.gguf import GGUFError, check_gguf_file, gguf_directory

gguf = pytest.importorskip("gguf", reason="the gguf package (the real-model extra: make real-model) is not installed")


def write_gguf(path, architecture="llama", elements=4096):
    """A GGUF file with one float32 tensor of `elements` values."""
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.arange(elements, dtype=np.float32).reshape(-1, 64))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gguf_model_path_is_checked_as_a_file(tmp_path):
    model = write_gguf(tmp_path / "model.gguf")
    assert load_config(None, [f"actor_rollout_ref.model.path={model}"]).actor_rollout_ref.model.path == str(model)
    with pytest.raises(ConfigError) as error:
        load_config(None, [f"actor_rollout_ref.model.path={tmp_path / 'missing.gguf'}"])
    assert "actor_rollout_ref.model.path: got" in str(error.value)
    assert "which is not a file; allowed: a GGUF model file" in str(error.value)


def test_the_config_check_names_the_missing_gguf_package_and_the_extra(tmp_path, monkeypatch):
    model = write_gguf(tmp_path / "model.gguf")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else find_spec(name, *a))
    with pytest.raises(ConfigError) as error:
        load_config(None, [f"actor_rollout_ref.model.path={model}"])
    assert "but the gguf package that reads it is not installed; pip install 'verl-offload[real-model]'" in str(
        error.value)


def test_the_loader_names_the_missing_gguf_package_in_one_line(tmp_path, monkeypatch):
    model = write_gguf(tmp_path / "model.gguf")
    real_import = builtins.__import__

    def without_gguf(name, *args, **kwargs):
        if name == "gguf":
            raise ImportError("No module named 'gguf'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without_gguf)
    with pytest.raises(GGUFError) as error:
        check_gguf_file(model, "actor_rollout_ref.model.path")
    message = str(error.value)
    assert "\n" not in message and message.endswith("is not installed; pip install 'verl-offload[real-model]' "
                                                    "(or `make real-model`)")


@pytest.mark.parametrize("kept", [0.5, 0.98, 0.02])
def test_a_file_cut_short_is_named_damaged_or_incomplete(tmp_path, kept):
    whole = write_gguf(tmp_path / "whole.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[:int(len(whole) * kept)])
    with pytest.raises(GGUFError) as error:
        check_gguf_file(cut, "actor_rollout_ref.model.path")
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"actor_rollout_ref.model.path: the GGUF file {str(cut)!r} is")
    assert "incomplete" in message and message.endswith("copy or download it again")


def test_a_file_that_is_not_gguf_says_so(tmp_path):
    other = tmp_path / "notes.gguf"
    other.write_text("a text file with the wrong name " * 4)
    with pytest.raises(GGUFError, match=r"is not a GGUF file \(its first bytes are not GGUF's magic number\)"):
        check_gguf_file(other, "actor_rollout_ref.model.path")


def test_an_architecture_transformers_cannot_read_from_gguf_is_named(tmp_path):
    model = write_gguf(tmp_path / "rwkv.gguf", architecture="rwkv6")
    with pytest.raises(GGUFError) as error:
        check_gguf_file(model, "actor_rollout_ref.model.path")
    message = str(error.value)
    assert "\n" not in message and "holds a 'rwkv6' model, which transformers" in message
    assert "cannot read from GGUF; allowed architectures: llama, mistral, qwen2" in message


def test_a_readable_file_passes_the_check_and_a_missing_one_is_refused(tmp_path):
    check_gguf_file(write_gguf(tmp_path / "model.gguf"), "actor_rollout_ref.model.path")  # no error
    with pytest.raises(GGUFError, match="'nowhere.gguf' is not a file"):
        gguf_directory("nowhere.gguf")


def test_verl_train_check_reads_a_gguf_file_instead_of_a_config_json(tmp_path):
    from trainer.check import _unreadable_model_configs

    good = write_gguf(tmp_path / "model.gguf")
    assert _unreadable_model_configs(load_config(None, [f"actor_rollout_ref.model.path={good}"])) == []
    unreadable = write_gguf(tmp_path / "rwkv.gguf", architecture="rwkv6")
    problems = _unreadable_model_configs(load_config(None, [f"actor_rollout_ref.model.path={unreadable}"]))
    # The default run's critic starts from the actor's model: both keys are named.
    assert [problem.split(":")[0] for problem in problems] == ["actor_rollout_ref.model.path", "critic.model.path"]
    assert all("the GGUF file" in problem and "holds a 'rwkv6' model" in problem for problem in problems)
