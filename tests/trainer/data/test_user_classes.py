"""verl's data classes of one's own (trainer/data/user_classes.py): a dataset class (data.custom_cls) built with
verl's signature, its rows in verl's layout; a sampler (data.sampler), a curriculum among them updated after each
step, through checkpoint and resume; and each problem one line naming the key."""

import json
import textwrap

import pytest

from trainer.config import ConfigError, load_config
from trainer.data.user_classes import UserClassError, UserSampler, prompt_sampler, read_records
from trainer.errors import RunSetupError
from trainer.loop import Trainer

DATASET = textwrap.dedent('''
    import json
    import numpy as np
    import torch

    class QuestionFile(torch.utils.data.Dataset):
        """A file of {"q", "a"} lines; as verl's RLHFDataset, the prompt's messages in raw_prompt (a numpy array,
        as a pandas row holds them), and what it was built with kept for the test."""

        def __init__(self, data_files, tokenizer, processor, config):
            self.rows = [json.loads(line) for file in data_files for line in open(file)]
            self.built_with = (tokenizer, processor, config.max_prompt_length, config.get("prompt_key"))

        def __len__(self):
            return len(self.rows)

        def __getitem__(self, index):
            row = self.rows[index]
            return {"raw_prompt": np.array([{"role": "user", "content": row["q"]}], dtype=object),
                    "data_source": "counting", "reward_model": {"style": "rule", "ground_truth": row["a"]},
                    "extra_info": {"index": np.int64(index)}, "input_ids": torch.zeros(3)}

    class Broken(torch.utils.data.Dataset):
        def __init__(self, data_files, tokenizer, processor, config):
            raise KeyError("answer_key")

    class NotADataset:
        pass
''')

CURRICULUM = textwrap.dedent('''
    SEEN = []

    class Reversed:
        """Yields the prompts last to first; each update moves the start back by the step's batch of sequences."""

        def __init__(self, data_source, data_config):
            self.size, self.batch_size, self.updates = len(data_source), data_config.train_batch_size, 0

        def __len__(self):
            return self.size

        def __iter__(self):
            return iter(range(self.size - 1, -1, -1))

        def update(self, batch):
            self.updates += 1
            SEEN.append((len(batch), sorted(batch.batch), batch.non_tensor_batch["data_source"][0]))

        def state_dict(self):
            return {"updates": self.updates}

        def load_state_dict(self, state):
            self.updates = state["updates"]
''')


def batches(size):
    return [f"data.train_batch_size={size}", f"actor_rollout_ref.actor.ppo_mini_batch_size={size}",
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={size}"]


def files(tmp_path, count=4):
    data = tmp_path / "questions.jsonl"
    data.write_text("".join(json.dumps({"q": f"count to {i}", "a": str(i)}) + "\n" for i in range(count)))
    dataset = tmp_path / "my_dataset.py"
    dataset.write_text(DATASET)
    return data, dataset


def test_a_dataset_class_is_built_with_verls_signature_and_its_rows_read_in_verls_layout(tmp_path):
    data, dataset = files(tmp_path)
    config = load_config(None, [f"data.train_files=[{data}]", f"data.custom_cls.path={dataset}",
                                "data.custom_cls.name=QuestionFile", "data.max_prompt_length=16"])
    records = read_records(config, config.data.train_files, "TOKENIZER", require_ground_truth=True)
    assert [record.prompt for record in records[:2]] == [[{"role": "user", "content": "count to 0"}],
                                                         [{"role": "user", "content": "count to 1"}]]
    assert [record.ground_truth for record in records] == ["0", "1", "2", "3"]
    assert records[3].extra_info == {"index": 3} and records[3].data_source == "counting"


@pytest.mark.parametrize(("name", "message"), [
    ("Missing", "data.custom_cls.path: '{path}' has no 'Missing'; set the name key to a class it defines"),
    ("Broken", "data.custom_cls.name: Broken(data_files=..., tokenizer=..., processor=None, config=...) raised "
               "KeyError: 'answer_key'"),
    ("NotADataset", "data.custom_cls.name: 'NotADataset' of '{path}' is not a torch.utils.data.Dataset subclass "
                    "(verl requires one)"),
])
def test_a_class_that_cannot_be_built_is_one_line_naming_the_key(tmp_path, name, message):
    data, dataset = files(tmp_path)
    config = load_config(None, [f"data.train_files=[{data}]", f"data.custom_cls.path={dataset}",
                                f"data.custom_cls.name={name}"])
    with pytest.raises(UserClassError) as caught:
        read_records(config, config.data.train_files, None, require_ground_truth=False)
    assert str(caught.value) == message.format(path=dataset)


def test_a_missing_file_or_a_lone_key_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError) as caught:
        load_config(None, [f"data.custom_cls.path={tmp_path}/none.py", "data.custom_cls.name=X",
                           "data.sampler.class_name=Curriculum"])
    text = str(caught.value)
    assert f"data.custom_cls.path: got '{tmp_path}/none.py', which is not a file" in text
    assert "data.sampler.class_path: got null, but data.sampler.class_name is set" in text


