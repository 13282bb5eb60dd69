"""verl's actor.freeze_vision_tower (trainer/models/vision.py): a vision-language model's vision encoder stops
training; a text model's run says in one NOTE line that the setting had no effect."""

import torch

from trainer.config import load_config
from trainer.models.vision import freeze_vision_tower


class VisionLanguage(torch.nn.Module):
    """transformers' layout since 4.52: the vision encoder at model.visual, beside the language model."""

    def __init__(self):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.visual = torch.nn.Linear(4, 4)
        self.model.language_model = torch.nn.Linear(4, 4)
        self.lm_head = torch.nn.Linear(4, 8)


def test_the_vision_tower_stops_training_and_the_language_model_does_not():
    model, lines = VisionLanguage(), []
    freeze_vision_tower(model, lines.append)
    assert [name for name, parameter in model.named_parameters() if not parameter.requires_grad] == [
        "model.visual.weight", "model.visual.bias"]
    assert lines == ["actor_rollout_ref.actor.freeze_vision_tower: the vision tower's 20 parameters are frozen "
                     "(not trained)"]


def test_a_text_model_trains_whole_and_a_note_says_the_setting_had_no_effect():
    model, lines = torch.nn.Sequential(torch.nn.Linear(4, 4)), []
    freeze_vision_tower(model, lines.append)
    assert all(parameter.requires_grad for parameter in model.parameters())
    assert lines == ["NOTE: actor_rollout_ref.actor.freeze_vision_tower=true: no effect, the model has no vision "
                     "tower (a text model)"]


def test_verls_key_loads(tmp_path):
    config = load_config(None, ["actor_rollout_ref.actor.freeze_vision_tower=True"])
    assert config.actor_rollout_ref.actor.freeze_vision_tower is True