def test_a_user_sampler_batches_its_order_and_resumes_where_it_stopped(tmp_path):
    (tmp_path / "curriculum.py").write_text(CURRICULUM)
    config = load_config(None, [f"data.sampler.class_path={tmp_path}/curriculum.py", "data.sampler.class_name=Reversed",
                                *batches(2)])
    sampler = prompt_sampler(config, list(range(5)))
    assert isinstance(sampler, UserSampler) and sampler.steps_per_epoch == 2  # drop-last: 5 prompts, batches of 2
    assert [sampler.next_batch(), sampler.next_batch(), sampler.next_batch()] == [[4, 3], [2, 1], [4, 3]]
    sampler.sampler.updates = 7
    state = sampler.state_dict()
    resumed = prompt_sampler(config, list(range(5)))
    resumed.load_state_dict(state)
    assert resumed.epoch == 1 and resumed.next_batch() == [2, 1] and resumed.sampler.updates == 7
    plain = prompt_sampler(load_config(None, batches(2)), list(range(5)))
    with pytest.raises(ValueError, match="resume with the same data.sampler"):
        plain.load_state_dict(state)


def test_on_several_ranks_every_rank_takes_rank_0s_batch(tmp_path):
    (tmp_path / "curriculum.py").write_text(CURRICULUM)
    config = load_config(None, [f"data.sampler.class_path={tmp_path}/curriculum.py", "data.sampler.class_name=Reversed",
                                *batches(2)])
    drawn = []
    rank_0s = prompt_sampler(config, list(range(5)), agree=lambda batch: drawn.append(batch) or [0, 2])
    assert rank_0s.next_batch() == [0, 2] and drawn == [[4, 3]]  # this rank drew [4, 3]; rank 0 drew [0, 2]


def test_a_sampler_too_short_for_one_batch_is_a_setup_error(tmp_path):
    (tmp_path / "curriculum.py").write_text(CURRICULUM)
    config = load_config(None, [f"data.sampler.class_path={tmp_path}/curriculum.py", "data.sampler.class_name=Reversed",
                                *batches(8)])
    with pytest.raises(UserClassError, match="Reversed yields 5 indices, fewer than one batch"):
        prompt_sampler(config, list(range(5)))
    with pytest.raises(RunSetupError, match="5 prompts cannot fill one batch"):
        prompt_sampler(load_config(None, batches(8)), list(range(5)))


def test_a_curriculum_sampler_is_updated_with_each_steps_batch_in_a_run(tmp_path):
    (tmp_path / "curriculum.py").write_text(CURRICULUM)
    config = load_config(None, [
        "actor_rollout_ref.model.override_config={num_hidden_layers: 1, hidden_size: 32, intermediate_size: 64}",
        "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4", "data.max_prompt_length=8",
        "data.max_response_length=4", "trainer.device=cpu", "trainer.total_training_steps=2",
        "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2", f"trainer.runs_dir={tmp_path}",
        f"data.sampler.class_path={tmp_path}/curriculum.py", "data.sampler.class_name=Reversed"])
    trainer = Trainer(config, log=lambda *_: None)
    trainer.fit()
    updates = type(trainer.sampler.sampler).update.__globals__["SEEN"]  # the user's module's list
    assert len(updates) == 2  # one update per step, with the step's 4 prompts x 2 responses in verl's names
    assert updates[0][0] == 8 and {"responses", "token_level_scores", "advantages"} <= set(updates[0][1])
    assert updates[0][2] == "counting"
